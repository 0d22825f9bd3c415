"""The private parts of pyetcd behind launcher.etcd.pyetcd_internals: each exists and has the shape relied on. A
pyetcd upgrade that changes one fails here, loudly, rather than as a client that no longer fails over. And what
our client, built on them, raises: the launcher's own errors."""

from __future__ import annotations

import inspect
import threading
import time

import grpc
import pyetcd
import pytest
from pyetcd import etcdrpc
from pyetcd import watch as pyetcd_watch
from pyetcd.client import EtcdTokenCallCredentials
from pyetcd.exceptions import RevisionCompactedError, WatchTimedOut

from launcher.etcd import client as etcd_client
from launcher.etcd import pyetcd_internals
from launcher.etcd.errors import EtcdUnavailable, LeaseGone
from launcher.etcd.pyetcd_internals import HookedClient, HookedWatcher

pytestmark = pytest.mark.timeout(60)

UPDATE = f"update launcher/etcd/pyetcd_internals.py (written against {pyetcd_internals.CHECKED_WITH_PYETCD})"


class RecordingClient(HookedClient):
    def __init__(self) -> None:
        # nothing listens on port 1: a call fails at once with UNAVAILABLE, and no etcd is needed
        nobody = [pyetcd.Endpoint(host, 1, secure=False) for host in ("127.0.0.1", "127.0.0.2")]
        super().__init__(endpoints=nobody, timeout=1.0, failover=True)
        self.errors: list[grpc.RpcError] = []

    def on_grpc_error(self, exc):
        self.errors.append(exc)
        raise RuntimeError("seen") from exc


def test_the_client_has_every_private_part_we_use():
    client_class = pyetcd.MultiEndpointEtcd3Client
    for method in ("_manage_grpc_errors", "_clear_old_stubs"):
        assert callable(getattr(client_class, method, None)), f"pyetcd's client lost {method}: {UPDATE}"
    for name in ("_current_endpoint_label", *pyetcd_internals.STUB_PROPERTIES):
        assert isinstance(getattr(client_class, name, None), property), f"pyetcd's client lost {name}: {UPDATE}"
    assert client_class._current_endpoint_label.fset is not None, f"the endpoint in use can no longer be set: {UPDATE}"
    assert issubclass(EtcdTokenCallCredentials, grpc.AuthMetadataPlugin), UPDATE
    client = RecordingClient()
    for attribute in ("metadata", "call_credentials", "timeout", "endpoints"):
        assert hasattr(client, attribute), f"pyetcd's client no longer keeps {attribute}: {UPDATE}"
    client.close()


def test_every_unary_call_hands_its_grpc_error_to_the_hook():
    client = RecordingClient()
    try:
        for call in (lambda: client.get("k"), lambda: client.put("k", "v"), lambda: client.lease(5)):
            with pytest.raises(RuntimeError, match="seen"):
                call()
        with pytest.raises(RuntimeError, match="seen"):
            client.transaction(compare=[], success=[], failure=[])
        assert [e.code() for e in client.errors] == [grpc.StatusCode.UNAVAILABLE] * 4, UPDATE
        with pytest.raises(grpc.RpcError) as raised:
            client.keep_alive_once(7, 1.0, client.endpoint_label)  # a stream of our own: not routed, raised as it is
        assert raised.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        client.close()


def test_an_error_is_charged_to_the_endpoint_its_call_went_to():
    """Issue #18: with 256 agents sharing a client, an etcd member killed under calls in flight failed every
    endpoint in turn, healthy ones too: each late error was charged to the endpoint the client had just moved to,
    which moved it again, closing the watches of every agent each time (a 3-member etcd, its leader killed: no
    agent saw the next round for 40 s). Each thread notes the endpoint of its own call."""
    dead, live = "127.0.0.1:1", "127.0.0.2:1"

    class Client(HookedClient):
        def __init__(self) -> None:
            nobody = [pyetcd.Endpoint(host, 1, secure=False) for host in ("127.0.0.1", "127.0.0.2")]
            super().__init__(endpoints=nobody, timeout=1.0, failover=True)
            self.charged: list[str] = []

        def on_grpc_error(self, exc):
            self.charged.append(self.call_endpoint)
            raise RuntimeError("seen") from exc

    client = Client()
    try:
        client.use_endpoint(dead)
        started, moved = threading.Event(), threading.Event()

        def late_call() -> None:
            stub = client.kvstub  # the call starts on the dead endpoint...
            started.set()
            moved.wait(5)  # ...and fails after another thread moved the client
            try:
                stub.Range(etcdrpc.RangeRequest(key=b"k"), 1.0)
            except grpc.RpcError as exc:
                client._manage_grpc_errors(exc)

        thread = threading.Thread(target=lambda: pytest.raises(RuntimeError, late_call))
        thread.start()
        assert started.wait(5)
        client.use_endpoint(live)
        moved.set()
        thread.join(10)
        assert client.charged == [dead], UPDATE
        assert client.call_endpoint == live, "this thread never called: the endpoint in use"
    finally:
        client.close()


def test_switching_the_endpoint_drops_its_stubs_and_closes_its_watcher():
    client = RecordingClient()
    try:
        first = client.endpoint_label
        kv_stub = client.kvstub
        assert client.kvstub is kv_stub, f"pyetcd no longer caches its stubs: {UPDATE}"
        closed = threading.Event()
        client.watcher = type("Watcher", (), {"close": lambda self: closed.set()})()
        other = next(label for label in client.endpoints if label != first)
        client.use_endpoint(other)
        assert client.endpoint_label == other and client.endpoint_in_use is client.endpoints[other]
        assert client.kvstub is not kv_stub, f"switching endpoints kept the old stubs: {UPDATE}"
        assert closed.is_set(), f"dropping the stubs no longer closes the watcher: {UPDATE}"
    finally:
        client.close()


class RecordingStub:
    def __init__(self) -> None:
        self.calls: list[tuple[tuple, dict]] = []

    def Watch(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return iter(())  # a stream that ends at once


def test_the_watcher_opens_its_stream_through_the_stub_it_was_given():
    parameters = inspect.signature(pyetcd_watch.Watcher.__init__).parameters
    assert list(parameters)[:5] == ["self", "watchstub", "timeout", "call_credentials", "metadata"], UPDATE
    stub = RecordingStub()
    watcher = HookedWatcher(stub, timeout=0.5, call_credentials=None, metadata=(("token", "t"),))
    with pytest.raises(WatchTimedOut):  # the stream ended before anything confirmed the watch
        watcher.add_callback("k", lambda response: None)
    assert len(stub.calls) == 1, UPDATE
    args, kwargs = stub.calls[0]
    assert len(args) == 1 and kwargs == {"credentials": None, "metadata": (("token", "t"),)}, UPDATE


class AnsweringStub:
    """A watch stream that answers the first request with `response`, takes no further request, and stays open
    until `done`; then it breaks with `breaks_with`, if given."""

    def __init__(self, response, breaks_with: grpc.RpcError | None = None) -> None:
        self.response = response
        self.breaks_with = breaks_with
        self.done = threading.Event()

    def Watch(self, requests, credentials=None, metadata=None):
        def responses():
            next(requests)
            yield self.response
            self.done.wait(10)
            if self.breaks_with is not None:
                raise self.breaks_with

        return responses()


def test_a_watch_created_in_compacted_history_is_refused_at_once():
    stub = AnsweringStub(etcdrpc.WatchResponse(created=True, watch_id=1, compact_revision=5))
    watcher = HookedWatcher(stub, timeout=30)  # as long as our client waits for a confirmation
    assert callable(getattr(pyetcd_watch.Watcher, "_handle_response", None)), UPDATE
    assert isinstance(getattr(watcher, "_new_watch_cond", None), threading.Condition), UPDATE
    started = time.monotonic()
    try:
        with pytest.raises(RevisionCompactedError):
            watcher.add_callback("k", lambda response: None)
        assert time.monotonic() - started < 5, "the request waited for its timeout"
    finally:
        stub.done.set()


class StreamBroken(grpc.RpcError):
    pass


def finishes(call) -> bool:
    """Whether `call` returns within 5 s (run on a thread of its own, left behind if it does not)."""
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout=5)
    return not thread.is_alive()


def test_a_stream_that_breaks_with_requests_left_in_its_queue_blocks_nobody():
    """pyetcd's stream thread puts its end into the stream's request queue holding the watcher's lock; bounded at
    10, a queue that nothing takes from any more held that put, the lock, and every caller of it for good: a
    client's close, after 256 watches on one stream were closed as it broke, hung in CI."""
    stub = AnsweringStub(etcdrpc.WatchResponse(created=True, watch_id=1), breaks_with=StreamBroken())
    watcher = HookedWatcher(stub, timeout=5)
    errors: list = []
    watcher.add_callback("k", lambda response: errors.append(response))

    def cancel_many() -> None:  # cancels of watches closed meanwhile, which the stalled stream never takes
        with watcher._lock:
            for watch_id in range(2, 40):
                watcher._cancel_no_lock(watch_id)

    assert finishes(cancel_many), "a cancel waited on the full queue"
    stub.done.set()
    assert finishes(watcher.close), "closing the watcher waited on its lock for good"
    deadline = time.monotonic() + 5
    while not errors and time.monotonic() < deadline:
        time.sleep(0.01)
    assert errors and isinstance(errors[0], StreamBroken), "the stream's end reached its watch"
    assert watcher._request_queue.maxsize == 0, "the next stream's queue is unbounded too"


def test_our_client_raises_the_launcher_s_errors(etcd):
    nobody = etcd_client.connect("127.0.0.1:1,127.0.0.2:1", timeout=1.0)
    try:
        first = nobody.endpoint_label
        with pytest.raises(EtcdUnavailable) as raised:
            nobody.get("k")
        assert etcd_client.is_transient(raised.value) and isinstance(raised.value.__cause__, grpc.RpcError)
        assert nobody.endpoint_label != first, "a failed call sends the next one to the other endpoint"
    finally:
        nobody.close()
    client = etcd_client.connect(etcd.endpoint)
    try:
        with pytest.raises(LeaseGone) as gone:
            client.revoke_lease(0x1234)
        assert etcd_client.is_lease_gone(gone.value) and not etcd_client.is_transient(gone.value)
        with pytest.raises(LeaseGone):
            client.put("k", "v", lease=0x1234)
    finally:
        client.close()


class CountingCondition(threading.Condition):
    """A condition that remembers the most threads ever waiting on it at once."""

    def __init__(self, lock) -> None:
        super().__init__(lock)
        self.waiting = self.most_waiting = 0

    def wait(self, timeout=None):
        self.waiting += 1  # under the lock, as every wait is
        self.most_waiting = max(self.most_waiting, self.waiting)
        try:
            return super().wait(timeout)
        finally:
            self.waiting -= 1


def test_watches_created_at_once_wait_in_line_not_on_pyetcd_s_condition(etcd):
    # pyetcd parks every creator but one on a condition it notifies all of, twice per creation: quadratic wake-ups
    # for agents sharing a client. Ours queue outside it, and each watch still gets its own events.
    channel = grpc.insecure_channel(etcd.endpoint)
    watcher = HookedWatcher(etcdrpc.WatchStub(channel), timeout=10)
    watcher._new_watch_cond = condition = CountingCondition(watcher._lock)
    creators = 32
    seen: dict[int, list[bytes]] = {index: [] for index in range(creators)}
    start = threading.Barrier(creators)

    def create(index: int) -> None:
        start.wait()
        key = f"key{index}".encode()
        watcher.add_callback(key, lambda response: seen[index].extend(event.key for event in response.events))

    threads = [threading.Thread(target=create, args=(index,)) for index in range(creators)]
    client = etcd_client.connect(etcd.endpoint)
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=20)
        for index in range(creators):
            client.put(f"key{index}", "v")
        deadline = time.monotonic() + 10
        while any(not keys for keys in seen.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert seen == {index: [f"key{index}".encode()] for index in range(creators)}
        assert condition.most_waiting == 1, f"{condition.most_waiting} creators waited on pyetcd's condition at once"
    finally:
        watcher.close()
        channel.close()
        etcd_client.close(client)
