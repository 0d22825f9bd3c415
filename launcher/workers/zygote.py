"""The node's zygote, from the agent's side: one interpreter that imported torch once and forks warm workers.

A warm worker used to be a whole interpreter importing torch for seconds; on a loaded host the pool was still
importing when the next fault came. The zygote (`launcher.workers.warm_interpreter`, run as a program) pays for
the imports once per agent; each warm worker is then a fork of it, ready in milliseconds. Its exit code comes
back over the zygote's socket: the supervisor it forked is its child, not the agent's, so `ForkedProcess` stands
in for the `subprocess.Popen` of a cold worker (`process_tree.WorkerProcess`).

The zygote dies with the agent (its parent-death signal), and the supervisors it forked with it; a zygote that
exited (killed, or torch failed to import) leaves the pool empty, and ranks start cold.
"""

from __future__ import annotations

import json
import logging
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from launcher.workers.process_tree import is_running, orphan_safe_command, stop_group
from launcher.workers.warm_interpreter import MAX_MESSAGE_BYTES, ZYGOTE_FD_ENV

logger = logging.getLogger(__name__)

_PROGRAM = str(Path(__file__).with_name("warm_interpreter.py"))
FORK_TIMEOUT_S = 10.0  # a fork answers in milliseconds; past this the zygote is taken for stuck
EXIT_REPORT_S = 0.05  # the zygote reports a supervisor's exit within a millisecond of it; this is ample
_GONE = -9  # the exit code of a supervisor whose zygote died before reporting it: it was killed with it


class Zygote:
    """The zygote process and the agent's end of its socket; the exit codes it reported, by supervisor pid."""

    def __init__(self, env: dict[str, str], argv: list[str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.process = subprocess.Popen(
                orphan_safe_command([sys.executable, "-u", _PROGRAM, *argv]),
                env=dict(env, **{ZYGOTE_FD_ENV: str(theirs.fileno())}),
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
            )
        self.channel = ours
        self.ready = False
        self._exits: dict[int, int] = {}
        self._forked: list[int] = []
        self._lock = threading.Lock()

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self, timeout_s: float, interrupted: Callable[[], bool] = lambda: False) -> bool:
        """Wait until the zygote finished its imports, at most `timeout_s` or until `interrupted()`; False if it
        did not (or exited)."""
        deadline = time.monotonic() + timeout_s
        while not self.ready and self.alive() and not interrupted():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.collect(min(left, 0.1))
        return self.ready

    def fork(self, control: socket.socket, order: dict | None = None) -> ForkedProcess | None:
        """A warm worker forked with `control` (the worker's end of its control socket) and its supervisor's
        stand-in, or with `order` {"store": {"host": addr, "world_size": N}} a round's store; None if the zygote is not
        ready, gone or stuck."""
        if not self.ready:
            self.collect(0)  # it may have said so since we last read
        if not self.ready:
            return None
        try:
            socket.send_fds(self.channel, [json.dumps(order or {"fork": True}).encode()], [control.fileno()])
        except OSError:
            return None
        deadline = time.monotonic() + FORK_TIMEOUT_S
        while not self._forked and self.alive() and time.monotonic() < deadline:
            self.collect(0.05)
        with self._lock:
            if not self._forked:
                logger.warning("the zygote did not answer a fork within %gs", FORK_TIMEOUT_S)
                return None
            return ForkedProcess(self, self._forked.pop(0))

    def exit_code(self, pid: int) -> int | None:
        """The exit code of supervisor `pid` once it exited (None while it runs)."""
        self.collect(0)
        if pid not in self._exits and not is_running(pid):
            # it exited, and the zygote reaps it and reports its code at once: the agent woke on that exit
            # (launcher.workers.wakeups), and without the code would see the worker running until its next poll
            deadline = time.monotonic() + EXIT_REPORT_S
            while pid not in self._exits and self.alive() and time.monotonic() < deadline:
                self.collect(deadline - time.monotonic())
            if pid not in self._exits and not self.alive():
                return _GONE
        with self._lock:
            return self._exits.pop(pid, None)

    def collect(self, timeout_s: float) -> None:
        """Read what the zygote said, waiting at most `timeout_s` for the first message."""
        with self._lock:
            if self.channel.fileno() < 0:  # closed: it reports nothing more
                return
            wait = timeout_s
            while select.select([self.channel], [], [], wait)[0]:
                wait = 0
                try:
                    raw = self.channel.recv(MAX_MESSAGE_BYTES)
                except OSError:
                    return
                if not raw:  # it exited
                    return
                message = json.loads(raw)
                if "ready" in message:
                    self.ready = True
                elif "forked" in message:
                    self._forked.append(message["forked"])
                elif "exited" in message:
                    self._exits[message["exited"]] = message["code"]

    def close(self) -> None:
        """End the zygote: the supervisors it forked die with it, and the warm workers under them."""
        self.channel.close()
        stop_group([self.process], grace_s=2.0)


class ForkedProcess:
    """A supervisor forked by the zygote, as the agent holds a cold worker's `subprocess.Popen`."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote = zygote
        self.pid = pid
        self.returncode: int | None = None
        self.args = [_PROGRAM]

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            if not self.zygote.alive():
                time.sleep(0.01)  # its supervisor is dying with it; /proc tells when it is gone
            else:
                self.zygote.collect(0.05 if left is None else min(left, 0.05))
        assert self.returncode is not None
        return self.returncode


class RoundStore:
    """A round's TCPStore, served by a process forked from the zygote until `close`."""

    def __init__(self, process: ForkedProcess, control: socket.socket, port: int) -> None:
        self.process = process
        self.control = control
        self.port = port

    def close(self) -> None:
        """End it: the process exits when its control socket closes (the zygote reaps it)."""
        self.control.close()
