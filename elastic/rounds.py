"""In-process rounds: a membership change restarts the training function, not the worker process.

    import elastic

    @record
    def main(config):
        dist.init_process_group("gloo")
        ...                                   # build the model, load the newest checkpoint, train
        dist.destroy_process_group()

    if __name__ == "__main__":
        elastic.run(main, parse_config())

Under elastic-run, when a new round still includes this worker's node, the agent does not stop the worker: it
sends the new round over the worker's round socket (`launcher.workers.round_link`). A thread here receives it,
aborts this process's groups (`elastic.process_groups`), so that a collective blocked on a lost peer returns,
and `main` unwinds: with the collective's error, or with `RoundChanged` out of the next `elastic.heartbeat`.
`run` then destroys the groups, switches stdout and stderr to the new round's, sets `os.environ` to the new
round's torchrun variables (`RANK`, `WORLD_SIZE`, `MASTER_PORT`, `ELASTIC_ROUND`, ...), opens the new round's
channel and calls `main` again, which loads the newest checkpoint as it would in a new process. Imports,
compiled code, the CUDA context and whatever the caller of `run` holds survive.

A collective that fails before the agent offers a round (a peer died) is not the end either: `run` waits up
to `ELASTIC_ROUND_WAIT` seconds (elastic-run sets it: the lease plus --inprocess-timeout) for the round that
replaces the lost peer, and raises the error only if none comes. Other exceptions (`ValueError`, a bug) end
the worker at once, as without `run`. The agent kills a worker that has not re-entered within
--inprocess-timeout and starts its rank anew; a crashed or hung worker is always replaced by a new process.
Two waits no abort ends are known: a send gloo queued behind a peer that stopped reading
(`tests/integration/test_gloo_abort.py`), and a receive whose message had begun when the connection ended; and
init_process_group connecting to a store whose host stopped (TCPStore's client retries until the set-up's
timeout). A worker whose main thread still sits there (inside torch.distributed, at one instruction, in a futex
wait, once gloo closed every connection of its groups, or `STUCK_AFTER_S` after its abort whatever the
connections; or in that connect `STUCK_AFTER_S` after its abort) dumps its stacks and exits with
`UNWIND_STUCK_EXIT`, and its agent starts the rank anew in the same round, without waiting out the timeout.

A node that joins a job already training starts its workers before it registers, in standby
(`ELASTIC_STANDBY`): the script runs up to `run`, which tells the agent it is ready and waits for the round that
takes the node in, then enters `main` as a survivor re-enters it. The drain that makes room for the node is asked
for only then, so the round does not wait on the joiner's imports and set-up.

Each round's model build (fully_shard's detaches), first fused optimizer step and gradient clipping over FSDP2's
DTensors would pay DTensor's sharding propagation again; under `run` they run on the local shards where DTensor
would run them there anyway (`elastic.shard_local_ops`).

Outside elastic-run (plain `python`, torchrun, `--no-inprocess`) `run` calls `main` once.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from elastic import channel
from elastic.thread_frames import current_frames

logger = logging.getLogger(__name__)

ROUND_FD_ENV = "ELASTIC_ROUND_FD"  # the worker's end of its round socket
ROUND_WAIT_ENV = "ELASTIC_ROUND_WAIT"  # seconds a worker whose collective failed waits for the next round
STANDBY_ENV = "ELASTIC_STANDBY"  # set: started before its first round, which comes over the round socket
# a collective the abort ends has raised long before this (main re-entered within 0.10 s of the offer in 64 of 64
# re-entries of two CPU chaos runs; the clock starts once the abort returned, after NCCL's 0.5 s); one still
# waiting then waits on what no abort ends, and each second spent finding that out holds the whole job
STUCK_AFTER_S = 0.5
STUCK_LOOKS = 3  # over half a second more: the main thread sat at the same instruction, in a futex wait, each time
# once gloo closed every connection of the groups, a collective still waiting can only end by its timeout (30 min):
# gloo fails a send it queued, or a receive whose message had begun, without waking its waiter (one rank in about 26
# runs of 6 ranks aborting at once on 2 loaded cores; every connection was closed within 5 ms of the abort). Three
# looks 50 ms apart tell such a wait from one just woken
CLOSED_POLL_S = 0.025
CLOSED_LOOK_S = 0.05
STILL_BLOCKED = (
    "though its groups' connections were shut down (a send gloo queued behind a stopped peer, which no abort ends)"
)
BLOCKED_ON_CLOSED = (
    "though gloo closed every connection of its groups (a send or receive it lost track of, which nothing ends)"
)
CONNECTING_TO_STORE = (
    "connecting to its store (a TCPStore client retries until the set-up's timeout, which no abort shortens: the "
    "store's host stopped, or the last round's store closed)"
)
UNWIND_STUCK_EXIT = 75  # the worker could not unwind and left for its agent to start its rank anew (EX_TEMPFAIL)
READY_MESSAGE = b'{"ready": true}'  # a standby worker's word to its agent: it reached `run`
MAX_OFFER_BYTES = 4 << 20
Result = TypeVar("Result")


class RoundChanged(Exception):
    """elastic-run handed this worker a new round: `elastic.run` catches it and calls `main` again."""


@dataclass
class Offer:
    """A new round, as the agent sent it: its environment and the worker's new stdout and stderr."""

    env: dict[str, str]
    stdout_fd: int
    stderr_fd: int
    received: float  # time.monotonic() when it arrived

    @property
    def round(self) -> str:
        return self.env.get("ELASTIC_ROUND", "?")

    def discard(self) -> None:
        for fd in (self.stdout_fd, self.stderr_fd):
            os.close(fd)


class RoundLink:
    """The worker's end of its round socket: a thread receives the agent's offers of new rounds."""

    def __init__(self, control: socket.socket, wait_s: float) -> None:
        self.control = control
        self.wait_s = wait_s
        self._offer: Offer | None = None
        self._closed = False  # the agent closed its end: no round will come
        self._arrived = threading.Condition()

    @classmethod
    def from_env(cls) -> RoundLink | None:
        """This worker's link (None: not started by elastic-run with in-process rounds)."""
        fd = os.environ.get(ROUND_FD_ENV)
        if not fd:
            return None
        try:
            control = socket.socket(fileno=int(fd))
            if control.type != socket.SOCK_SEQPACKET:
                raise OSError("not a round socket")
        except (OSError, ValueError):
            return None
        control.set_inheritable(False)  # the worker's own: a subprocess it starts must not take its rounds
        return cls(control, float(os.environ.get(ROUND_WAIT_ENV, "30")))

    def start(self) -> None:
        threading.Thread(target=self._receive, name="elastic-rounds", daemon=True).start()

    def _receive(self) -> None:
        from elastic import process_groups

        while True:
            try:
                message, fds, _, _ = socket.recv_fds(self.control, MAX_OFFER_BYTES, 2)
            except OSError:
                return
            if not message:
                with self._arrived:  # the agent is gone: this worker runs on until it is stopped
                    self._closed = True
                    self._arrived.notify_all()
                return
            stdout_fd, stderr_fd = fds
            offer = Offer(json.loads(message)["env"], stdout_fd, stderr_fd, received=time.monotonic())
            with self._arrived:
                if self._offer is not None:
                    self._offer.discard()  # a newer round replaced it before main unwound
                self._offer = offer
                self._arrived.notify_all()
            shut = process_groups.abort_all()
            logger.info("round %s offered: aborted the process groups (%d connections shut down)", offer.round, shut)
            threading.Thread(target=self._follow_unwinding, args=(offer,), name="elastic-unwind", daemon=True).start()

    def _follow_unwinding(self, offer: Offer) -> None:
        """Leave at once (`UNWIND_STUCK_EXIT`) if the main thread stays blocked where the abort cannot reach: as soon
        as gloo closed every connection of its groups while main still waits inside torch.distributed (nothing is
        left that could end that wait), or, whatever the connections, `STUCK_AFTER_S` after the abort for `offer`
        returned, as when init_process_group still connects to its store then; otherwise the agent's
        --inprocess-timeout stays the judge."""
        from elastic import process_groups

        deadline = time.monotonic() + STUCK_AFTER_S
        where: str | None
        while True:
            with self._arrived:
                if self._arrived.wait_for(lambda: self._offer is not offer, CLOSED_POLL_S):
                    return  # main took it (or a newer round's offer replaced it, followed on its own)
            if time.monotonic() >= deadline:
                if process_groups.connecting_to_store():
                    where, why = "init_process_group's rendezvous", CONNECTING_TO_STORE
                else:
                    where, why = _blocked_in_torch_distributed(), STILL_BLOCKED
                break
            if process_groups.connections_closed():
                where, why = _blocked_in_torch_distributed(STUCK_LOOKS, CLOSED_LOOK_S), BLOCKED_ON_CLOSED
                if where is not None:
                    break
        if where is None or self._offer is not offer:
            return
        logger.error(
            "round %s offered %.2fs ago: main is still blocked at %s, inside torch.distributed, %s; leaving for "
            "elastic-run to start this rank anew",
            offer.round,
            time.monotonic() - offer.received,
            where,
            why,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os._exit(UNWIND_STUCK_EXIT)

    def pending(self) -> bool:
        return self._offer is not None

    def check(self) -> None:
        """Raise `RoundChanged` if a new round was offered (what `elastic.heartbeat` calls)."""
        if self._offer is not None:
            raise RoundChanged(f"elastic-run started round {self._offer.round}")

    def take(self, timeout_s: float | None) -> Offer | None:
        """The offered round, waiting up to `timeout_s` for one (None: until the agent closes its end); None if
        none came."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._arrived:
            while self._offer is None:
                left = None if deadline is None else deadline - time.monotonic()
                if self._closed or (left is not None and left <= 0):
                    return None
                self._arrived.wait(left)
            offer, self._offer = self._offer, None
            return offer

    def first_round(self) -> Offer:
        """In standby: tell the agent this worker is ready, and wait for the round that takes its node in."""
        try:
            self.control.send(READY_MESSAGE)
        except OSError:
            pass  # the agent's end is closed: take() says so
        offer = self.take(None)
        if offer is None:
            raise SystemExit("elastic-run's agent left before this standby worker's node took part in a round")
        return offer


def run(main: Callable[..., Result], *args, **kwargs) -> Result:
    """Call `main(*args, **kwargs)`; under elastic-run, again in each new round this worker takes part in."""
    link = RoundLink.from_env()
    if link is None:
        return main(*args, **kwargs)
    from elastic import process_groups

    process_groups.track_group_sockets()
    # what the script built before `run` (its imports, data, device) lives as long as the worker: frozen out of the
    # collector's sight, the collection at each round change walks only what `main` built (a warm worker's
    # zygote froze its torch imports the same way)
    gc.freeze()
    link.start()
    channel.round_check = link.check
    if os.environ.pop(STANDBY_ENV, None) is not None:
        _enter(link.first_round(), first=True)
    else:
        channel.drain_channel().set_inprocess()
    while True:
        _run_step_ops_on_shards()
        try:
            return main(*args, **kwargs)
        except Exception as exc:
            offer = _next_round(link, exc)
            if offer is None:
                raise
        # out of the except block: its exception, and the last round's frames it holds, are gone
        _enter(offer)


def _run_step_ops_on_shards() -> None:
    """A round's model build, first optimizer step and gradient clipping over DTensors cost a sharding propagation
    that no round reuses (`elastic.shard_local_ops`); a script that never imported DTensor has none to take over."""
    if "torch.distributed.tensor" in sys.modules:
        from elastic.shard_local_ops import take_over_step_ops

        take_over_step_ops()


def _next_round(link: RoundLink, exc: Exception) -> Offer | None:
    """The round to re-enter after `main` raised `exc` (None: the error is the worker's end)."""
    if link.pending():
        return link.take(0)
    channel.ring_agent()  # its error file is written: the agent reports the failure now, not at its next poll
    if not isinstance(exc, RuntimeError):  # torch.distributed's errors are; a bug in the script usually is not
        return None
    logger.warning(
        "%s: %s; waiting up to %gs for elastic-run's next round", type(exc).__name__, str(exc)[:200], link.wait_s
    )
    with channel.long_operation("waiting for the next round", timeout=link.wait_s + 5):
        return link.take(link.wait_s)


def _blocked_in_torch_distributed(looks: int = STUCK_LOOKS, interval_s: float = 0.25) -> str | None:
    """Where the main thread waits, if at each of `looks` it sat at one instruction of torch.distributed's Python
    code in a futex wait: a collective's wait, not a computation, I/O or a sleep (None otherwise, or where Linux's
    /proc cannot tell)."""
    main = threading.main_thread()
    package = f"{os.sep}torch{os.sep}distributed{os.sep}"
    seen = None
    for look in range(looks):
        if look:
            time.sleep(interval_s)
        frame = current_frames().get(main.ident or 0)
        # the main thread leads its process's threads: its id is the pid (threading's native_id can be the
        # zygote's, in a warm worker forked from it)
        if frame is None or package not in frame.f_code.co_filename or not _in_futex_wait(os.getpid()):
            return None
        here = (id(frame), frame.f_lasti)
        if seen is not None and here != seen:
            return None
        seen = here
    assert frame is not None
    return f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"


def _in_futex_wait(thread: int) -> bool:
    """Whether the thread sleeps in the kernel on a futex (a lock or condition variable), by its wait channel."""
    try:
        return "futex" in Path(f"/proc/self/task/{thread}/wchan").read_text()
    except OSError:
        return False


def _take_interpreter_name() -> None:
    """elastic-run names a standby worker for `ps` until its first round; from then on it is named as a worker
    started for the round, after its interpreter."""
    try:
        Path("/proc/self/comm").write_text(os.path.basename(sys.executable)[:15])
    except OSError:
        pass  # not Linux: no name was set


def _enter(offer: Offer, first: bool = False) -> None:
    from elastic import process_groups

    unwound = time.monotonic()
    process_groups.abort_all()  # a group built after the offer arrived (main was creating one) is aborted too
    process_groups.destroy_all()
    process_groups.forget_device_meshes()
    destroyed = time.monotonic()
    gc.collect()  # the last round's model and optimizer, before the new round builds its own
    collected = time.monotonic()
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, target in ((offer.stdout_fd, 1), (offer.stderr_fd, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.update(offer.env)
    channel.reopen().set_inprocess()
    if first:
        _take_interpreter_name()
        logger.info(
            "round %s: entering main (rank %s of %s), started in standby before the round, %.2fs after the offer",
            offer.round,
            offer.env.get("RANK"),
            offer.env.get("WORLD_SIZE"),
            time.monotonic() - offer.received,
        )
        return
    logger.info(
        "round %s: re-entering main in process (rank %s of %s), %.2fs after the offer (unwinding %.2fs, groups "
        "destroyed %.2fs, garbage collected %.2fs)",
        offer.round,
        offer.env.get("RANK"),
        offer.env.get("WORLD_SIZE"),
        time.monotonic() - offer.received,
        unwound - offer.received,
        destroyed - unwound,
        collected - destroyed,
    )
