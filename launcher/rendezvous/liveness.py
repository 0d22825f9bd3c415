"""A fast failure detector: each agent answers liveness probes on a small TCP port named in its registration.

The lease TTL is the backstop for a lost node, and it is seconds. When a member falls silent while its peers'
workers fail, the controller probes it (`launcher.rendezvous.decisions`, rule 6) and does not wait for the lease:

- the agent answers with its incarnation (its lease id, hex, one line) from a thread of its own, so a busy main
  loop still answers; an agent that is stopped (SIGSTOP) or whose host is gone does not answer within
  `probe_timeout`; a dead agent on a live host refuses the connection at once;
- any answer but its own incarnation's (a newer agent on that port) counts as no answer.

A node that fails its probe is marked lost and its lease revoked, which fences it: an agent alive after all
finds its lease gone, stops its workers and rejoins as a newcomer.

How long a suspect may take is measured against its peers (`probe_all`): the controller probes a few other live
members with it, and once every one of them answered, a suspect still silent after `PEER_FACTOR` times the
slowest of their answers (at least `SILENCE_FLOOR_S`) has not answered; `probe_timeout` stays the most it waits.
An agent answers from a thread of its own in milliseconds: a stopped one was found 0.5 s after its peers' stall,
waiting out probe_timeout, while its peers had answered in a few milliseconds. A host loaded enough to slow every
agent's answer slows the peers' too, and the wait grows with them.

The controller's own node can die or stop too. An agent whose workers failed probes the controller's agent; if
that is certainly gone (refused, or a newer agent answers: a timeout is no proof, since every failed member
probes it at once) it deposes it (`controller_lost`, its lease revoked), so a standby takes over at once instead
of when the lease ends. A stopped controller fails nobody's workers, it stalls them: while theirs are stalled,
the members of the lowest group ranks (`launcher.node.rules.watches_controller`, a few whatever the job's size)
probe it, with their own agent as its peer, and depose it if it does not answer in time (`probe_all`), the proof
the controller itself asks of a stall's suspects.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from launcher.rendezvous.records import NodeRecord

PEER_FACTOR = 5.0  # a suspect silent this many times as long as its slowest peer took to answer has not answered
SILENCE_FLOOR_S = 0.15  # never sooner: a live agent's answer waits for its process to be scheduled
MAX_PARALLEL_PROBES = 64


class LivenessServer:
    """Answers every connection on (addr, an ephemeral port) with `incarnation`, from its own thread."""

    def __init__(self, addr: str) -> None:
        # accept blocks (no periodic wake-up: a host running many simulated agents has as many of these threads);
        # stop() shuts the socket down, which wakes it
        self._socket = socket.create_server((addr, 0), family=_family(addr), backlog=64)
        self.port: int = self._socket.getsockname()[1]
        self.incarnation = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="liveness", daemon=True)

    def start(self) -> LivenessServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        try:
            self._socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # never started, or already shut
        self._thread.join(timeout=2)
        self._socket.close()

    def _serve(self) -> None:
        while not self._stopped.is_set():
            try:
                connection, _ = self._socket.accept()
            except OSError:
                return  # shut down by stop()
            with connection:
                try:
                    connection.sendall(f"{self.incarnation:x}\n".encode())
                except OSError:
                    pass  # the prober gave up: nothing to answer


@dataclass(frozen=True)
class Miss:
    """A probe that found no agent of the incarnation asked for."""

    reason: str
    # the agent is certainly gone (refused, or a newer agent answers): a timeout is not proof, since an
    # agent flooded with probes answers late too
    certain: bool
    # nothing came back within the timeout (not refused, not another incarnation): judged against the peers
    silent: bool = False


def probe(addr: str, port: int, incarnation: int, timeout: float) -> Miss | None:
    """None when the agent of `incarnation` answered within `timeout` seconds; otherwise why it did not."""
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((addr, port), timeout=timeout) as connection:
            connection.settimeout(max(deadline - time.monotonic(), 0.001))
            answer = connection.recv(64).strip().decode(errors="replace")
    except ConnectionRefusedError:
        return Miss("liveness probe refused: the agent is gone", certain=True)
    except TimeoutError:
        return Miss(f"no answer to a liveness probe within probe_timeout={timeout:g}s", certain=False, silent=True)
    except OSError as exc:
        return Miss(f"liveness probe failed: {exc.strerror or exc}", certain=False)
    if answer != f"{incarnation:x}":
        return Miss(f"liveness probe answered by another incarnation ({answer or 'nothing'})", certain=bool(answer))
    return None


def _family(addr: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in addr else socket.AF_INET


@dataclass(frozen=True)
class Target:
    """An agent to probe: where its liveness port is, and the incarnation that must answer."""

    addr: str
    port: int
    incarnation: int

    @classmethod
    def of(cls, record: NodeRecord) -> Target:
        """The agent a node's registration names."""
        return cls(record.addr, record.probe_port, record.lease)


def silence_deadline(answered_in: Sequence[float], waiting: int, timeout: float) -> float:
    """Seconds after the probes went out at which a suspect that has not answered counts as silent: `timeout`
    while a peer's answer is awaited (or none came), else `PEER_FACTOR` times the slowest peer's answer, at least
    `SILENCE_FLOOR_S`, at most `timeout`."""
    if waiting or not answered_in:
        return timeout
    return min(timeout, max(SILENCE_FLOOR_S, PEER_FACTOR * max(answered_in)))


def probe_all(suspects: dict[str, Target], peers: dict[str, Target], timeout: float) -> dict[str, Miss]:
    """Probe `suspects` and `peers` at once; the suspects that did not answer, by node. A suspect is not waited for
    past `silence_deadline` of the peers' answers, counted from when its own probe went out (one may wait for a
    free thread); a peer that missed its probe tells nothing and is left out."""
    if not suspects:
        return {}
    begun: dict[str, float] = {}  # node -> when its probe went out
    pool = ThreadPoolExecutor(max_workers=min(MAX_PARALLEL_PROBES, len(suspects) + len(peers)))
    pending: dict[Future[tuple[Miss | None, float]], str] = {
        pool.submit(_timed_probe, node, target, timeout, begun): node for node, target in {**peers, **suspects}.items()
    }
    try:
        misses: dict[str, Miss] = {}
        answered_in: list[float] = []
        silent: dict[str, float] = {}  # suspect -> how long it had been silent when it was judged so
        while True:
            now = time.monotonic()
            after = silence_deadline(answered_in, sum(node in peers for node in pending.values()), timeout)
            for node in pending.values():
                if node in suspects and node not in silent and node in begun and now - begun[node] >= after:
                    silent[node] = now - begun[node]
            awaited = {future: node for future, node in pending.items() if node not in silent}
            if not any(node in suspects for node in awaited.values()):
                break
            due = [begun[node] + after for node in awaited.values() if node in suspects and node in begun]
            done, _ = wait(awaited, timeout=max(0.0, min(due) - now) if due else None, return_when=FIRST_COMPLETED)
            for future in done:
                node = pending.pop(future)
                miss, took = future.result()
                if node in suspects and miss is not None:
                    if miss.silent:  # its own timeout fell due with the peers' deadline and woke us first
                        silent[node] = took
                    else:
                        misses[node] = miss
                elif node in peers and miss is None:
                    answered_in.append(took)
        for node, silent_for in silent.items():
            within = f"probe_timeout={timeout:g}s"
            if answered_in:
                within = (
                    f"{silent_for:.2f}s, while {len(answered_in)} other member(s) answered within "
                    f"{max(answered_in):.3f}s ({within})"
                )
            misses[node] = Miss(f"no answer to a liveness probe within {within}", certain=False, silent=True)
        return misses
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # a probe left running ends within its own timeout


def _timed_probe(node: str, target: Target, timeout: float, begun: dict[str, float]) -> tuple[Miss | None, float]:
    begun[node] = started = time.monotonic()
    miss = probe(target.addr, target.port, target.incarnation, timeout)
    return miss, time.monotonic() - started
