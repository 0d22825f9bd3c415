"""The agent's end of a worker's round socket: how a new round reaches a worker that runs under `elastic.run`.

Every worker is started with one end of a SOCK_SEQPACKET socket pair (`ELASTIC_ROUND_FD`, `elastic.rounds`).
When a new round still includes this node, the agent does not stop a worker that said it takes rounds in
process (its channel's `inprocess` flag); it sends it an offer instead: a JSON object with the new round's
environment (`env`), and the new round's stdout and stderr descriptors attached. The worker aborts its
process groups, unwinds `main`, and starts it again in the new round.
"""

from __future__ import annotations

import json
import socket


class RoundLink:
    """One worker's round socket: the agent's end, and the worker's end until the worker holds it."""

    def __init__(self, ours: socket.socket, theirs: socket.socket | None) -> None:
        self.control = ours
        self._theirs = theirs

    @classmethod
    def pair(cls) -> RoundLink:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        return cls(ours, theirs)

    @property
    def worker_fd(self) -> int:
        assert self._theirs is not None, "the worker's end is passed once, at its start"
        return self._theirs.fileno()

    def started(self) -> None:
        """The worker holds its end now (or never will: a launch that failed)."""
        if self._theirs is not None:
            self._theirs.close()
            self._theirs = None

    def offer(self, env: dict[str, str], stdout_fd: int, stderr_fd: int) -> bool:
        """Hand the worker a new round; False when it can no longer take one (its end is closed)."""
        try:
            socket.send_fds(self.control, [json.dumps({"env": env}).encode()], [stdout_fd, stderr_fd])
        except OSError:
            return False
        return True

    def close(self) -> None:
        self.control.close()
        if self._theirs is not None:
            self._theirs.close()
            self._theirs = None
