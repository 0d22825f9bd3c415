"""The membership log: the job's events (records.MembershipEvent), read through `JobStore.read_events`, appended
to <log-dir>/membership.jsonl, rendered as a table."""

from __future__ import annotations

import fcntl
import json
import os
import threading
from collections.abc import Callable, Iterable
from datetime import datetime
from pathlib import Path

from launcher.rendezvous.records import MembershipEvent

LOG_FILE_NAME = "membership.jsonl"
EventReader = Callable[[int], list[MembershipEvent]]  # the events above a revision, in log order


class LogMirror:
    """Appends the job's events from etcd to one membership.jsonl, once each, even when agents share the file.

    One mirror per file and process (`for_dir`): agents that share a process and a log directory read each
    event from etcd once between them.
    """

    _by_path: dict[Path, LogMirror] = {}
    _registry_lock = threading.Lock()

    def __init__(self, log_dir: Path) -> None:
        self.path = Path(log_dir) / LOG_FILE_NAME
        self.seen_revision = 0
        self._lock = threading.Lock()  # one sync at a time: seen_revision and the file move together

    @classmethod
    def for_dir(cls, log_dir: Path) -> LogMirror:
        path = (Path(log_dir) / LOG_FILE_NAME).resolve()
        with cls._registry_lock:
            mirror = cls._by_path.get(path)
            if mirror is None:
                mirror = cls._by_path[path] = cls(log_dir)
            return mirror

    def sync(self, read: EventReader) -> None:
        """Append the events `read(after_revision)` returns (a JobStore's `read_events`) that the file lacks."""
        with self._lock:
            events = read(self.seen_revision)
            if events:
                self._append(events)

    def _append(self, events: list[MembershipEvent]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a+") as file:
            fcntl.flock(file, fcntl.LOCK_EX)
            written = _last_revision(file)
            fresh = [e for e in events if (e.revision or 0) > written]  # read back from etcd: all have one
            file.write("".join(e.dumps() + "\n" for e in fresh))
            file.flush()
            os.fsync(file.fileno())
        self.seen_revision = events[-1].revision or self.seen_revision


def _last_revision(file) -> int:
    file.seek(0, os.SEEK_END)
    size = file.tell()
    file.seek(max(0, size - 65536))
    lines = file.read().splitlines()
    for line in reversed(lines):
        try:
            return int(json.loads(line).get("revision", 0))
        except (ValueError, AttributeError):
            continue
    return 0


def _details(event: MembershipEvent) -> str:
    parts = []
    if event.world_size is not None:
        parts.append(f"world_size={event.world_size}")
    if event.members:
        ranks = " ".join(f"{m['node']}[{m['first_rank']}-{m['last_rank']}]" for m in event.members)
        parts.append(f"members={ranks}")
    elif event.size is not None:
        parts.append(f"size={event.size}")
    for name in (
        "local_rank",
        "rank",
        "exit_code",
        "restart_count",
        "seconds_silent",
        "last_step",
        "step",
        "inprocess",
        "prepared",
        "fresh",
    ):
        value = getattr(event, name)
        if value is not None:
            parts.append(f"{name}={value:.1f}" if isinstance(value, float) else f"{name}={value}")
    if event.replaced:
        parts.append("replaced=" + ",".join(f"{r['node']}->{r['by']}" for r in event.replaced))
    if event.reason:
        parts.append(f"reason={event.reason}")
    if event.message:
        parts.append(event.message.splitlines()[0][:160])
    return " ".join(parts)


def format_table(events: Iterable[MembershipEvent], header: bool = True) -> str:
    rows = [
        (
            datetime.fromtimestamp(e.time).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3],
            "" if e.round is None else str(e.round),
            e.event,
            e.node or "",
            _details(e),
        )
        for e in events
    ]
    titles = ("TIME", "ROUND", "EVENT", "NODE", "DETAILS")
    widths = [23, 5, 17, max([len(r[3]) for r in rows] + [4])]
    lines = []
    if header:
        lines.append("  ".join(t.ljust(w) for t, w in zip(titles, widths)) + "  " + titles[-1])
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])
    return "\n".join(lines)
