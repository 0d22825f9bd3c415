"""Warm workers: one pre-started interpreter per local rank, torch already imported, waiting for its round.

A cold worker spends most of its start-up in Python and `import torch` (3 s of the 4 s a lost node costs on
a 2-core machine). The agent keeps a `WarmPool`; a round's `WorkerGroup` takes the warm interpreter of each
local rank and hands it the round's environment, argv and stdio (`launcher.warm_interpreter` becomes the
script). A rank without a fitting warm interpreter starts cold, exactly as before:

- the environment it was started with must be the node's part of the round's worker environment
  (`node_worker_env`: everything but rank, world, master and files), since torch and OpenMP read some
  variables at import;
- it must still be alive and its control socket open.

The pool is refilled a while after a round's workers started, not at once, so that the new interpreters'
imports do not compete for the CPU with the starting round. `--no-warm-workers` turns the pool off; `-m` and
`--no-python` always start cold.
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from launcher.process_tree import stop_group, supervised_command
from launcher.warm_interpreter import CONTROL_FD_ENV

logger = logging.getLogger(__name__)

_PROGRAM = str(Path(__file__).with_name("warm_interpreter.py"))


@dataclass
class WarmWorker:
    """A pre-started interpreter (under its supervisor) and the agent's end of its control socket."""

    process: subprocess.Popen
    control: socket.socket

    def launch(self, env: dict[str, str], argv: list[str], stdout_fd: int, stderr_fd: int) -> bool:
        """Hand over the round: False if the interpreter is gone (the caller starts the rank cold)."""
        message = json.dumps({"env": env, "argv": argv}).encode()
        try:
            socket.send_fds(self.control, [message], [stdout_fd, stderr_fd])
        except OSError:
            return False
        finally:
            self.control.close()
        return True


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
        env = dict(self.env, **{CONTROL_FD_ENV: str(theirs.fileno())})
        command = supervised_command([sys.executable, "-u", _PROGRAM, *self.argv])
        with theirs:
            process = subprocess.Popen(
                command,
                env=env,
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
            )
        return WarmWorker(process, ours)

    @staticmethod
    def _discard(workers: list[WarmWorker]) -> None:
        for warm in workers:
            warm.control.close()  # an idle interpreter exits when its socket closes
        stop_group([w.process for w in workers], grace_s=2.0)
