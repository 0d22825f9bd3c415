"""One host process of bench/rendezvous_bench.py: its share of the simulated agents as threads on a few etcd clients,
answering the coordinator's commands (start, kill, views, profile, stats, stop).

Imported only inside the spawned host processes (`rendezvous_bench.host_main`), where bench/ and the checkout are
already on sys.path.
"""

from __future__ import annotations

import collections
import dataclasses
import fcntl
import functools
import logging
import os
import queue
import signal
import struct
import sys
import termios
import threading
import time
import traceback
from multiprocessing.connection import Connection
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

import etcd_metrics
from grpc_wire import ConnectionEnded, GrpcConnection
from pyetcd import etcdrpc

from elastic.thread_frames import current_frames
from launcher.config import LaunchConfig, RendezvousSettings
from launcher.etcd import client as etcd_client
from launcher.etcd.errors import EtcdUnavailable
from launcher.etcd.lease_keeper import LeaseRoutes
from launcher.etcd.pyetcd_internals import HookedClient
from launcher.node.agent import Agent
from launcher.rendezvous.records import DrainReport, NodeRecord
from launcher.workers.group import WorkerOutcome


class AgentKilled(Exception):
    """Raised inside a killed agent's loop: its thread ends without the leave path."""


class HostState:
    """What the agents of one host did and when; reports a (kind, round) once every live agent has done it."""

    def __init__(self, index: int, events: Queue[tuple]) -> None:
        self.index = index
        self.events = events
        self.lock = threading.Lock()
        self.live = 0
        self.times: dict[tuple[str, int | None], list[float]] = collections.defaultdict(list)

    def note(self, kind: str, round_: int | None, when: float) -> None:
        with self.lock:
            times = self.times[(kind, round_)]
            times.append(when)
            if len(times) == self.live:
                self.events.put((kind, self.index, round_, len(times), max(times)))

    def anomaly(self, text: str) -> None:
        self.events.put(("anomaly", self.index, None, 0, text))


@dataclasses.dataclass
class Refresh:
    """One lease refresh through SharedKeepAlive, and when each part of its way happened (monotonic seconds)."""

    asked: float  # by its keeper
    sent: float | None = None  # on the connection (None: while no connection was open)
    received: float | None = None  # the answer, by the connection's reader
    response: Any = None
    abandoned: bool = False  # its keeper stopped waiting; the answer, when it comes, is dropped
    done: threading.Event = dataclasses.field(default_factory=threading.Event)


def keepalive_request(lease_id: int) -> bytes:
    return etcdrpc.LeaseKeepAliveRequest(ID=lease_id).SerializeToString()


class SharedKeepAlive:
    """Every lease refresh of a host's agents sent on ONE connection per etcd member, a LeaseKeepAlive stream per
    lease, framed by hand (`grpc_wire`) on a plain socket (a `KeepAliveLine` per member).

    The agent's LeaseKeeper refreshes through `launcher.etcd.client.LeaseRoutes.refresh`, which opens a new
    LeaseKeepAlive stream per refresh, and gRPC starts a Python thread to feed each stream: ~1.3 ms of host CPU per
    refresh, which is nothing for one agent per machine but 1.3 cores for 1024 agents packed on this 2-core machine,
    enough to starve the keepers and let leases expire. Even on long-lived gRPC streams a message costs 0.37 ms of
    host CPU (a consumer thread, the channel's spin thread and a response iterator wake for each); the `h2`
    package's frames cost 0.18 ms, and frames written by hand cost less again (see grpc_wire). With --keepalive
    shared this object stands in for the routes process-wide (as the no-op WorkerGroup stands in for the real
    one): the LeaseKeepers still refresh every keep_alive_interval under the same deadline, and etcd receives
    exactly what gRPC clients send, one LeaseKeepAliveRequest message per refresh on a LeaseKeepAlive stream of
    that agent's own; only the client-side transport is cheaper. `carried` counts the refreshes it sent, so the
    coordinator can tell when the agents' refreshes no longer come this way.

    A stream per lease, not one for the host: etcd's handler takes a stream's refreshes one after another
    (receive, renew, answer, then the next). While a round's acknowledgements were being applied, one shared
    stream made a host's 256 refreshes wait in line for seconds, and that host's agents lost their leases (the
    2,048-agent runs' "one host's agents never saw the round").

    The routes follow a real agent's, per lease, as if each agent had its own client: a lease refreshes through the
    member it uses; once a refresh there went unanswered, its next goes out through every member at once, and the
    first to answer becomes the lease's member. A real keeper does that with a thread per member (see
    launcher.etcd.lease_keeper), refreshing through the others every quarter interval while overdue; here the
    keeper sees one endpoint and stays on its own thread (a pool thread per refresh cost 0.4 more cores at 1,024
    agents, enough to lapse leases on 2 cores). Before, a host's refreshes all went through one member: refreshes
    a follower forwards wait for the leader's apply loop, and in a round's burst leases lapsed that a real keeper,
    sending through the leader too, would have kept.
    """

    def __init__(self, client, silence_s: float) -> None:
        self._members = list(client.endpoints)
        self._first = client.endpoint_label
        self.trail = RefreshTrail(silence_s / 3)
        self._lines = {member: KeepAliveLine(member, silence_s, self.trail) for member in self._members}
        self._in_use: dict[int, str] = {}  # lease -> the member it refreshes through (absent: the client's first)
        self._unanswered: set[int] = set()  # leases whose last refresh went unanswered: the next goes to every member
        threading.Thread(target=self.trail.run, name="refresh-trail", daemon=True).start()

    @property
    def carried(self) -> int:
        return sum(line.carried for line in self._lines.values())

    def endpoints(self, lease) -> list[str]:
        return [self._in_use.get(lease.id, self._first)]

    def prefer(self, lease, endpoint: str) -> None:
        raise AssertionError(f"a keeper with one endpoint never moves; asked to move to {endpoint}")

    def refresh(self, lease, deadline: float, endpoint: str) -> list:
        """What `launcher.etcd.client.LeaseRoutes.refresh` does: etcd's answers, or a transient error."""
        members = self._members if lease.id in self._unanswered else [endpoint]
        done = threading.Event()  # the first answer through any member
        asked = time.monotonic()
        sent = {member: Refresh(asked=asked, done=done) for member in members}
        self.trail.asked(lease.id, asked)
        for member, refresh in sent.items():
            self._lines[member].send(lease.id, refresh)
        answered = done.wait(deadline)
        for refresh in sent.values():
            # etcd answers a stream's refreshes in order: a late answer must not pass for the lease's next refresh
            refresh.abandoned = True
        first = next(((m, r) for m, r in sent.items() if r.response is not None), None) if answered else None
        if first is None:
            self._unanswered.add(lease.id)
            self.trail.timed_out()
            raise EtcdUnavailable(f"keep-alive through {', '.join(members)} not answered within {deadline:g} s")
        member, refresh = first
        self._unanswered.discard(lease.id)
        self._in_use[lease.id] = member
        self.trail.answered(refresh, time.monotonic())
        return [refresh.response]


class KeepAliveLine:
    """The refreshes SharedKeepAlive sends to one etcd member, on one connection. When it breaks, or says nothing
    for `silence_s` while refreshes wait (a member killed or cut off), it opens again to the same member and sends
    the refreshes still waiting; their keepers meanwhile send more through the other members."""

    def __init__(self, endpoint: str, silence_s: float, trail: RefreshTrail) -> None:
        self._endpoint = endpoint
        self._silence_s = silence_s
        self.trail = trail
        self._outbox: queue.SimpleQueue[tuple[int, Refresh]] = queue.SimpleQueue()  # asked for, not yet framed
        # guards the pending refreshes, the connection and its streams; never held across a call that lets the GIL
        # go, except on a connection no other thread sees yet: hundreds of keepers once queued on it behind a holder
        # waiting for the GIL, and refreshes went out 3.7 s after they were asked for
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # the writer's refreshes and the reader's acknowledgements, whole
        self._pending: dict[int, list[Refresh]] = collections.defaultdict(list)  # by lease, in the order sent
        self._connection: GrpcConnection | None = None
        self._streams: dict[int, int] = {}  # lease -> its stream on the connection
        self._leases: dict[int, int] = {}  # stream -> its lease
        self.carried = 0
        threading.Thread(target=self._run, name=f"keepalive-{endpoint}", daemon=True).start()
        threading.Thread(target=self._write, name=f"keepalive-writer-{endpoint}", daemon=True).start()

    def send(self, lease_id: int, refresh: Refresh) -> None:
        """Queue `refresh` of `lease_id` for the writer; its `done` is set once etcd's answer is in."""
        self._outbox.put((lease_id, refresh))

    def _write(self) -> None:
        """Frames and sends what the keepers asked for, everything asked meanwhile in one write."""
        while True:
            batch = [self._outbox.get()]
            while True:
                try:
                    batch.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            with self._lock:
                for lease_id, refresh in batch:
                    self._pending[lease_id].append(refresh)
                self.carried += len(batch)  # counted by this thread alone
                connection = self._connection
                if connection is None:
                    continue  # sent when the next connection opens
                data = b"".join(
                    self._refreshes(connection, lease_id, keepalive_request(lease_id)) for lease_id, _ in batch
                )
                now = time.monotonic()
                for _, refresh in batch:
                    refresh.sent = now
            self._send(connection, data)

    def _send(self, connection: GrpcConnection, data: bytes) -> None:
        try:
            with self._send_lock:
                connection.sock.sendall(data)
        except OSError:
            pass  # the reader sees the socket fail and opens another, which sends the pending refreshes again

    def _refreshes(self, connection: GrpcConnection, lease_id: int, message: bytes, count: int = 1) -> bytes:
        """`count` copies of `message` on `lease_id`'s stream of `connection`, opening the stream first if it has
        none there (called under the lock, so streams open in the order of their ids)."""
        stream = self._streams.get(lease_id)
        opening = b""
        if stream is None:
            stream, opening = connection.open_stream("/etcdserverpb.Lease/LeaseKeepAlive")
            self._streams[lease_id], self._leases[stream] = stream, lease_id
        return opening + connection.message(stream, message) * count

    def _run(self) -> None:
        while True:
            try:
                self._serve()
            except (OSError, ConnectionEnded) as exc:  # waiters time out and their keepers send more
                logging.getLogger(__name__).info("keep-alive connection to %s ended: %s", self._endpoint, exc)
            with self._lock:
                if self._connection is not None:
                    self._connection.sock.close()
                self._connection = None
                self._streams.clear()
                self._leases.clear()
            time.sleep(0.1)

    def _serve(self) -> None:
        connection = GrpcConnection.connect(self._endpoint, self._silence_s)
        with self._lock:
            # refreshes asked for while no connection was open, or sent on the one that ended: a gRPC client
            # queues a call while its channel connects, and fails one whose connection breaks at once (its
            # keeper then sends another); either way the refresh goes out now instead of waiting out its deadline
            now = time.monotonic()
            for queued in self._pending.values():  # what the connection that ended owed is lost with it
                queued[:] = [refresh for refresh in queued if not refresh.abandoned]
                for refresh in queued:
                    refresh.sent = now
            resent = b"".join(
                self._refreshes(connection, lease_id, keepalive_request(lease_id), len(queued))
                for lease_id, queued in self._pending.items()
                if queued
            )
            if resent:  # before the writer can see the connection: its streams open after these
                connection.sock.sendall(resent)
            self._connection = connection
        while True:
            try:
                data = connection.sock.recv(1 << 16)
            except TimeoutError:
                with self._lock:
                    waiting = any(self._pending.values())
                if waiting:
                    raise ConnectionEnded(f"no answer for {self._silence_s:g} s while refreshes waited") from None
                continue
            if not data:
                raise ConnectionEnded("etcd closed the connection")
            received_at = time.monotonic()
            self.trail.read(len(data), _queued_bytes(connection.sock))
            received, reply = connection.receive(data)  # the connection's reading half is this thread's alone
            responses = [etcdrpc.LeaseKeepAliveResponse.FromString(message) for _, message in received.messages]
            answered = []
            with self._lock:
                for response in responses:
                    owed = self._pending.get(response.ID)
                    if owed:
                        refresh = owed.pop(0)
                        if not refresh.abandoned:
                            refresh.received, refresh.response = received_at, response
                            answered.append(refresh)
                # a stream etcd ended: that lease's next refresh opens another
                for stream in received.ended:
                    lease_id = self._leases.pop(stream, None)
                    if lease_id is not None:
                        del self._streams[lease_id]
            if reply:
                self._send(connection, reply)  # settings and ping acknowledgements, the connection's window
            for refresh in answered:
                refresh.done.set()


def _queued_bytes(sock) -> int:
    """Bytes the kernel holds for `sock` that no recv has taken yet (SIOCINQ)."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]


class RefreshTrail:
    """Where a host's lease refreshes wait, logged once a second while any waited past a second, or a lease's
    keeper asked 1.5 intervals after its last refresh: refreshes answered and timed out; the longest wait from a
    keeper's ask until the refresh went out (the writer's turn), from then until the reader saw etcd's answer,
    and from then until the keeper woke (the host's threads short of CPU); the most bytes the kernel still held
    after a read (the reader behind) and the etcd revisions the answers carry (etcd fills it in as it takes the
    refresh up)."""

    SLOW_S = 1.0

    def __init__(self, interval: float) -> None:
        self._interval = interval
        self._lock = threading.Lock()
        self._last_asked: dict[int, float] = {}
        self._reset()

    def _reset(self) -> None:
        self.count = self.late = self.timeouts = self.reads = self.read_bytes = self.backlog = 0
        self.to_send = self.to_reader = self.to_keeper = self.gap = 0.0
        self.revisions: tuple[int, int] | None = None

    def answered(self, refresh: Refresh, woke_at: float) -> None:
        assert refresh.received is not None and refresh.sent is not None  # an answer comes only to what was sent
        revision = refresh.response.header.revision
        with self._lock:
            self.count += 1
            self.to_send = max(self.to_send, refresh.sent - refresh.asked)
            to_reader, to_keeper = refresh.received - refresh.sent, woke_at - refresh.received
            self.late += to_reader > self.SLOW_S or to_keeper > self.SLOW_S
            self.to_reader, self.to_keeper = max(self.to_reader, to_reader), max(self.to_keeper, to_keeper)
            low, high = self.revisions or (revision, revision)
            self.revisions = (min(low, revision), max(high, revision))

    def asked(self, lease_id: int, at: float) -> None:
        with self._lock:
            self.gap = max(self.gap, at - self._last_asked.get(lease_id, at))
            self._last_asked[lease_id] = at

    def timed_out(self) -> None:
        with self._lock:
            self.timeouts += 1

    def read(self, size: int, queued: int) -> None:
        with self._lock:
            self.reads += 1
            self.read_bytes += size
            self.backlog = max(self.backlog, queued)

    def run(self) -> None:
        log = logging.getLogger("refresh-trail")
        while True:
            time.sleep(1.0)
            with self._lock:
                if self.late or self.timeouts or self.gap > 1.5 * self._interval:
                    log.warning(
                        "refreshes: %d answered (%d late), %d timed out; longest gap between a lease's refreshes "
                        "%.2f s, asked to sent %.2f s, sent to the reader %.2f s, reader to keeper %.2f s; %d reads, "
                        "%d bytes, kernel backlog up to %d bytes; etcd revisions %s",
                        self.count,
                        self.late,
                        self.timeouts,
                        self.gap,
                        self.to_send,
                        self.to_reader,
                        self.to_keeper,
                        self.reads,
                        self.read_bytes,
                        self.backlog,
                        self.revisions,
                    )
                self._reset()


class OwnWatchStream:
    """The host's shared etcd client as one agent sees it, except that the agent's watches run on a watch stream of
    its own (another gRPC stream on the client's channel), as each real agent's client has: the calls are the
    client's own (pyetcd's watch methods, bound to this view), only the watcher differs.

    On one stream per client every `state/ctl/` event went to 256 watches at once, past the 128 responses etcd
    queues per stream, and half of them fell behind; etcd catches lagging watchers up under its store's lock,
    which every write and every lease refresh then waits for (docs/scaling.md). When the client moved to another
    member, the next watch created here opens its stream there."""

    add_watch_callback = HookedClient.add_watch_callback
    add_watch_prefix_callback = HookedClient.add_watch_prefix_callback
    cancel_watch = HookedClient.cancel_watch

    def __init__(self, client) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._watcher = None
        self._endpoint: str | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    @property
    def watcher(self):
        with self._lock:
            if self._watcher is None or self._endpoint != self._client.endpoint_label:
                stale, self._endpoint = self._watcher, self._client.endpoint_label
                self._watcher = self._client.get_watcher()
                if stale is not None:
                    stale.close()  # its watches end with an error, and their mirrors resume on the new stream
            return self._watcher


class NoopWorkerGroup:
    """The WorkerGroup interface without processes: RUNNING until the bench ends.

    The agent calls its worker-group factory as (config, round_, member, master, history, warm): bind `host` first.
    """

    def __init__(self, host: HostState, config, round_, member, master, history=None, warm=None) -> None:
        self.round, self.member, self.master = round_, member, master
        self.started_inprocess = self.started_prepared = 0
        self.processes: list = []
        host.note("workers", round_.round, time.time())

    def start(self, previous=None, standby=None) -> None:
        pass

    def stop_all_but_reentrant(self) -> None:
        pass  # no workers

    def poll(self):
        return WorkerOutcome.RUNNING, []

    def pids(self) -> list[int]:
        return []

    def next_look_at(self) -> None:
        return None  # no workers, nothing to look at

    def stall(self) -> None:
        return None  # no workers, never stalled

    def keep_pace(self) -> None:
        pass  # no workers, no pace

    def stop(self, signum: int = signal.SIGTERM) -> None:
        pass

    def request_drain(self, number: int, in_memory: bool = False) -> None:
        pass  # no workers to checkpoint

    def drain_answer(self, number: int) -> DrainReport:
        return DrainReport(number=number, step=None)  # what workers without a CheckpointManager answer

    def why_no_drain(self) -> None:
        return None

    def trains_under_elastic_run(self) -> bool:
        return False

    def reporting_hang(self) -> bool:
        return False

    def latest_step(self) -> None:
        return None  # no workers, no steps


class BenchAgent(Agent):
    """The real agent, plus timestamps at registration, round entry and acknowledgement, and a way to die."""

    def __init__(self, host: HostState, config: LaunchConfig, client, lease_routes: LeaseRoutes) -> None:
        super().__init__(
            config, client, worker_group=functools.partial(NoopWorkerGroup, host), lease_routes=lease_routes
        )
        self.host_state = host
        self.killed = False
        self.registrations = 0
        register, acknowledge = self.store.register, self.store.acknowledge

        def timed_register(record: NodeRecord) -> None:
            register(record)
            self.registrations += 1
            if self.registrations > 1:
                host.anomaly(f"{self.node_id} registered again (its lease ended): lease keep-alive fell behind")
                return
            host.note("registered", None, time.time())

        def timed_acknowledge(round_: int, *rest, **named) -> bool:
            committed = acknowledge(round_, *rest, **named)
            if committed:
                host.note("acked", round_, time.time())
            return committed

        # wraps the methods of this agent's own store object, so every caller in the agent goes through them
        self.store.register = timed_register  # type: ignore[method-assign]  # same signature, wrapped
        self.store.acknowledge = timed_acknowledge  # type: ignore[method-assign]  # JobStore.acknowledge, wrapped

    def enter_round(self, header, revision) -> None:
        super().enter_round(header, revision)
        assert self.run_ is not None  # set by the round just entered
        if self.run_.member is not None:
            self.host_state.note("entered", header.round, time.time())

    def step(self, view) -> None:
        if self.killed:
            raise AgentKilled(self.node_id)
        super().step(view)

    def sync_log(self) -> None:
        if not self.killed:  # a dead agent does not mirror the membership log
            super().sync_log()

    def die(self) -> float:
        """Stop refreshing the lease and end the loop without leaving; returns the time of death."""
        when = time.time()
        self.me.keeper.stop()
        self.killed = True
        self.mirror.poke()
        return when


class AgentThreads:
    """The host's agents, each on a thread of its own once started."""

    def __init__(self, host: HostState, agents: dict[str, BenchAgent]) -> None:
        self.host = host
        self.agents = agents

    def start(self, node: str) -> None:
        with self.host.lock:
            self.host.live += 1
        threading.Thread(target=self._run, args=(self.agents[node],), name=f"agent-{node}", daemon=True).start()

    def start_all_but(self, holdback: str, rate: float) -> None:
        """Every agent but the held-back one, `rate` per second (0: all at once)."""
        started_at = time.monotonic()
        for count, node in enumerate(n for n in self.agents if n != holdback):
            self.start(node)
            if rate > 0:
                delay = started_at + (count + 1) / rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)

    def views(self) -> dict:
        """What the host's live agents know, in brief: whether their watches are connected, the etcd revision
        each watch has reached, the round each is in and how far it got there. A host whose agents all missed a
        round shows here whether etcd's events never reached it (watches behind etcd's revision) or arrived and
        were not acted on."""
        live = [a for a in self.agents.values() if a.registrations and not a.killed]
        ctl = [a.mirror.revision for a in live]
        bucket = [a.bucket.mirror.revision for a in live]
        phases = collections.Counter(
            f"r{a.run_.round}:{a.run_.phase.name}" if a.run_ is not None else "no round" for a in live
        )
        return {
            "live": len(live),
            "ctl_connected": sum(a.mirror.connected for a in live),
            "ctl_revision": (min(ctl, default=0), max(ctl, default=0)),
            "bucket_connected": sum(a.bucket.mirror.connected for a in live),
            "bucket_revision": (min(bucket, default=0), max(bucket, default=0)),
            "phases": dict(phases.most_common(4)),
        }

    def kill(self, node: str) -> float:
        """The agent dies (see BenchAgent.die); returns the time of death."""
        with self.host.lock:
            self.host.live -= 1
        return self.agents[node].die()

    def _run(self, agent: BenchAgent) -> None:
        try:
            agent.run()
        except AgentKilled:
            pass
        except BaseException as exc:  # noqa: BLE001 - reported to the coordinator, never silent
            self.host.anomaly(f"{agent.node_id} crashed: {type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}")


def configure_process(log_dir: str, log_level: str) -> None:
    """Thread stacks, the agents' log records in <log_dir>/host.log, and every thread's stack on SIGUSR1."""
    threading.stack_size(2 << 20)
    logging.basicConfig(
        level=log_level,
        filename=os.path.join(log_dir, "host.log"),
        format="%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s",
    )
    signal.signal(signal.SIGUSR1, functools.partial(dump_stacks, log_dir))


def dump_stacks(log_dir: str, signum: int | None = None, frame: Any = None) -> None:
    # the coordinator sends SIGUSR1 when a phase times out: every thread's stack lands in host<i>/stacks.txt
    names = {t.ident: t.name for t in threading.enumerate()}
    with open(os.path.join(log_dir, "stacks.txt"), "w") as out:
        for ident, frame_ in current_frames().items():
            out.write(f"\n--- {names.get(ident, ident)}\n{''.join(traceback.format_stack(frame_))}")


def build_agents(spec: dict, host: HostState, clients: list, lease_routes: LeaseRoutes) -> dict[str, BenchAgent]:
    """One BenchAgent per node of this host, in the spec's order (the order they start in), each run of
    agents_per_client of them on one of `clients`."""
    # --nnodes N-1:N with a last call of an hour: round 0 forms the moment the N-th agent registers (MAX reached),
    # and a loss re-forms at once with N-1 (MIN is met); --nnodes N:N could never re-form after a loss. A lower
    # MIN would let a round form without an agent whose lease lapsed, and its new incarnation would then wait
    # out the hour's last call (see rendezvous_bench's docstring).
    rdzv = RendezvousSettings(
        keep_alive_interval=spec["keep_alive_interval"],
        keep_alive_max_attempt=spec["lease_attempts"],
        last_call_timeout=3600,
        join_timeout=3600,
        close_timeout=3600,
    )
    agents: dict[str, BenchAgent] = {}
    for index, node in enumerate(spec["nodes"]):
        config = LaunchConfig(
            min_nodes=max(1, spec["n"] - 1),
            max_nodes=spec["n"],
            nproc_per_node=1,
            rdzv_endpoint=spec["endpoint"],
            rdzv_id=spec["rdzv_id"],
            rdzv=rdzv,
            monitor_interval=5.0,
            log_dir=Path(spec["log_dir"]),
            local_addr="127.0.0.1",
            node_id=node,
            entrypoint="noop-worker",
            warm_workers=False,  # no-op workers: a warm interpreter per simulated agent would import torch N times
        )
        client = clients[index // spec["agents_per_client"]]
        if spec["watch_stream"] == "agent":
            client = OwnWatchStream(client)
        agents[node] = BenchAgent(host, config, client, lease_routes)
    return agents


def process_stats(shared: SharedKeepAlive | None) -> dict:
    return {
        "threads": threading.active_count(),
        "os_threads": etcd_metrics.process_threads(os.getpid()),
        "cpu_s": etcd_metrics.process_cpu_seconds(os.getpid()),
        "rss_mib": _rss_mib(),
        "shared_refreshes": shared.carried if shared is not None else 0,
    }


def _rss_mib() -> float:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def profile(action: str, log_dir: str) -> str | None:
    """yappi's CPU profile of every thread of this host: "start", then "stop", which writes the functions by their
    own CPU time to <log_dir>/yappi.txt and returns the path."""
    import yappi  # only with --yappi

    if action == "start":
        yappi.set_clock_type("cpu")
        yappi.start(builtins=False)
        return None
    yappi.stop()
    path = os.path.join(log_dir, "yappi.txt")
    with open(path, "w") as out:
        stats = yappi.get_func_stats()
        stats.sort("tsub", "desc")
        stats.print_all(
            out=out, columns={0: ("name", 90), 1: ("ncall", 10), 2: ("tsub", 8), 3: ("ttot", 8), 4: ("tavg", 8)}
        )
    yappi.clear_stats()
    return path


def serve(
    conn: Connection, deadline: float, agents: AgentThreads, shared: SharedKeepAlive | None, log_dir: str
) -> None:
    """Answer the coordinator's commands until it says stop, goes away, or the host's deadline passes."""
    while time.monotonic() < deadline:
        if not conn.poll(1.0):
            if os.getppid() == 1:
                break  # the coordinator is gone
            continue
        command, *rest = conn.recv()
        if command == "start":
            agents.start(rest[0])
            conn.send(("started", time.time()))
        elif command == "kill":
            conn.send(("killed", agents.kill(rest[0])))
        elif command == "views":
            conn.send(("views", agents.views()))
        elif command == "profile":
            conn.send(("profile", profile(rest[0], log_dir)))
        elif command == "stats":
            conn.send(("stats", process_stats(shared)))
        elif command == "stop":
            conn.send(("stopping", None))
            break


# Every thread waiting for the GIL wakes each switch interval (5 ms by default) to ask for it: with hundreds of a
# host's agents woken at once by a round, that is tens of thousands of wake-ups a second, most of the CPU spent in
# the kernel, and etcd's few threads starved. One agent per host has no such crowd.
SWITCH_INTERVAL_S = 0.02


def main(index: int, spec: dict, conn: Connection, events: Queue[tuple]) -> None:
    """Entry point of one host process: runs its agents and answers the coordinator's commands, then exits."""
    configure_process(spec["log_dir"], spec["log_level"])
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    deadline = time.monotonic() + spec["host_deadline_s"]
    host = HostState(index, events)
    per_client = spec["agents_per_client"]
    clients = [etcd_client.connect(spec["endpoint"]) for _ in range(0, len(spec["nodes"]), per_client)]
    client = clients[0]
    shared = None
    lease_routes: LeaseRoutes = etcd_client.LEASE_ROUTES
    if spec["keepalive"] == "shared":
        # every agent of this host process is simulated, so the shared stream stands in for its refreshes
        shared = SharedKeepAlive(client, silence_s=3 * spec["keep_alive_interval"])
        lease_routes = shared
    agents = AgentThreads(host, build_agents(spec, host, clients, lease_routes))
    agents.start_all_but(spec["holdback"], spec["start_rate"])
    serve(conn, deadline, agents, shared, spec["log_dir"])
    os._exit(0)  # the agents' threads are daemons; the job is thrown away with its etcd
