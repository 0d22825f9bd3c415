"""The one place that imports the etcd v3 client, connects it, and retries calls against it."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeAlias, TypeVar

import grpc
import tenacity

from launcher.config import PASSWORD_ENV, EtcdSecurity

try:  # etcd-sdk-python: the maintained, API-identical fork of python-etcd3
    import pyetcd as etcd3
    from pyetcd import etcdrpc
    from pyetcd import events as etcd_events
    from pyetcd import exceptions as etcd_exceptions
    from pyetcd import watch as etcd_watch
    from pyetcd.client import _EXCEPTIONS_BY_CODE, _FAILED_EP_CODES, EtcdTokenCallCredentials
except ImportError:  # pragma: no cover - exercised only where python-etcd3 is what is installed
    import etcd3  # type: ignore[no-redef]
    from etcd3 import etcdrpc  # type: ignore[no-redef]
    from etcd3 import events as etcd_events  # type: ignore[no-redef]
    from etcd3 import exceptions as etcd_exceptions  # type: ignore[no-redef]
    from etcd3 import watch as etcd_watch  # type: ignore[no-redef]
    from etcd3.client import _EXCEPTIONS_BY_CODE, _FAILED_EP_CODES, EtcdTokenCallCredentials  # type: ignore[no-redef]

logger = logging.getLogger(__name__)

EtcdClient: TypeAlias = Any  # etcd3.MultiEndpointEtcd3Client: the client library has no type information
RevisionCompacted = etcd_exceptions.RevisionCompactedError
PutEvent = etcd_events.PutEvent
DeleteEvent = etcd_events.DeleteEvent

# gRPC's default reconnect backoff grows to two minutes; an agent must see etcd come back within seconds.
_GRPC_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # A member cut off silently (no RST, no ICMP) leaves an open stream, the watch, hanging for good: ping it.
    # etcd answers pings more often than its --grpc-keepalive-min-time (5 s by default) with GOAWAY too_many_pings;
    # the watch stream is always open, so no permit_without_calls; max_pings_without_data=0 keeps pinging while no
    # watch event arrives.
    ("grpc.keepalive_time_ms", 6000),
    ("grpc.keepalive_timeout_ms", 3000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
]

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


class _RecordingWatchStub:
    """Hands the Watch call it makes to its watcher, so that the watcher can cancel it."""

    def __init__(self, stub, watcher: _CancellingWatcher) -> None:
        self._stub, self._watcher = stub, watcher

    def Watch(self, *args, **kwargs):
        call = self._stub.Watch(*args, **kwargs)
        self._watcher.call = call
        return call


class _CancellingWatcher(etcd_watch.Watcher):
    """pyetcd's Watcher.close, which the client calls when it fails over, only half-closes the stream (and blocks
    on a dead stream's full request queue): the watches on it stay on the old endpoint and their callbacks never
    hear of it. Cancelling the call ends them with CANCELLED, so RangeMirror resumes them where the client is now."""

    call = None

    def __init__(self, watchstub, **kwargs) -> None:
        super().__init__(_RecordingWatchStub(watchstub, self), **kwargs)

    def close(self) -> None:
        if self.call is not None:
            self.call.cancel()
        with self._lock:
            if self._callback_thread and not self._stopping:
                try:
                    self._request_queue.put_nowait(None)
                except queue.Full:
                    pass


class _FailoverClient(etcd3.MultiEndpointEtcd3Client):
    """Fails over as soon as a call fails, to the endpoint that failed least recently: a silently dead member is
    not tried again while another one has not failed, and no call is refused for want of an unfailed endpoint.
    Logged in, it logs in again when etcd no longer knows its token (expired while only keep-alives flowed)."""

    def __init__(self, *, user: str | None = None, password: str | None = None, **kwargs) -> None:
        self._login = (user, password) if user is not None else None
        super().__init__(user=user, password=password, **kwargs)
        self._drop_call_credentials_without_tls()

    def _drop_call_credentials_without_tls(self) -> None:
        # gRPC sends call credentials only over TLS; the token travels in each call's metadata either way
        if not any(endpoint.secure for endpoint in self.endpoints.values()):
            self.call_credentials = None

    def _log_in_again(self) -> None:
        assert self._login is not None, "only a client that logged in logs in again"
        user, password = self._login
        answer = self.authstub.Authenticate(etcdrpc.AuthenticateRequest(name=user, password=password), self.timeout)
        self.metadata = (("token", answer.token),)
        self.call_credentials = grpc.metadata_call_credentials(EtcdTokenCallCredentials(answer.token))
        self._drop_call_credentials_without_tls()
        self._clear_old_stubs()  # the watcher holds the old token: its watches resume with the new one

    def get_watcher(self):
        return _CancellingWatcher(
            etcdrpc.WatchStub(self.channel),
            timeout=self.timeout,
            call_credentials=self.call_credentials,
            metadata=self.metadata,
        )

    @property
    def channel(self):
        return self.endpoint_in_use.channel  # _manage_grpc_errors moves on; nothing to decide here

    def _manage_grpc_errors(self, exc):
        code = exc.code()
        if code is grpc.StatusCode.UNAUTHENTICATED and self._login is not None and "token" in (exc.details() or ""):
            logger.info("etcd no longer knows our login token (%s); logging in again", exc.details())
            self._log_in_again()
            raise etcd_exceptions.ConnectionFailedError() from exc  # transient: call_with_retry repeats the call
        if code in _FAILED_EP_CODES and len(self.endpoints) > 1:
            failed = self._current_endpoint_label
            self.endpoints[failed].last_failed = time.monotonic()
            others = [label for label in self.endpoints if label != failed]
            self._current_endpoint_label = min(others, key=lambda label: self.endpoints[label].last_failed)
            self._clear_old_stubs()  # cancels the old watcher: its watches resume on the new endpoint
            logger.info("etcd endpoint %s failed (%s); using %s", failed, code.name, self._current_endpoint_label)
        exception = _EXCEPTIONS_BY_CODE.get(code)
        if exception is None:
            raise exc
        raise exception() from exc


def refresh_lease(lease, timeout: float):
    """One keep-alive of `lease` under its own deadline (the client's, for every call, outlasts a fence's budget)."""
    client = lease.etcd_client
    request = etcdrpc.LeaseKeepAliveRequest(ID=lease.id)
    try:
        return list(
            client.leasestub.LeaseKeepAlive(
                iter([request]), timeout, credentials=client.call_credentials, metadata=client.metadata
            )
        )
    except grpc.RpcError as exc:
        client._manage_grpc_errors(exc)


def connect(spec: str, timeout: float = 3.0, security: EtcdSecurity | None = None) -> EtcdClient:
    """A client for the endpoints in `spec` that fails over between them and recovers within a second; over TLS
    and logged in as `security` says. Logging in is a call: it raises what `connect_reachable` explains."""
    security = security or EtcdSecurity()
    credentials = _tls_credentials(security) if security.tls else None
    endpoints = [
        etcd3.Endpoint(host, port, secure=security.tls, creds=credentials, opts=_GRPC_OPTIONS)
        for host, port in parse_endpoints(spec)
    ]
    password = security.password.get_secret_value() if security.password is not None else None
    return _FailoverClient(endpoints=endpoints, timeout=timeout, failover=True, user=security.user, password=password)


def _tls_credentials(security: EtcdSecurity) -> grpc.ChannelCredentials:
    def read(path: Path | None) -> bytes | None:
        return path.read_bytes() if path is not None else None

    return grpc.ssl_channel_credentials(
        root_certificates=read(security.cacert), private_key=read(security.key), certificate_chain=read(security.cert)
    )


def close(client: EtcdClient, timeout_s: float = 2.0) -> None:
    """Close `client` without hanging the caller: closing a dead watch stream can block in the client library."""
    closer = threading.Thread(target=client.close, name="etcd-close", daemon=True)
    closer.start()
    closer.join(timeout=timeout_s)


def check_reachable(
    client: EtcdClient, spec: str, security: EtcdSecurity | None = None, deadline_s: float = 5.0
) -> None:
    """Raise EtcdUnreachable naming `spec` unless an etcd v3 server answers within `deadline_s`."""
    try:
        call_with_retry(client.status, deadline_s=deadline_s)
    except Exception as exc:  # grpc and the client raise a zoo of types for "not etcd" and "not there"
        raise explain(exc, spec, security) from exc


def explain(exc: BaseException, spec: str, security: EtcdSecurity | None = None) -> EtcdUnreachable:
    """What went wrong reaching etcd at `spec`, in one line that names the fix."""
    security = security or EtcdSecurity()
    detail = _detail(exc)
    code = exc.code() if isinstance(exc, grpc.RpcError) and hasattr(exc, "code") else None
    lowered = detail.lower()
    if any(word in lowered for word in ("ssl", "handshake", "certificate", "tls")) or (
        security.tls and code is grpc.StatusCode.UNAVAILABLE and "connection refused" not in lowered
    ):
        return EtcdUnreachable(
            f"TLS with etcd at {spec} failed ({detail}); check --rdzv-conf cacert (the CA that "
            "signed etcd's certificate) and cert/key (a client certificate that CA signed)"
        )
    if "authentication failed" in lowered or "invalid user id or password" in lowered:
        return EtcdUnreachable(
            f"etcd at {spec} refused the login of user {security.user}: wrong user name or "
            f"password (--rdzv-conf user=NAME, password in {PASSWORD_ENV})"
        )
    if "authentication is not enabled" in lowered:
        return EtcdUnreachable(
            f"etcd at {spec} has authentication off: drop user= from --rdzv-conf and unset {PASSWORD_ENV}"
        )
    if "user name is empty" in lowered or "user name not found" in lowered or code is grpc.StatusCode.UNAUTHENTICATED:
        return EtcdUnreachable(
            f"etcd at {spec} wants a login ({detail}): pass --rdzv-conf user=NAME with the password in {PASSWORD_ENV}"
        )
    if "permission denied" in lowered or code is grpc.StatusCode.PERMISSION_DENIED:
        return EtcdUnreachable(
            f"etcd at {spec}: user {security.user} has no right to what elastic-run needs "
            f"({detail}); grant its role readwrite on the prefix /elastic/ or /elastic/<rdzv-id>/"
        )
    return EtcdUnreachable(
        f"cannot reach an etcd v3 server at {spec} ({type(exc).__name__}: {detail or 'no answer'}); "
        "start etcd there, fix --rdzv-endpoint, or use --standalone"
    )


def _detail(exc: BaseException) -> str:
    while exc.__cause__ is not None and not isinstance(exc, grpc.RpcError):
        exc = exc.__cause__
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "details"):
        return exc.details() or exc.code().name
    return str(exc)


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


def connect_reachable(spec: str, security: EtcdSecurity | None = None) -> EtcdClient:
    """A client for `spec` once an etcd answered there; raises ValueError (bad spec) or EtcdUnreachable."""
    try:
        client = connect(spec, security=security)
    except grpc.RpcError as exc:  # logging in failed
        raise explain(exc, spec, security) from exc
    try:
        check_reachable(client, spec, security)
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
        before_sleep=lambda state: logger.debug(
            "etcd call %s failed, retrying: %s", fn, state.outcome.exception() if state.outcome else None
        ),
    )
    return retrying(fn, *args, **kwargs)
