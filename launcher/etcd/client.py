"""The one place that uses the etcd v3 client (pyetcd, over gRPC; its private parts behind `pyetcd_internals`):
connects it, retries calls against it, and turns its errors into the launcher's own (`launcher.etcd.errors`):
EtcdUnavailable and LeaseGone. Other refusals (no rights, a bad request) stay gRPC errors, which `explain` words."""

from __future__ import annotations

import functools
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeAlias, TypeVar

import grpc
import pyetcd
from pyetcd import etcdrpc
from pyetcd import events as etcd_events
from pyetcd import exceptions as etcd_exceptions

from launcher.config import PASSWORD_ENV, EtcdSecurity, parse_endpoints
from launcher.etcd import errors, versions
from launcher.etcd.errors import EtcdTimedOut, EtcdUnavailable, EtcdUnreachable, LeaseGone
from launcher.etcd.pyetcd_internals import HookedClient, HookedWatcher

logger = logging.getLogger(__name__)

EtcdClient: TypeAlias = Any  # pyetcd.MultiEndpointEtcd3Client: the client library has no type information
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
# gRPC codes that mean "no answer this time": the server is down, restarting, electing a leader or overloaded.
_UNAVAILABLE_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,  # etcd's "leader changed" and "connection reset" arrive as UNKNOWN
}
# etcd's own answer to a request it gave up on ("... request timed out", "... request timed out, possibly due to
# previous leader failure"): proposed perhaps, and applied later
_ETCD_TIMED_OUT = "etcdserver: request timed out"
# The codes after which the next call goes to another endpoint: those of a member that failed, not of a refusal.
_ENDPOINT_FAILED_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL}

# How long a new watch waits for etcd to confirm it. A stream that died ends its pending request at once, and
# gRPC's keep-alive ends a silent one within 9 s: waiting this long only waits for a slow etcd (or a client
# process starved of CPU), where the 3 s call timeout would give up on watches etcd is about to confirm.
WATCH_CREATE_TIMEOUT_S = 20.0
# Keys per page of a prefix read: 256 of the largest values the launcher writes (member buckets, 4-8 KB) are far
# below the 4 MiB gRPC lets a client receive in one message, which a whole `state/` passes at about 16,000 nodes.
PAGE_KEYS = 256

T = TypeVar("T")


def translate(exc: grpc.RpcError) -> Exception:
    """The launcher's error for `exc`: EtcdUnavailable, LeaseGone, or `exc` itself, a refusal. etcd answers NOT_FOUND
    for a lease it no longer has, and for an unknown cluster member, which the launcher never asks about."""
    code = exc.code() if hasattr(exc, "code") else None
    detail = _detail(exc)
    if code is grpc.StatusCode.DEADLINE_EXCEEDED or detail.startswith(_ETCD_TIMED_OUT):
        return EtcdTimedOut(f"{code.name if code else 'no status'}: {detail}")
    if code is None or code in _UNAVAILABLE_CODES:
        return EtcdUnavailable(f"{code.name if code else 'no status'}: {detail}")
    if code is grpc.StatusCode.NOT_FOUND:
        return LeaseGone(detail)
    return exc


def _raise_translated(exc: grpc.RpcError) -> NoReturn:
    translated = translate(exc)
    if translated is exc:
        raise exc
    raise translated from exc


class _RecordingWatchStub:
    """Hands the Watch call it makes to its watcher, so that the watcher can cancel it."""

    def __init__(self, stub, watcher: _CancellingWatcher) -> None:
        self._stub, self._watcher = stub, watcher

    def Watch(self, *args, **kwargs):
        call = self._stub.Watch(*args, **kwargs)
        self._watcher.call = call
        return call


class _CancellingWatcher(HookedWatcher):
    """pyetcd's Watcher.close, which the client calls when it fails over, only half-closes the stream: the watches
    on it stay on the old endpoint and their callbacks never hear of it. Cancelling the call ends them with
    CANCELLED, so RangeMirror resumes them where the client is now."""

    call = None

    def __init__(self, watchstub, on_stream_error: Callable[[grpc.RpcError], None], **kwargs) -> None:
        super().__init__(_RecordingWatchStub(watchstub, self), **kwargs)
        self._on_stream_error = on_stream_error

    def close(self) -> None:
        if self.call is not None:
            self.call.cancel()
        super().close()

    def add_callback(self, key, callback, *args, **kwargs):
        """pyetcd hands etcd's confirmation of a new watch to whichever watch request is pending then: once one was
        given up on, a late confirmation would go to the next request, of another range perhaps, which would then
        get that range's events. The stream is ended instead, and every watch on it resumes on a new one.

        The stream's error reaches the client before the callback: a member that died under the stream is left
        for another, where the callback's owner then resumes its watch (no unary call need fail first)."""

        def noting_stream_errors(response) -> None:
            if isinstance(response, grpc.RpcError):
                self._on_stream_error(response)
            callback(response)

        try:
            return super().add_callback(key, noting_stream_errors, *args, **kwargs)
        except etcd_exceptions.WatchTimedOut as exc:
            self.close()
            # ours, so callers retry it as any slow answer: thousands of agents registering at once kept one etcd
            # from confirming watches for 20 s, and pyetcd's own error crashed agents before they joined
            raise EtcdTimedOut(f"etcd did not confirm a new watch within {self.timeout:g}s") from exc


class _FailoverClient(HookedClient):
    """Fails over as soon as a call fails, to the endpoint that failed least recently: a silently dead member is
    not tried again while another one has not failed, and no call is refused for want of an unfailed endpoint. A
    member that answers with an error of etcd's own (no leader, during an election) is kept: the election ends
    within seconds wherever the client goes, and each move ends every watch of the client.
    Logged in, it logs in again when etcd no longer knows its token (expired while only keep-alives flowed).
    Its calls raise the launcher's errors (`translate`)."""

    def __init__(self, *, user: str | None = None, password: str | None = None, **kwargs) -> None:
        self._login = (user, password) if user is not None and password is not None else None
        self._timeout: float | None = None
        super().__init__(user=user, password=password, **kwargs)
        self._drop_call_credentials_without_tls()

    @property
    def timeout(self) -> float | None:
        """The time limit of the calling thread's next unary call (pyetcd passes it with each)."""
        factor = errors.PATIENCE.factor
        if factor == 1 or self._timeout is None:
            return self._timeout
        return max(self._timeout, min(self._timeout * factor, errors.PATIENCE.until - time.monotonic()))

    @timeout.setter
    def timeout(self, seconds: float | None) -> None:
        self._timeout = seconds

    def _drop_call_credentials_without_tls(self) -> None:
        # gRPC sends call credentials only over TLS; the token travels in each call's metadata either way
        if not any(endpoint.secure for endpoint in self.endpoints.values()):
            self.call_credentials = None

    def read_prefix(self, prefix: str, page_keys: int = PAGE_KEYS, **filters) -> tuple[list, int]:
        """Every key-value under `prefix` (that `filters` such as min_mod_revision let through), in key order, as
        one consistent read at the etcd revision it returns, fetched `page_keys` at a time (should etcd compact
        that revision between two pages, it refuses the next with OUT_OF_RANGE)."""
        end = pyetcd.utils.prefix_range_end(pyetcd.utils.to_bytes(prefix))
        start: bytes = pyetcd.utils.to_bytes(prefix)
        kvs: list = []
        revision = None
        while True:
            page = self.get_range_response(start, end, limit=page_keys, revision=revision, **filters)
            if revision is None:
                revision = page.header.revision
            kvs.extend(page.kvs)
            if not page.more or not page.kvs:
                return kvs, revision
            start = page.kvs[-1].key + b"\0"

    def get_watcher(self):
        return _CancellingWatcher(
            etcdrpc.WatchStub(self.channel),
            functools.partial(self._watch_stream_failed, self.endpoint_label),
            timeout=WATCH_CREATE_TIMEOUT_S,
            call_credentials=self.call_credentials,
            metadata=self.metadata,
        )

    @property
    def channel(self):
        return self.endpoint_in_use.channel  # on_grpc_error moves on; nothing to decide here

    def on_grpc_error(self, exc: grpc.RpcError) -> NoReturn:
        self.on_endpoint_error(self.call_endpoint, exc)

    def on_endpoint_error(self, endpoint: str, exc: grpc.RpcError) -> NoReturn:
        """A call through `endpoint` failed with `exc`: fail over if that is the endpoint in use; raise ours."""
        code = exc.code()
        if code is grpc.StatusCode.UNAUTHENTICATED and self._login is not None and "token" in (exc.details() or ""):
            logger.info("etcd no longer knows our login token (%s); logging in again", exc.details())
            try:
                self.log_in(*self._login)  # the watcher holds the old token: its watches resume with the new one
            except grpc.RpcError as login_error:
                _raise_translated(login_error)
            self._drop_call_credentials_without_tls()
            raise EtcdUnavailable("etcd forgot our login token; logged in again") from exc  # the retry repeats it
        if code in _ENDPOINT_FAILED_CODES and len(self.endpoints) > 1 and not _answered_by_etcd(exc):
            self.endpoints[endpoint].last_failed = time.monotonic()
            if endpoint == self.endpoint_label:
                self.use_endpoint(self.endpoints_to_try()[1])
                logger.info("etcd endpoint %s failed (%s); using %s", endpoint, code.name, self.endpoint_label)
        _raise_translated(exc)

    def _watch_stream_failed(self, endpoint: str, exc: grpc.RpcError) -> None:
        try:
            self.on_endpoint_error(endpoint, exc)
        except Exception:  # noqa: BLE001 - it raises the launcher's error; the watch's owner resumes the watch
            pass

    def endpoints_to_try(self) -> list[str]:
        """Every endpoint: the one in use, then the others from the one that failed least recently."""
        in_use = self.endpoint_label
        others = sorted((label for label in self.endpoints if label != in_use), key=self._failed_at)
        return [in_use, *others]

    def _failed_at(self, label: str) -> float:
        return self.endpoints[label].last_failed


def _answered_by_etcd(exc: grpc.RpcError) -> bool:
    """Whether etcd itself sent the error ("etcdserver: no leader", "etcdserver: leader changed", ...): the member
    is up and electing with the others, where every member says the same, so moving on would only end every
    watch of the client; a member cut off from the others makes our calls time out, which does move us."""
    return (exc.details() or "").startswith("etcdserver:")


class LeaseRoutes:
    """`launcher.etcd.lease_keeper.LeaseRoutes` through the client that granted the lease."""

    def endpoints(self, lease) -> list[str]:
        return lease.etcd_client.endpoints_to_try()

    def refresh(self, lease, deadline: float, endpoint: str) -> list[Any]:
        client: _FailoverClient = lease.etcd_client
        try:
            return client.keep_alive_once(lease.id, deadline, endpoint)
        except grpc.RpcError as exc:
            client.on_endpoint_error(endpoint, exc)

    def prefer(self, lease, endpoint: str) -> None:
        client: _FailoverClient = lease.etcd_client
        if client.endpoint_label != endpoint:
            client.use_endpoint(endpoint)


LEASE_ROUTES = LeaseRoutes()


def connect(spec: str, timeout: float = 3.0, security: EtcdSecurity | None = None) -> EtcdClient:
    """A client for the endpoints in `spec` that fails over between them and recovers within a second; over TLS
    and logged in as `security` says. Logging in is a call: it raises what `connect_reachable` explains."""
    security = security or EtcdSecurity()
    credentials = _tls_credentials(security) if security.tls else None
    endpoints = [
        pyetcd.Endpoint(host, port, secure=security.tls, creds=credentials, opts=_GRPC_OPTIONS)
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
) -> str:
    """The version of the etcd v3 server that answered at `spec` within `deadline_s`; else raise EtcdUnreachable
    naming `spec`. A TLS handshake that failed, or a plain client at a server that speaks TLS, is not retried:
    waiting cannot change a certificate."""
    security = security or EtcdSecurity()

    def worth_retrying(exc: BaseException) -> bool:
        return is_transient(exc) and _tls_mismatch(exc, spec, security) is None

    try:
        status = errors.call_with_retry(client.status, deadline_s=deadline_s, retry_if=worth_retrying)
    except Exception as exc:  # grpc and the client raise a zoo of types for "not etcd" and "not there"
        raise explain(exc, spec, security) from exc
    return str(status.version)


def _tls_mismatch(exc: BaseException, spec: str, security: EtcdSecurity) -> str | None:
    """Why `exc` is a TLS refusal (None: it is not one): the handshake failed, or etcd speaks TLS to a client
    that does not."""
    detail = _detail(exc)
    if any(word in detail.lower() for word in ("ssl", "handshake", "certificate", "tls")):
        return detail
    if not security.tls and "connection refused" not in detail.lower():
        speaking = [f"{host}:{port}" for host, port in parse_endpoints(spec) if _speaks_tls(host, port)]
        if speaking:
            return f"{', '.join(speaking)} answered with TLS; elastic-run connected without it"
    return None


def _speaks_tls(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether a TLS handshake with host:port gets a TLS answer (the server's certificate, or its refusal of ours)."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw:
            with context.wrap_socket(raw, server_hostname=host):
                return True
    except ssl.SSLError as exc:
        return "ALERT" in (exc.reason or "")  # the server refused our handshake in TLS; a plain one just hangs up
    except OSError:
        return False


def explain(exc: BaseException, spec: str, security: EtcdSecurity | None = None) -> EtcdUnreachable:
    """What went wrong reaching etcd at `spec`, in one line that names the fix."""
    security = security or EtcdSecurity()
    detail = _detail(exc)
    code = exc.code() if isinstance(exc, grpc.RpcError) and hasattr(exc, "code") else None
    lowered = detail.lower()
    mismatch = _tls_mismatch(exc, spec, security)
    if mismatch is not None and not security.tls:
        return EtcdUnreachable(
            f"etcd at {spec} speaks TLS ({mismatch}): pass --rdzv-conf cacert=CA.pem (the CA that signed "
            "etcd's certificate), with cert=,key= if etcd asks for client certificates"
        )
    if mismatch is not None or (
        security.tls and code is grpc.StatusCode.UNAVAILABLE and "connection refused" not in lowered
    ):
        return EtcdUnreachable(
            f"TLS with etcd at {spec} failed ({_handshake_reason(detail)}); check --rdzv-conf cacert (the CA "
            "that signed etcd's certificate) and cert/key (a client certificate that CA signed)"
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


def _handshake_reason(detail: str) -> str:
    """OpenSSL's reason from gRPC's detail ("CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate"),
    or the whole detail when it names none."""
    _, found, reason = detail.rpartition("OPENSSL_internal:")
    return reason.removesuffix(": OK").strip() if found else detail


def _detail(exc: BaseException) -> str:
    while exc.__cause__ is not None and not isinstance(exc, grpc.RpcError):
        exc = exc.__cause__
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "details"):
        return exc.details() or exc.code().name
    return str(exc)


def connect_reachable(spec: str, security: EtcdSecurity | None = None, job_nodes: int | None = None) -> EtcdClient:
    """A client for `spec` once an etcd answered there; raises ValueError (bad spec) or EtcdUnreachable. With
    `job_nodes` (the job's maximum size) a known defect of that etcd's release is logged, as a warning from
    `versions.WARN_FROM_NODES` nodes."""
    try:
        client = connect(spec, security=security)
    except grpc.RpcError as exc:  # logging in failed
        raise explain(exc, spec, security) from exc
    try:
        version = check_reachable(client, spec, security)
    except EtcdUnreachable:
        client.close()
        raise
    defect = versions.defect_of(version)
    if job_nodes is not None and defect is not None:
        level = logging.WARNING if job_nodes >= versions.WARN_FROM_NODES else logging.INFO
        logger.log(
            level,
            "%s at %s: for a job of %d nodes run etcd %s or later, or 3.4 (Debian's etcd-server)",
            defect.describe(version),
            spec,
            job_nodes,
            defect.fixed_in,
        )
    return client


def is_transient(exc: BaseException) -> bool:
    """Errors that mean 'etcd did not answer this time', as opposed to a refused operation or a bad value."""
    if isinstance(exc, grpc.RpcError):
        return isinstance(translate(exc), EtcdUnavailable)
    # pyetcd raises WatchTimedOut itself when etcd does not confirm a new watch in time
    return isinstance(exc, (EtcdUnavailable, etcd_exceptions.WatchTimedOut))


def is_lease_gone(exc: BaseException) -> bool:
    """etcd's answer to a call under a lease that has expired or was revoked."""
    if isinstance(exc, grpc.RpcError):
        exc = translate(exc)
    return isinstance(exc, LeaseGone)


def call_with_retry(fn: Callable[..., T], *args, deadline_s: float = 30.0, **kwargs) -> T:
    """Call `fn` until it succeeds, retrying transient etcd errors with backoff for up to `deadline_s`."""
    return errors.call_with_retry(fn, *args, deadline_s=deadline_s, retry_if=is_transient, **kwargs)
