"""What wakes the agent between its polls: a worker's exit, and a worker ringing the agent's doorbell.

The agent looks at its workers every --monitor-interval (0.1 s, torchrun's default) and otherwise sleeps until
etcd changes. A membership change's pause starts with that look: a worker SIGKILLed, or one whose collective
failed because a peer died, was seen on average half an interval late, and the whole job waited for it. Here a
thread waits on the evidence itself and wakes the agent's loop at once:

- each worker's exit, through a pidfd (Linux 5.3+) of its supervisor, readable once it exits;
- the doorbell: a datagram socket in Linux's abstract namespace, named in the workers' `ELASTIC_AGENT_DOORBELL`
  (`doorbell_address`). A worker rings it when something the agent acts on happened in it and no exit shows it:
  `main` raised (its error file is written; under `elastic.run` it waits for the next round) or a drain's
  checkpoint committed (`elastic.channel.ring_agent`).

A wake-up only makes the agent poll now; what it finds is judged as on every poll, so a lost ring or a stray one
costs nothing but an interval or a poll. Where pidfds or abstract sockets are missing, the agent polls as before.
"""

from __future__ import annotations

import hashlib
import logging
import os
import select
import socket
import threading
from collections.abc import Callable, Iterable

from elastic.channel import socket_address

logger = logging.getLogger(__name__)

MAX_RINGS_READ = 64  # rings taken in per wake-up: any number of them means the same, "poll now"


def doorbell_address(node_id: str) -> str:
    """The `ELASTIC_AGENT_DOORBELL` of this agent process's workers: `@` and a name in the abstract namespace, unique
    to this process and node (an agent that starts again gets another; a stale worker's ring goes nowhere)."""
    node = hashlib.sha1(node_id.encode()).hexdigest()[:12]
    return f"@elastic-agent-{os.getpid()}-{node}"


class WorkerWakeups:
    """Calls `wake` from its own thread (`worker-wakeups`) when a watched worker exits or the doorbell rings.

    The agent's thread calls `watch` with the pids of its workers, and `close` at its end; the lock guards the
    pidfds, which both threads add and remove."""

    def __init__(self, node_id: str, wake: Callable[[], None]) -> None:
        self.address = doorbell_address(node_id)
        self._wake = wake
        self._lock = threading.Lock()
        self._pidfds: dict[int, int] = {}  # pid -> its pidfd, registered with the epoll
        self._pids_by_fd: dict[int, int] = {}
        # pids not to watch again: their exit woke the agent already, or they cannot be watched
        self._done: set[int] = set()
        self._epoll: select.epoll | None = None
        self._doorbell: socket.socket | None = None
        self._stop_r, self._stop_w = -1, -1
        self._thread: threading.Thread | None = None
        self._unavailable = not hasattr(os, "pidfd_open")

    def watch(self, pids: Iterable[int]) -> None:
        """Follow exactly these processes' exits from now on (the thread starts with the first ones)."""
        wanted = set(pids)
        if self._unavailable or (not wanted and self._thread is None):
            return
        if self._thread is None and not self._start():
            return
        assert self._epoll is not None
        with self._lock:
            for pid in [pid for pid in self._pidfds if pid not in wanted]:
                self._forget(pid)
            self._done &= wanted
            for pid in wanted - self._pidfds.keys() - self._done:
                try:
                    fd = os.pidfd_open(pid)
                except OSError as exc:
                    self._done.add(pid)
                    if isinstance(exc, ProcessLookupError):
                        self._wake()  # gone already: the next poll sees how it ended
                    else:  # a kernel before 5.3
                        logger.debug("no pidfd for worker %d (%s): its exit is seen at a poll", pid, exc)
                    continue
                self._pidfds[pid], self._pids_by_fd[fd] = fd, pid
                self._epoll.register(fd, select.EPOLLIN)

    def _start(self) -> bool:
        try:
            doorbell = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
            doorbell.bind(socket_address(self.address))
        except OSError as exc:
            logger.info("no doorbell for the workers (%s): they are polled every --monitor-interval", exc)
            self._unavailable = True
            return False
        self._doorbell = doorbell
        self._epoll = select.epoll()
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._epoll.register(doorbell.fileno(), select.EPOLLIN)
        self._epoll.register(self._stop_r, select.EPOLLIN)
        self._thread = threading.Thread(target=self._run, name="worker-wakeups", daemon=True)
        self._thread.start()
        return True

    def _run(self) -> None:
        assert self._epoll is not None and self._doorbell is not None
        while True:
            events = self._epoll.poll()
            woken = False
            for fd, _ in events:
                if fd == self._stop_r:
                    return
                if fd == self._doorbell.fileno():
                    self._take_rings()
                    woken = True
                    continue
                with self._lock:
                    pid = self._pids_by_fd.get(fd)
                    # None: the agent's thread forgot it meanwhile; not readable now: an event of an fd closed
                    # meanwhile, its number since reused by a pidfd of a worker that runs
                    if pid is not None and select.select([fd], [], [], 0)[0]:
                        self._forget(pid)
                        self._done.add(pid)
                        woken = True
            if woken:
                self._wake()

    def _take_rings(self) -> None:
        assert self._doorbell is not None
        for _ in range(MAX_RINGS_READ):
            try:
                self._doorbell.recv(1)
            except OSError:  # BlockingIOError: none left
                return

    def _forget(self, pid: int) -> None:
        """Stop watching `pid` (the lock is held)."""
        assert self._epoll is not None
        fd = self._pidfds.pop(pid)
        del self._pids_by_fd[fd]
        self._epoll.unregister(fd)
        os.close(fd)

    def close(self) -> None:
        """End the thread and release the pidfds and the doorbell."""
        if self._thread is None:
            return
        os.write(self._stop_w, b"x")
        self._thread.join()
        self._thread = None
        with self._lock:
            for pid in list(self._pidfds):
                self._forget(pid)
        assert self._epoll is not None and self._doorbell is not None
        self._epoll.close()
        self._doorbell.close()
        os.close(self._stop_r)
        os.close(self._stop_w)
