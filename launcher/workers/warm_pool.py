"""Warm workers: one forked interpreter per local rank, torch already imported, waiting for its round.

A cold worker spends most of its start-up in Python and `import torch` (3 s of the 4 s a lost node costs on
a 2-core machine). The agent keeps a `WarmPool`; a round's `WorkerGroup` takes the warm worker of each local
rank and hands it the round's environment, argv and stdio (`launcher.workers.warm_interpreter` becomes the
script). The warm workers are forked from the node's zygote (`launcher.workers.zygote`), which imported torch
once: a refill costs milliseconds, so the pool is full again right after a round starts, and a second fault
soon after the first finds it as full as the first did. A rank without a fitting warm worker starts cold,
exactly as before:

- the environment the zygote was started with must be the node's part of the round's worker environment
  (`node_worker_env`: everything but rank, world, master and files), since torch and OpenMP read some
  variables at import;
- the zygote must be alive (a zygote that died after it was ready is started again at the next fill; one that
  never got ready, torch failing to import, is not).

An agent joining a job that already trains registers only once its zygote is ready (at most `JOIN_WAIT_S`)
and its ranks wait in standby (`launcher.workers.standby`), so that the round that takes it in does not wait on
its imports while the others stand idle; one that joins a job with no round yet registers at once, and the
zygote's imports overlap the rendezvous. `--no-warm-workers`
turns the pool off; `-m` and `--no-python` always start cold.
"""

from __future__ import annotations

import json
import logging
import select
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from launcher.workers.process_tree import stop_group
from launcher.workers.warm_interpreter import MAX_MESSAGE_BYTES
from launcher.workers.zygote import ForkedProcess, RoundStore, Zygote

logger = logging.getLogger(__name__)

JOIN_WAIT_S = 60.0  # past it, a node joining a running job registers anyway: its ranks start when they can
STORE_START_S = 5.0  # a store forked from the zygote listens in milliseconds


@dataclass
class WarmWorker:
    """A forked interpreter (under its supervisor) and the agent's end of its control socket."""

    process: ForkedProcess
    control: socket.socket

    def launch(
        self,
        env: dict[str, str],
        argv: list[str],
        stdout_fd: int,
        stderr_fd: int,
        extra_fds: dict[str, int] | None = None,
        name: str | None = None,
    ) -> bool:
        """Hand over the round: False if the interpreter is gone (the caller starts the rank cold).

        `extra_fds`: descriptors the worker also gets, each named in its environment variable of that name;
        `name`: its process name (None: the interpreter's own, as a cold worker has)."""
        extra_fds = extra_fds or {}
        message = json.dumps({"env": env, "argv": argv, "fd_env": list(extra_fds), "name": name}).encode()
        try:
            socket.send_fds(self.control, [message], [stdout_fd, stderr_fd, *extra_fds.values()])
        except OSError:
            return False
        finally:
            self.close()
        return True

    def close(self) -> None:
        """Give it up: an interpreter that was not launched exits when its control socket closes."""
        self.control.close()


class WarmPool:
    """One warm worker per local rank for the next round; `take` hands one out, `fill` replaces it."""

    def __init__(self, env: dict[str, str], nproc: int, argv: list[str]) -> None:
        self.env = env
        self.nproc = nproc
        self.argv = argv  # the script and its arguments: shown on the command line only, the launch carries them
        self._zygote: Zygote | None = None
        self._workers: dict[int, WarmWorker] = {}

    def fill(self) -> bool:
        """Fork a warm worker for every local rank that has none (starting the zygote first if there is none);
        False while that cannot be done yet: the zygote is still importing, or gone."""
        self._zygote_started()
        for local_rank in range(self.nproc):
            if local_rank not in self._workers:
                warm = self._fork_worker()
                if warm is None:
                    return False
                self._workers[local_rank] = warm
        return True

    def wait_before_joining(self, interrupted: Callable[[], bool]) -> None:
        """A job that trains already would stand idle in the round that takes this node in until its zygote
        imported torch: wait for it (at most `JOIN_WAIT_S`)."""
        started = time.monotonic()
        ready = self.wait_ready(JOIN_WAIT_S, interrupted)
        self.fill()
        logger.info(
            "the job is training: joining once this node's zygote imported torch (%s after %.1fs)",
            "ready" if ready else "not ready",
            time.monotonic() - started,
        )

    def wait_ready(self, timeout_s: float, interrupted: Callable[[], bool]) -> bool:
        """Wait until the zygote finished its imports, at most `timeout_s` seconds or until `interrupted()`;
        False if it did not, or exited."""
        return self._zygote_started().wait_ready(timeout_s, interrupted)

    def take(self, local_rank: int, node_env: dict[str, str]) -> WarmWorker | None:
        """The warm worker of `local_rank`, forked now if the pool has none, if the zygote was started with
        `node_env` (None: start the rank cold)."""
        warm = self._workers.pop(local_rank, None)
        if node_env != self.env:
            logger.info("local rank %d starts cold: the zygote was started with another environment", local_rank)
            self._discard([warm] if warm is not None else [])
            return None
        if warm is not None and warm.process.poll() is None:
            return warm
        if warm is not None:
            self._discard([warm])
        zygote = self._zygote_started()
        if not zygote.ready:
            started = time.monotonic()
            zygote.wait_ready(JOIN_WAIT_S)
            logger.info("local rank %d waited %.1fs for the zygote's imports", local_rank, time.monotonic() - started)
        warm = self._fork_worker()
        if warm is None:
            logger.info("local rank %d starts cold: no warm worker could be forked", local_rank)
        return warm

    def serve_store(self, host: str, world_size: int) -> RoundStore | None:
        """A round's store, listening before any worker starts (None: the zygote is not ready, or the store did
        not start within `STORE_START_S`; rank 0 serves it then)."""
        self._zygote_started()
        forked = self._fork({"store": {"host": host, "world_size": world_size}})
        if forked is None:
            return None
        process, ours = forked
        answer = b""
        if select.select([ours], [], [], STORE_START_S)[0]:
            try:
                answer = ours.recv(MAX_MESSAGE_BYTES)
            except OSError:
                pass
        if not answer:
            logger.warning("the round's store did not start within %gs: rank 0 serves it", STORE_START_S)
            ours.close()
            return None
        return RoundStore(process, ours, json.loads(answer)["port"])

    def close(self) -> None:
        self._discard(list(self._workers.values()))
        self._workers.clear()
        if self._zygote is not None:
            self._zygote.close()

    def _zygote_started(self) -> Zygote:
        """The zygote, started if there is none or if the one that was ready died (one that died before it was
        ready, torch failing to import, is not started again: its ranks start cold and say why)."""
        if self._zygote is None or (self._zygote.ready and not self._zygote.alive()):
            if self._zygote is not None:
                logger.warning("the zygote exited (%s): starting another", self._zygote.process.returncode)
                self._discard(list(self._workers.values()))  # they died with it
                self._workers.clear()
                self._zygote.close()
            self._zygote = Zygote(self.env, self.argv)
        return self._zygote

    def _fork_worker(self) -> WarmWorker | None:
        forked = self._fork()
        return WarmWorker(*forked) if forked is not None else None

    def _fork(self, order: dict | None = None) -> tuple[ForkedProcess, socket.socket] | None:
        """A fork of the zygote (a warm worker, or what `order` asks for) and our end of its control socket."""
        assert self._zygote is not None, "forked through _zygote_started"
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            process = self._zygote.fork(theirs, order)
        if process is None:
            ours.close()
            return None
        return process, ours

    @staticmethod
    def _discard(workers: list[WarmWorker]) -> None:
        for warm in workers:
            warm.close()
        stop_group([w.process for w in workers], grace_s=2.0)
