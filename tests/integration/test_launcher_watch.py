"""RangeMirror on a real etcd: it keeps every key, also when etcd replays a long history in batches."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request

import pytest

from launcher.etcd import client as etcd_client
from launcher.etcd.watch import RangeMirror, RangeWatch

pytestmark = pytest.mark.timeout(60)


def test_a_watch_resumed_far_behind_applies_every_replayed_batch(etcd):
    client = etcd_client.connect(etcd.endpoint)
    try:
        first = client.put("/p/first", "x").header.revision
        for i in range(2500):  # etcd sends at most 1,000 revisions per watch response, each with today's header
            client.put(f"/p/k{i:05d}", "v")
        client.delete("/p/k00007")
        mirror = RangeWatch(client, "/p/")
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
    client = etcd_client.connect(etcd.endpoint)
    mirrors = [RangeWatch(client, "/j/state/"), RangeWatch(client, "/j/state/ctl/")]
    try:
        RangeMirror(client, "/warm/").start().close()  # the watch stream is open before etcd stops
        failures: list[BaseException] = []

        def start(mirror: RangeWatch) -> None:
            try:
                mirror._watch()  # what start() does after its range read
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)

        os.kill(etcd.process.pid, signal.SIGSTOP)
        try:
            first = threading.Thread(target=start, args=(mirrors[0],))
            first.start()
            time.sleep(3.5)  # past the client's 3 s call timeout
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
    metrics = urllib.request.urlopen(f"http://{etcd.endpoint}/metrics", timeout=5).read().decode()
    (line,) = [line for line in metrics.splitlines() if line.startswith("etcd_debugging_mvcc_watcher_total ")]
    return int(float(line.split()[1]))


def _wait_until(condition, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.05)


def test_the_mirrors_of_a_range_on_one_client_share_one_watch_which_resumes_for_all_of_them(etcd):
    """A process hosting hundreds of agents on one client (bench/rendezvous_host.py: 256, each mirroring its
    job's `state/ctl/` and its member bucket) held one watch per agent per range on one stream. When that stream
    broke, each watch was re-created on its own, one at a time, and at 2,048 simulated agents one host's agents
    were left without a watch for two minutes. Now etcd serves one watch per range, however many mirror it, and
    a restart of etcd costs one resume per range."""
    client = etcd_client.connect(etcd.endpoint)
    ranges = ["/s/ctl/", *(f"/s/bucket/{index}/" for index in range(8))]
    mirrors = [RangeMirror(client, ranges[0]).start() for _ in range(200)]
    mirrors += [RangeMirror(client, prefix).start() for prefix in ranges[1:] for _ in range(8)]
    try:
        _wait_until(lambda: _watchers(etcd) == len(ranges), f"etcd serves one watch per range ({len(ranges)})")
        etcd.process.kill()  # same ports, same data: the stream breaks and every mirror resumes where it was
        etcd.process.wait()
        etcd.start()
        _wait_until(lambda: all(mirror.connected for mirror in mirrors), "every mirror is connected again")
        for prefix in ranges:
            client.put(f"{prefix}after", "restart")
        _wait_until(lambda: all("after" in mirror.snapshot()[0] for mirror in mirrors), "every mirror sees the puts")
        assert _watchers(etcd) == len(ranges)
        for mirror in mirrors[1:200]:
            mirror.close()
        client.put("/s/ctl/later", "x")
        _wait_until(lambda: "later" in mirrors[0].snapshot()[0], "the last mirror of a range keeps its watch")
        mirrors[0].close()
        _wait_until(lambda: _watchers(etcd) == len(ranges) - 1, "the range's watch ends with its last mirror")
    finally:
        for mirror in mirrors:
            mirror.close()
        client.close()
