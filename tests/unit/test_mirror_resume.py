"""RangeMirror resuming its watch: a stream that fails while the mirror is still resuming onto it (the client moved
to another endpoint again, or the member died right after confirming the watch) is resumed from too. CI once saw
a controller's agent whose mirror kept a dead watch after three etcd leader changes: it never saw its job finish
and never exited."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from launcher.etcd.watch import RangeMirror

pytestmark = pytest.mark.timeout(30)


class _StreamEnded(Exception):
    pass


class FakeClient:
    """Watches whose streams the test ends; `fail_on_creation` watches fail before their request returns (their
    stream delivers its error at once, as a member that dies just after confirming the watch does)."""

    def __init__(self, fail_on_creation: int = 0) -> None:
        self.fail_on_creation = fail_on_creation
        self.callbacks: dict[int, object] = {}
        self.cancelled: list[int] = []
        self.created = threading.Condition()

    def read_prefix(self, prefix: str):
        return [], 10

    def add_watch_prefix_callback(self, prefix: str, callback, start_revision: int) -> int:
        with self.created:
            watch_id = len(self.callbacks) + 1
            self.callbacks[watch_id] = callback
            self.created.notify_all()
        if self.fail_on_creation:
            self.fail_on_creation -= 1
            callback(_StreamEnded(f"stream of watch {watch_id} ended before its confirmation returned"))
        return watch_id

    def cancel_watch(self, watch_id: int) -> None:
        self.cancelled.append(watch_id)

    def end_stream(self, watch_id: int) -> None:
        self.callbacks[watch_id](_StreamEnded(f"stream of watch {watch_id} ended"))

    def wait_for_watches(self, count: int, timeout: float = 10.0) -> None:
        with self.created:
            assert self.created.wait_for(lambda: len(self.callbacks) >= count, timeout), (
                f"the mirror made {len(self.callbacks)} watch(es), not {count}"
            )

    def put(self, watch_id: int, key: str, revision: int) -> None:
        event = SimpleNamespace(key=key.encode(), value=b"v", mod_revision=revision)
        self.callbacks[watch_id](SimpleNamespace(events=[event], header=SimpleNamespace(revision=revision)))


def _wait_connected(mirror: RangeMirror, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not mirror.connected and time.monotonic() < deadline:
        time.sleep(0.01)
    assert mirror.connected, "the mirror did not get its watch back"


def test_a_stream_that_fails_while_its_watch_is_created_is_watched_again():
    client = FakeClient()
    mirror = RangeMirror(client, "/p/").start()
    client.fail_on_creation = 2  # the first resume, and the one after it, land on streams that die at once
    client.end_stream(1)
    client.wait_for_watches(4)
    _wait_connected(mirror)
    version = mirror.version
    client.put(4, "/p/a", 11)  # the fourth watch is the live one: its events arrive
    assert mirror.wait(version, timeout=5) != version
    assert "a" in mirror.snapshot()[0]
    mirror.close()
    assert client.cancelled == [4]


def test_a_late_error_of_a_replaced_stream_changes_nothing():
    client = FakeClient()
    mirror = RangeMirror(client, "/p/").start()
    client.end_stream(1)
    client.wait_for_watches(2)
    _wait_connected(mirror)
    client.end_stream(1)  # the old stream's second watch ending, say: the mirror watches on watch 2's stream
    time.sleep(0.3)
    assert mirror.connected and len(client.callbacks) == 2
    client.end_stream(2)  # the live one: resumed
    client.wait_for_watches(3)
    _wait_connected(mirror)
    mirror.close()


def test_a_stream_that_ends_without_an_error_is_resumed():
    """pyetcd tells a watch's callback None when its stream ends without a gRPC error."""
    client = FakeClient()
    mirror = RangeMirror(client, "/p/").start()
    client.callbacks[1](None)
    client.wait_for_watches(2)
    _wait_connected(mirror)
    mirror.close()
