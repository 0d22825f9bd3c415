"""Where a round's worker stdout and stderr go: log files (--redirects), the agent's console with a rank prefix
(--tee, --local-ranks-filter), and copies of matching lines (--duplicate-std{out,err}-filters)."""

from __future__ import annotations

import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from launcher.config import LaunchConfig, Std

STREAMS = ("stdout", "stderr")
_PUMP_JOIN_S = 2.0  # how long stopping waits for the pumps to copy what the workers wrote last


class LineDuplicator:
    """torchrun's --duplicate-std{out,err}-filters: every line of any local worker's stream that contains one of
    `filters` is copied into one file of the attempt (`filtered_stdout.log`, `filtered_stderr.log`)."""

    def __init__(self, path: Path, filters: list[str]) -> None:
        self.path = path
        self.filters = [f.encode() for f in filters if f]
        self._lock = threading.Lock()
        self._file: IO[bytes] | None = None

    def offer(self, line: bytes) -> None:
        if not any(f in line for f in self.filters):
            return
        with self._lock:
            if self._file is None:
                self._file = open(self.path, "ab")
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()


@dataclass
class StreamRoute:
    """Where one worker stream goes: the Popen argument, its log file, the console (and the line prefix there), and
    the duplicator of filtered lines; the agent pumps it line by line when the argument is a pipe."""

    target: IO[bytes] | int | None  # a log file, subprocess.PIPE, or None: the agent's own stream
    log_file: IO[bytes] | None = None
    console: IO[str] | None = None
    prefix: str = ""
    duplicator: LineDuplicator | None = None


def _pump(source: IO[bytes], route: StreamRoute) -> None:
    """Copy a worker's stream line by line into its log file, onto the agent's console, and its filtered lines."""
    with source:
        for line in iter(source.readline, b""):
            if route.log_file is not None:
                route.log_file.write(line)
                route.log_file.flush()
            if route.console is not None:
                route.console.write(route.prefix + line.decode(errors="replace"))
                route.console.flush()
            if route.duplicator is not None:
                route.duplicator.offer(line)
    if route.log_file is not None:
        route.log_file.close()


class WorkerOutput:
    """The output of one round's local workers: a route per stream, and the threads that pump piped ones."""

    def __init__(self, config: LaunchConfig, attempt_dir: Path, first_rank: int) -> None:
        self.config = config
        self.first_rank = first_rank
        self._pumps: list[threading.Thread] = []
        self._duplicators = {
            name: LineDuplicator(attempt_dir / f"filtered_{name}.log", filters)
            for name, filters in (
                ("stdout", config.duplicate_stdout_filters),
                ("stderr", config.duplicate_stderr_filters),
            )
            if any(filters)
        }

    def _tee_and_redirect(self, local_rank: int, name: str) -> tuple[bool, bool]:
        includes = Std.includes_out if name == "stdout" else Std.includes_err
        tee = includes(self.config.std_for(self.config.tee, local_rank))
        return tee, tee or includes(self.config.std_for(self.config.redirects, local_rank))

    def _shown(self, local_rank: int) -> bool:
        return self.config.local_ranks_filter is None or local_rank in self.config.local_ranks_filter

    def _prefix(self, local_rank: int) -> str:
        return f"[{self.config.role}{self.first_rank + local_rank}]:"

    def route(self, directory: Path, local_rank: int, name: str) -> StreamRoute:
        """Where one stream goes under --redirects, --tee and --duplicate-std{out,err}-filters."""
        tee, redirect = self._tee_and_redirect(local_rank, name)
        duplicator = self._duplicators.get(name)
        log_file = open(directory / f"{name}.log", "ab") if redirect else None
        if not tee and duplicator is None:
            return StreamRoute(target=log_file, log_file=log_file)
        console = sys.stdout if name == "stdout" else sys.stderr
        if tee:
            shown = console if self._shown(local_rank) else None
            return StreamRoute(subprocess.PIPE, log_file, shown, self._prefix(local_rank), duplicator)
        # only duplicated: the stream reaches its log file or the console as it would without the filters
        return StreamRoute(subprocess.PIPE, log_file, None if redirect else console, "", duplicator)

    def append_to_stderr(self, directory: Path, local_rank: int, text: str) -> None:
        """Write `text` where the worker's stderr goes, as if the worker wrote it: a hung worker's stack dump,
        which it wrote to a file of its own."""
        tee, redirect = self._tee_and_redirect(local_rank, "stderr")
        if redirect:
            with open(directory / "stderr.log", "a") as log_file:
                log_file.write(text)
        if tee and self._shown(local_rank):
            prefix = self._prefix(local_rank)
            sys.stderr.write("".join(prefix + line for line in text.splitlines(keepends=True)))
        elif not redirect:
            sys.stderr.write(text)
        sys.stderr.flush()

    def pump(self, source: IO[bytes], route: StreamRoute) -> None:
        """Copy `source`, a worker's piped stream, where `route` says, from a thread of its own."""
        pump = threading.Thread(target=_pump, args=(source, route), daemon=True)
        pump.start()
        self._pumps.append(pump)

    def close(self) -> None:
        """Once the workers are gone: let the pumps copy what is left, then close the filtered logs."""
        for pump in self._pumps:
            pump.join(timeout=_PUMP_JOIN_S)
        for duplicator in self._duplicators.values():
            duplicator.close()
