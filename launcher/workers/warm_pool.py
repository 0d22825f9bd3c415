"""Warm workers: one pre-started interpreter per local rank, torch already imported, waiting for its round.

A cold worker spends most of its start-up in Python and `import torch` (3 s of the 4 s a lost node costs on
a 2-core machine). The agent keeps a `WarmPool`; a round's `WorkerGroup` takes the warm interpreter of each
local rank and hands it the round's environment, argv and stdio (`launcher.workers.warm_interpreter` becomes the
script). A rank without a fitting warm interpreter starts cold, exactly as before:

- the environment it was started with must be the node's part of the round's worker environment
  (`node_worker_env`: everything but rank, world, master and files), since torch and OpenMP read some
  variables at import;
- it must still be alive and its control socket open.

An agent joining a job that already trains registers only once its warm interpreters are ready (at most
`JOIN_WAIT_S`), so that the round that takes it in does not wait on its imports while the others stand idle;
one that joins a job with no round yet registers at once, and its imports overlap the rendezvous.

The pool is refilled a while after a round's workers started, not at once, so that the new interpreters'
imports do not compete for the CPU with the starting round. `--no-warm-workers` turns the pool off; `-m` and
`--no-python` always start cold.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from launcher.workers.process_tree import stop_group, supervised_command
from launcher.workers.warm_interpreter import CONTROL_FD_ENV, READY_FD_ENV

logger = logging.getLogger(__name__)

_PROGRAM = str(Path(__file__).with_name("warm_interpreter.py"))
JOIN_WAIT_S = 60.0  # past it, a node joining a running job registers anyway: its ranks start when they can


@dataclass
class WarmWorker:
    """A pre-started interpreter (under its supervisor) and the agent's end of its control socket."""

    process: subprocess.Popen
    control: socket.socket
    importing: int | None  # the read end of its ready pipe until it wrote to it (imports done) or exited

    def launch(
        self,
        env: dict[str, str],
        argv: list[str],
        stdout_fd: int,
        stderr_fd: int,
        extra_fds: dict[str, int] | None = None,
    ) -> bool:
        """Hand over the round: False if the interpreter is gone (the caller starts the rank cold).

        `extra_fds`: descriptors the worker also gets, each named in its environment variable of that name."""
        extra_fds = extra_fds or {}
        message = json.dumps({"env": env, "argv": argv, "fd_env": list(extra_fds)}).encode()
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
        self.done_importing()

    def still_importing(self) -> bool:
        """Whether it has not yet said that its imports are done (nor exited): launched now, the round waits."""
        if self.importing is not None and select.select([self.importing], [], [], 0)[0]:
            self.done_importing()
        return self.importing is not None and self.process.poll() is None

    def done_importing(self) -> None:
        if self.importing is not None:
            os.close(self.importing)
            self.importing = None


class WarmPool:
    """One warm interpreter per local rank for the next round; `take` hands one out, `fill` replaces it."""

    def __init__(self, env: dict[str, str], nproc: int, argv: list[str]) -> None:
        self.env = env
        self.nproc = nproc
        self.argv = argv  # the script and its arguments: shown on the command line only, the launch carries them
        self._workers: dict[int, WarmWorker] = {}

    def fill(self) -> None:
        """Start a warm interpreter for every local rank that has none."""
        for local_rank in range(self.nproc):
            if local_rank not in self._workers:
                self._workers[local_rank] = self._start()

    def wait_before_joining(self, interrupted: Callable[[], bool]) -> None:
        """A job that trains already would stand idle in the round that takes this node in until its
        interpreters imported torch: wait for them (at most `JOIN_WAIT_S`)."""
        started = time.monotonic()
        ready = self.wait_ready(JOIN_WAIT_S, interrupted)
        logger.info(
            "the job is training: joining once this node's warm workers imported torch (%s after %.1fs)",
            "ready" if ready else "not all ready",
            time.monotonic() - started,
        )

    def wait_ready(self, timeout_s: float, interrupted: Callable[[], bool]) -> bool:
        """Wait until every warm interpreter finished its imports (or exited), at most `timeout_s` seconds or
        until `interrupted()`; True if none is still importing."""
        deadline = time.monotonic() + timeout_s
        importing = {warm.importing: warm for warm in self._workers.values() if warm.importing is not None}
        while importing and not interrupted():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            readable, _, _ = select.select(list(importing), [], [], min(left, 0.1))
            exited = [fd for fd, warm in importing.items() if warm.process.poll() is not None]
            for fd in {*readable, *exited}:  # it wrote: the imports are done; or it is gone
                importing.pop(fd).done_importing()
        return not importing

    def take(self, local_rank: int, node_env: dict[str, str]) -> WarmWorker | None:
        """The warm interpreter of `local_rank` if it was started with `node_env` (None: start the rank cold)."""
        warm = self._workers.pop(local_rank, None)
        if warm is None:
            return None
        exited = warm.process.poll() is not None
        if not exited and node_env == self.env:
            return warm
        logger.info(
            "local rank %d starts cold: its warm interpreter %s",
            local_rank,
            "exited" if exited else "was started with another environment",
        )
        self._discard([warm])
        return None

    def close(self) -> None:
        self._discard(list(self._workers.values()))
        self._workers.clear()

    def _start(self) -> WarmWorker:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        importing, done = os.pipe()
        env = dict(self.env, **{CONTROL_FD_ENV: str(theirs.fileno()), READY_FD_ENV: str(done)})
        command = supervised_command([sys.executable, "-u", _PROGRAM, *self.argv])
        try:
            with theirs:
                process = subprocess.Popen(
                    command,
                    env=env,
                    start_new_session=True,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    pass_fds=(theirs.fileno(), done),
                )
        finally:
            os.close(done)
        return WarmWorker(process, ours, importing)

    @staticmethod
    def _discard(workers: list[WarmWorker]) -> None:
        for warm in workers:
            warm.close()
        stop_group([w.process for w in workers], grace_s=2.0)
