"""The one place that imports the etcd v3 client, connects it, and retries calls against it."""

from __future__ import annotations

import logging
import threading
from typing import Callable, TypeVar

import grpc
import tenacity

try:  # etcd-sdk-python: the maintained, API-identical fork of python-etcd3
    import pyetcd as etcd3
    from pyetcd import events as etcd_events
    from pyetcd import exceptions as etcd_exceptions
except ImportError:  # pragma: no cover - exercised only where python-etcd3 is what is installed
    import etcd3  # type: ignore[no-redef]
    from etcd3 import events as etcd_events  # type: ignore[no-redef]
    from etcd3 import exceptions as etcd_exceptions  # type: ignore[no-redef]

logger = logging.getLogger(__name__)

EtcdClient = etcd3.MultiEndpointEtcd3Client
EtcdError = etcd_exceptions.Etcd3Exception
PreconditionFailed = etcd_exceptions.PreconditionFailedError
RevisionCompacted = etcd_exceptions.RevisionCompactedError
PutEvent = etcd_events.PutEvent
DeleteEvent = etcd_events.DeleteEvent

# gRPC's default reconnect backoff grows to two minutes; an agent must see etcd come back within seconds.
_GRPC_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# The client marks a failed endpoint unusable for this long (its default, 300 s, outlasts any lease).
_ENDPOINT_RETRY_S = 0.2

T = TypeVar("T")


class EtcdUnreachable(RuntimeError):
    """No endpoint of the configured etcd answered."""


def parse_endpoints(spec: str) -> list[tuple[str, int]]:
    """`host:port[,host:port...]` -> [(host, port)]; the port defaults to etcd's 2379."""
    endpoints = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        item = item.removeprefix("http://")
        host, sep, port = item.rpartition(":")
        if not sep:
            host, port = item, "2379"
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"bad etcd endpoint {item!r}: expected host:port, e.g. 127.0.0.1:2379")
        endpoints.append((host.strip("[]"), int(port)))
    if not endpoints:
        raise ValueError("empty etcd endpoint: pass --rdzv-endpoint host:port or use --standalone")
    return endpoints


def connect(spec: str, timeout: float = 3.0) -> EtcdClient:
    """A client for the endpoints in `spec` that fails over between them and recovers within a second."""
    endpoints = [
        etcd3.Endpoint(host, port, secure=False, time_retry=_ENDPOINT_RETRY_S, opts=_GRPC_OPTIONS)
        for host, port in parse_endpoints(spec)
    ]
    return etcd3.MultiEndpointEtcd3Client(endpoints=endpoints, timeout=timeout, failover=True)


def close(client: EtcdClient, timeout_s: float = 2.0) -> None:
    """Close `client` without hanging the caller: closing a dead watch stream can block in the client library."""
    closer = threading.Thread(target=client.close, name="etcd-close", daemon=True)
    closer.start()
    closer.join(timeout=timeout_s)


def check_reachable(client: EtcdClient, spec: str, deadline_s: float = 5.0) -> None:
    """Raise EtcdUnreachable naming `spec` unless an etcd v3 server answers within `deadline_s`."""
    try:
        call_with_retry(client.status, deadline_s=deadline_s)
    except Exception as exc:  # grpc and the client raise a zoo of types for "not etcd" and "not there"
        raise EtcdUnreachable(
            f"cannot reach an etcd v3 server at {spec} ({type(exc).__name__}: {exc or 'no answer'}); "
            "start etcd there, fix --rdzv-endpoint, or use --standalone"
        ) from exc


# gRPC codes that mean "no answer this time": the server is down, restarting, electing a leader or overloaded.
_TRANSIENT_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,  # etcd's "leader changed" and "connection reset" arrive as UNKNOWN
}
# The client raises a bare ValueError with this text while it lets a failed endpoint cool down.
_FAILED_ENDPOINT_TEXT = "Trying to use a failed node"


def connect_reachable(spec: str) -> EtcdClient:
    """A client for `spec` once an etcd answered there; raises ValueError (bad spec) or EtcdUnreachable."""
    client = connect(spec)
    try:
        check_reachable(client, spec)
    except EtcdUnreachable:
        client.close()
        raise
    return client


def is_transient(exc: BaseException) -> bool:
    """Errors that mean 'etcd did not answer this time', as opposed to a refused operation or a bad value.

    A pydantic ValidationError or a JSONDecodeError is a ValueError too: it is never transient.
    """
    if isinstance(exc, grpc.RpcError):
        return exc.code() in _TRANSIENT_CODES if hasattr(exc, "code") else True
    if isinstance(exc, ValueError):
        return type(exc) is ValueError and _FAILED_ENDPOINT_TEXT in str(exc)
    return isinstance(
        exc,
        (
            etcd_exceptions.ConnectionFailedError,
            etcd_exceptions.ConnectionTimeoutError,
            etcd_exceptions.NoServerAvailableError,
            etcd_exceptions.InternalServerError,
            etcd_exceptions.WatchTimedOut,
        ),
    )


def is_lease_gone(exc: BaseException) -> bool:
    """etcd's answer to a write or revoke under a lease that has expired or was revoked."""
    return isinstance(exc, grpc.RpcError) and hasattr(exc, "code") and exc.code() == grpc.StatusCode.NOT_FOUND


def call_with_retry(fn: Callable[..., T], *args, deadline_s: float = 30.0, **kwargs) -> T:
    """Call `fn` until it succeeds, retrying transient etcd errors with backoff for up to `deadline_s`."""
    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(is_transient),
        wait=tenacity.wait_exponential(multiplier=0.05, max=1.0),
        stop=tenacity.stop_after_delay(deadline_s),
        reraise=True,
        before_sleep=lambda state: logger.debug("etcd call %s failed, retrying: %s", fn, state.outcome.exception()),
    )
    return retrying(fn, *args, **kwargs)
