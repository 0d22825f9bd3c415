"""RangeMirror on a real etcd: it keeps every key, also when etcd replays a long history in batches."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from launcher_harness import wait_until

from launcher.etcd import client as etcd_client
from launcher.etcd.watch import RangeMirror

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import etcd_metrics  # noqa: E402

pytestmark = pytest.mark.timeout(60)
# the late-confirmation test's client: a watch request pyetcd gave up at the call timeout handed its stream on
CALL_TIMEOUT_S = 1.0


def test_a_watch_resumed_far_behind_applies_every_replayed_batch(etcd):
    client = etcd_client.connect(etcd.endpoint)
    try:
        first = client.put("/p/first", "x").header.revision
        for i in range(2500):  # etcd sends at most 1,000 revisions per watch response, each with today's header
            client.put(f"/p/k{i:05d}", "v")
        client.delete("/p/k00007")
        mirror = RangeMirror(client, "/p/")
        mirror.revision = first - 1  # as if the stream broke just before the first put and resumed from there
        mirror._watch()
        deadline = time.monotonic() + 20
        while mirror.revision < first + 2500 and time.monotonic() < deadline:
            time.sleep(0.05)
        entries, revision, _ = mirror.snapshot()
        assert revision == first + 2501
        assert len(entries) == 2500 and "k00007" not in entries and "first" in entries
        mirror.close()
    finally:
        client.close()


def test_a_mirror_sees_changes_and_wakes_its_waiters(etcd):
    client = etcd_client.connect(etcd.endpoint)
    try:
        client.put("/q/a", "1")
        mirror = RangeMirror(client, "/q/").start()
        entries, _, version = mirror.snapshot()
        assert {k: e.value for k, e in entries.items()} == {"a": b"1"}
        client.put("/q/b", "2")
        assert mirror.wait(version, timeout=5) != version
        client.delete("/q/a")
        deadline = time.monotonic() + 5
        while "a" in mirror.snapshot()[0] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert {k: e.value for k, e in mirror.snapshot()[0].items()} == {"b": b"2"}
        mirror.close()
    finally:
        client.close()


def test_a_watch_etcd_confirms_late_is_not_taken_for_another_mirrors(etcd):
    """Two mirrors of different ranges on one client (the controller's `state/` and its agent's `state/ctl/`),
    created while etcd is stopped for longer than the client's call timeout. etcd then confirms the first watch
    while the second waits: the confirmation must go to the first. pyetcd matches a confirmation to whichever
    request is pending, so a watch abandoned at the call timeout handed its whole stream to the next one, whose
    mirror filled with another range's keys cut at the wrong length (`state/nodes/x` as `s/x`)."""
    client = etcd_client.connect(etcd.endpoint, timeout=CALL_TIMEOUT_S)
    mirrors = [RangeMirror(client, "/j/state/"), RangeMirror(client, "/j/state/ctl/")]
    try:
        RangeMirror(client, "/warm/").start().close()  # the watch stream is open before etcd stops
        failures: list[BaseException] = []

        def start(mirror: RangeMirror) -> None:
            try:
                mirror._watch()  # what start() does after its range read
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)

        os.kill(etcd.process.pid, signal.SIGSTOP)
        try:
            first = threading.Thread(target=start, args=(mirrors[0],))
            first.start()
            time.sleep(CALL_TIMEOUT_S + 0.5)  # past the client's call timeout, where pyetcd gave the watch up
            second = threading.Thread(target=start, args=(mirrors[1],))
            second.start()
            time.sleep(0.3)
        finally:
            os.kill(etcd.process.pid, signal.SIGCONT)
        first.join(timeout=20)
        second.join(timeout=20)
        client.put("/j/state/nodes/x", "1")
        client.put("/j/state/ctl/round", "2")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (
            "nodes/x" in mirrors[0].snapshot()[0] and "round" in mirrors[1].snapshot()[0]
        ):
            time.sleep(0.05)
        assert set(mirrors[1].snapshot()[0]) == {"round"}, "the second mirror got another range's watch"
        assert not failures, failures
        assert set(mirrors[0].snapshot()[0]) == {"nodes/x", "ctl/round"}
    finally:
        for mirror in mirrors:
            mirror.close()
        client.close()


def _watchers(etcd) -> int:
    """etcd's own count of the watches it serves."""
    return int(etcd_metrics.scrape(etcd.endpoint, timeout=5).watchers)


def test_hundreds_of_watches_on_one_client_all_resume_after_etcd_restarts_and_leave_none_behind(etcd):
    """A host of the rendezvous bench runs 256 agents on one client: 512 watches on one stream, which etcd re-creates
    one at a time after the stream breaks (pyetcd and etcd's own Go client alike keep one creation pending per
    stream). At 2,048 simulated agents one host's agents were without a watch for minutes after its stream broke.
    Here, unloaded, every mirror is back within seconds, sees what changed meanwhile and after, and etcd serves no
    watch left over from the broken stream or from a creation given up on."""
    client = etcd_client.connect(etcd.endpoint)
    prefixes = ["/s/ctl/", *(f"/s/bucket/{index}/" for index in range(32))]
    mirrors = [RangeMirror(client, prefixes[i % len(prefixes)]).start() for i in range(256)]
    try:
        wait_until(lambda: _watchers(etcd) == len(mirrors), 15, "etcd serves one watch per mirror")
        etcd.process.kill()  # same ports, same data: the stream breaks and every mirror resumes where it was
        etcd.process.wait()
        etcd.start()
        wait_until(lambda: all(mirror.connected for mirror in mirrors), 30, "every mirror is connected again")
        for prefix in prefixes:
            client.put(f"{prefix}after", "restart")
        wait_until(lambda: all("after" in mirror.snapshot()[0] for mirror in mirrors), 15, "every mirror sees it")
        wait_until(lambda: _watchers(etcd) == len(mirrors), 15, "no watch left behind")
    finally:
        for mirror in mirrors:
            mirror.close()
        client.close()
