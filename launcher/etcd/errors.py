"""The etcd errors the launcher's own code sees, and the one retry policy for them.

`launcher.etcd.client` turns what gRPC and pyetcd raise into these, so no `grpc.RpcError` reaches the protocol or
the agent. This module imports neither gRPC nor pyetcd: the rendezvous protocol, which the pure rules import for
its keys, names these errors without pulling in an etcd client.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import tenacity

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EtcdUnavailable(Exception):
    """etcd gave no answer this time (down, restarting, electing a leader, overloaded, or the network): the same
    call may succeed a moment later."""


class EtcdTimedOut(EtcdUnavailable):
    """etcd did not answer in time (the call's deadline passed, or etcd's own request timeout did): slow, or cut
    off. A write may still be applied after its caller gave up on it."""


class LeaseGone(Exception):
    """etcd no longer has the lease a call named: it expired, or somebody revoked it."""


class EtcdUnreachable(RuntimeError):
    """No endpoint of the configured etcd answered."""


def is_unavailable(exc: BaseException) -> bool:
    return isinstance(exc, EtcdUnavailable)


class _Patience(threading.local):
    """How long the calling thread's etcd calls wait for an answer: the client's own timeout times `factor`, never
    past `until` (time.monotonic). `call_with_retry` sets both for the attempts of one call; the client reads them."""

    factor = 1
    until = math.inf


PATIENCE = _Patience()


def call_with_retry(
    fn: Callable[..., T],
    *args: Any,
    deadline_s: float,
    retry_if: Callable[[BaseException], bool] = is_unavailable,
    **kwargs: Any,
) -> T:
    """Call `fn` until it succeeds, retrying errors `retry_if` accepts with backoff for up to `deadline_s`; then
    raise the last one.

    After an attempt etcd did not answer in time, the next waits twice as long (up to `deadline_s`). A slow etcd
    still applies a write whose caller gave up on it, so asking again at the same pace only queues more copies:
    at 4,096 nodes, acknowledgements asked every 3 s made etcd commit five to ten proposals for each one needed,
    and the backlog in its apply loop held back whatever waits for it (a refresh a follower forwards; from etcd
    3.5.5, every refresh)."""

    def attempt() -> T:
        try:
            return fn(*args, **kwargs)
        except EtcdTimedOut:
            PATIENCE.factor *= 2
            raise

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(retry_if),
        # at random below the exponential bound: callers that failed together (thousands of agents behind one busy
        # etcd) do not all ask again at the same moment
        wait=tenacity.wait_random_exponential(multiplier=0.05, max=1.0),
        stop=tenacity.stop_after_delay(deadline_s),
        reraise=True,
        before_sleep=lambda state: logger.debug(
            "etcd call %s failed, retrying: %s", fn, state.outcome.exception() if state.outcome else None
        ),
    )
    outer = PATIENCE.factor, PATIENCE.until
    PATIENCE.factor, PATIENCE.until = 1, time.monotonic() + deadline_s
    try:
        return retrying(attempt)
    finally:
        PATIENCE.factor, PATIENCE.until = outer
