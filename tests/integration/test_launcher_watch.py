"""RangeMirror on a real etcd: it keeps every key, also when etcd replays a long history in batches."""

from __future__ import annotations

import time

import pytest

from launcher.etcd import client as etcd_client
from launcher.etcd.watch import RangeMirror

pytestmark = pytest.mark.timeout(60)


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
