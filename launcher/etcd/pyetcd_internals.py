"""The only module that touches private parts of etcd-sdk-python (pyetcd), each under a name of ours.

pyetcd documents its client's calls, not how it routes a call's gRPC error, picks an endpoint, attaches a login
token or runs the watch stream; `launcher.etcd.client` needs each of those to fail over at once, log in again
and end the watches of a dead stream. Private parts change without notice between releases:
`tests/integration/test_pyetcd_internals.py` fails when the installed pyetcd lacks one or it no longer has the
shape used here, so an upgrade is noticed in CI, not in a job that cannot fail over.

- `MultiEndpointEtcd3Client._manage_grpc_errors(exc)`: every unary call hands its `grpc.RpcError` to it (pyetcd's
  `_handle_errors` decorator) and raises what it raises: the one place to turn errors into ours.
- `MultiEndpointEtcd3Client._current_endpoint_label` (a settable property) and `_clear_old_stubs()`: the endpoint
  in use; dropping the stubs cached for it closes its watcher.
- `authstub`, `kvstub`, `clusterstub`, `leasestub` and `maintenancestub`: properties returning the stubs cached
  for the endpoint in use, read at the start of every unary call; `metadata` and `call_credentials`: what
  every call sends, a login token among them; `pyetcd.client.EtcdTokenCallCredentials` wraps a token.
- Every unary call passes the client's `timeout` attribute, read at that moment, as its deadline: a property of
  ours in its place sets each call's own.
- `Watcher._request_queue`: a stream's queue of requests, set by `Watcher.__init__` and anew when a stream ends (a
  property of ours in its place makes each one unbounded); the watcher opens its stream with
  `watchstub.Watch(requests, credentials=..., metadata=...)`.
- `Watcher._handle_response(rs)` handles each response of the stream, and `_new_watch_cond` (on `_lock`) wakes the
  request waiting for its watch to be created.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, NoReturn

import grpc
import pyetcd
from pyetcd import etcdrpc
from pyetcd import watch as pyetcd_watch
from pyetcd.client import EtcdTokenCallCredentials

CHECKED_WITH_PYETCD = "etcd-sdk-python 0.0.7"  # the release whose private parts these were written against


STUB_PROPERTIES = ("authstub", "kvstub", "clusterstub", "leasestub", "maintenancestub")


def _noting_the_endpoint(name: str) -> property:
    """pyetcd's stub property `name`, which also notes, for the calling thread, the endpoint its call goes to."""
    stub_of = getattr(pyetcd.MultiEndpointEtcd3Client, name).fget

    def get_stub(self: HookedClient):
        self._calling().endpoint = self._current_endpoint_label
        return stub_of(self)

    return property(get_stub)


class HookedClient(pyetcd.MultiEndpointEtcd3Client):
    """pyetcd's multi-endpoint client with the private parts our client uses, under names of ours."""

    authstub = _noting_the_endpoint("authstub")
    kvstub = _noting_the_endpoint("kvstub")
    clusterstub = _noting_the_endpoint("clusterstub")
    leasestub = _noting_the_endpoint("leasestub")
    maintenancestub = _noting_the_endpoint("maintenancestub")

    @property
    def call_endpoint(self) -> str:
        """The endpoint the calling thread's latest unary call went to: where its error came from, whatever
        endpoint other threads have moved the client to since."""
        return getattr(self._calling(), "endpoint", None) or self._current_endpoint_label

    def _calling(self) -> threading.local:
        """Per thread, of this client: the endpoint of its latest call (made on first use: pyetcd's constructor
        already calls, to log in)."""
        calls = self.__dict__.get("_calls_by_thread")
        if calls is None:
            # made once: every threading.local that is dropped walks every thread of the process (0.2 ms per call
            # with the 780 threads of a rendezvous_bench host)
            calls = self.__dict__.setdefault("_calls_by_thread", threading.local())
        return calls

    def _manage_grpc_errors(self, exc: grpc.RpcError) -> NoReturn:
        self.on_grpc_error(exc)

    def on_grpc_error(self, exc: grpc.RpcError) -> NoReturn:
        """A unary call failed with `exc`; what this raises, the call raises."""
        raise exc

    @property
    def endpoint_label(self) -> str:
        """The `host:port` of the endpoint every call goes to."""
        return self._current_endpoint_label

    def use_endpoint(self, label: str) -> None:
        """Send calls to endpoint `label` from now on; its watcher goes with the old endpoint's stubs."""
        self._current_endpoint_label = label
        self.drop_stubs()

    def drop_stubs(self) -> None:
        """Forget the stubs made for the endpoint and token in use, and close the watcher: the next call makes new
        ones, and the watches on the old stream end with an error that tells their callbacks."""
        self._clear_old_stubs()

    def log_in(self, user: str, password: str) -> None:
        """Authenticate again and send the new token with every call from now on (with the stubs, which hold it)."""
        answer = self.authstub.Authenticate(etcdrpc.AuthenticateRequest(name=user, password=password), self.timeout)
        self.metadata = (("token", answer.token),)
        self.call_credentials = grpc.metadata_call_credentials(EtcdTokenCallCredentials(answer.token))
        self.drop_stubs()

    def keep_alive_once(self, lease_id: int, timeout: float, endpoint: str) -> list[Any]:
        """One keep-alive of lease `lease_id` through `endpoint` under its own deadline; etcd's answers (raises
        grpc.RpcError)."""
        request = etcdrpc.LeaseKeepAliveRequest(ID=lease_id)
        stub = (
            self.leasestub if endpoint == self.endpoint_label else etcdrpc.LeaseStub(self.endpoints[endpoint].channel)
        )
        return list(
            stub.LeaseKeepAlive(iter([request]), timeout, credentials=self.call_credentials, metadata=self.metadata)
        )


class HookedWatcher(pyetcd_watch.Watcher):
    """pyetcd's watcher with the private parts our watcher uses, under names of ours."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._creating = threading.Lock()

    @property
    def _request_queue(self) -> queue.Queue:
        return self._requests

    @_request_queue.setter
    def _request_queue(self, bounded: queue.Queue) -> None:
        """pyetcd gives each stream a request queue bounded at 10, and puts into it holding `_lock`, also once the
        stream ended and nothing takes from it: with 10 requests left there (cancels of watches closed as the
        stream broke) the stream thread's last put blocks for good, and every caller of the lock with it (a
        client's close hung in CI). Unbounded, no put blocks; a stream holds a few requests per watch at most."""
        self._requests: queue.Queue = queue.Queue()

    def add_callback(self, *args: Any, **kwargs: Any) -> Any:
        """One watch created at a time, the others queued on a lock of their own. pyetcd also lets one creation
        pend at a time, but parks the others on the condition it notifies all of twice per creation: each
        creation woke every thread still queued (1,024 agents sharing one client, bench/rendezvous_bench.py, made
        that quadratic: 5.6 ms of CPU per watch created at 256 per client)."""
        with self._creating:
            return super().add_callback(*args, **kwargs)

    def _handle_response(self, rs) -> None:
        super()._handle_response(rs)
        if rs.created and rs.compact_revision:
            # pyetcd notes a watch that starts in compacted history without waking the request that waits for it,
            # which then waits its whole timeout to raise RevisionCompactedError: wake it now
            with self._lock:
                self._new_watch_cond.notify_all()
