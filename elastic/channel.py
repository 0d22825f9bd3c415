"""Progress heartbeats: tell the node's elastic-run agent that this worker is still making progress.

    import elastic

    for step in range(start, steps):
        train_step(...)
        elastic.heartbeat(step)                    # once per step: a few microseconds, no etcd, no syscall

    with elastic.long_operation("checkpoint load"):  # may take long: its own, larger allowance
        manager.load_latest(state)

The channel is a small shared-memory file per worker that the agent creates in the worker's log directory and
names in `ELASTIC_HEARTBEAT_FILE` (see `launcher.workers.watchdog`). Without that variable (plain `python`, torchrun)
every call here is a no-op; with `--watchdog-timeout off` the agent judges no silence. A script that never
calls `heartbeat` is never watched; once it has, a worker that stays silent longer than its allowance is taken
for hung: the agent sends `DUMP_SIGNAL`, on which this module has `faulthandler` write every thread's Python
stack to `STACKS_FILE` beside the channel, and kills the worker's process group a moment later. The agent reads
the dump there whatever --redirects says (where the main thread sat tells a hung worker from one that waited on
a peer) and copies it to where the worker's stderr goes.

Interpreter shutdown runs inside `long_operation("interpreter exit")` (an atexit hook), so a slow exit is not
taken for a hang; what a script does between its last heartbeat and its end is its own to mark.

The worker opens the channel when it imports this module (so before it forks anything) and owns it from then
on (an exclusive `flock`): a process it forks (a DataLoader worker) shares the mapping but its calls are no-ops
(the owner's pid is checked), and a process it starts with the same environment (a subprocess, a spawned
DataLoader worker) finds the lock taken and stays silent, so only the worker itself ever counts as progress.

Layout (little-endian, `SIZE` bytes; the writer bumps `seq` to odd before a change and to even after, a seqlock):

| offset | field        | type      | meaning                                                               |
|--------|--------------|-----------|-----------------------------------------------------------------------|
| 0      | magic        | 4s        | `MAGIC` (written by the agent)                                        |
| 4      | version      | u32       | `VERSION` (written by the agent; a worker with another layout stays silent) |
| 8      | pid          | u32       | the worker that owns the channel                                      |
| 12     | dump_signal  | i32       | the signal that dumps its stacks (0: faulthandler could not register) |
| 16     | seq          | u64       | changes on every heartbeat and every long-operation begin/end         |
| 24     | beats        | u64       | heartbeats so far                                                     |
| 32     | last_step    | i64       | the last `step` passed to heartbeat (`NO_STEP`: none)                 |
| 40     | last_beat    | f64       | CLOCK_MONOTONIC of the last heartbeat (informational)                 |
| 48     | op_depth     | u32       | long operations in progress (nested or in several threads)            |
| 56     | ring_total   | u64       | step intervals recorded so far                                        |
| 64     | op_timeout   | f64       | largest `timeout=` of operations in progress (NaN: default; inf: none) |
| 72     | op_started   | f64       | CLOCK_MONOTONIC when the outermost one began (informational)          |
| 80     | op_name      | 48s       | its name, UTF-8, NUL-padded                                           |
| 128    | ring         | f64 x 100 | last `WINDOW` step intervals (less long operations), ring order      |
| 928    | drain_request| u64       | written by the agent: the drain it asks for (0: none), see below      |
| 936    | drain_done   | u64       | the last drain this worker committed a checkpoint for                 |
| 944    | drain_step   | i64       | that checkpoint's step                                                |
| 952    | drainable    | u32       | 1 once a `CheckpointManager` that answers drains runs in this worker  |
| 956    | inprocess    | u32       | 1 once the worker runs under `elastic.run`: it takes new rounds in process |
| 960    | drain_memory | u32       | by the agent, before `drain_request`: 1 if a snapshot in memory answers it |

The channel also carries drains (the worker's side is `elastic.checkpoint.drain`, the agent's
`launcher.node.round_workers`): before a planned change (a node joining, an agent told to stop) the agent writes a
drain number into `drain_request`; `CheckpointManager.should_save` sees it, the ranks agree on the step, save and
commit (into memory alone where `drain_memory` says so and snapshots in memory are on), and each writes the number
into `drain_done`, then waits at the step boundary until the request is withdrawn or the round ends.
"""

from __future__ import annotations

import atexit
import errno
import faulthandler
import fcntl
import math
import mmap
import os
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

HEARTBEAT_ENV = "ELASTIC_HEARTBEAT_FILE"
# where `ring_agent` wakes the agent: `@name`, a datagram socket in Linux's abstract namespace
# (`launcher.workers.wakeups`)
AGENT_DOORBELL_ENV = "ELASTIC_AGENT_DOORBELL"
STACKS_FILE = "stacks.log"  # beside the channel: where a hung worker's stack dump goes
MAGIC = b"EHB1"
VERSION = 1
SIZE = 1024
WINDOW = 100  # intervals kept: "the slowest of the last 100 steps"
NO_STEP = -(2**63)
NAME_BYTES = 48
# A real-time signal nobody installs a handler for (SIGUSR1/2 are taken by SLURM integrations such as
# Lightning's and submitit's requeue handlers); the number in use is written into the channel for the agent.
DUMP_SIGNAL = signal.SIGRTMIN + 4 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR1

_HEADER = struct.Struct("<4sI")
_PID_SIGNAL = struct.Struct("<Ii")
_U64 = struct.Struct("<Q")
_BEAT = struct.Struct("<Qqd")  # beats, last_step, last_beat at offset 24
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_OP = struct.Struct("<dd48s")  # op_timeout, op_started, op_name at offset 64
_RING = struct.Struct(f"<{WINDOW}d")
_SNAPSHOT = struct.Struct(f"<4sIIiQQqdI4xQdd48s{WINDOW}d")
OFF_PID, OFF_SEQ, OFF_BEAT, OFF_DEPTH, OFF_RING_TOTAL, OFF_OP, OFF_RING = 8, 16, 24, 48, 56, 64, 128
OFF_DRAIN_REQUEST, OFF_DRAIN_DONE, OFF_DRAINABLE, OFF_INPROCESS, OFF_DRAIN_MEMORY = 928, 936, 952, 956, 960
_DRAIN_DONE = struct.Struct("<Qq")  # drain_done, drain_step
assert _SNAPSHOT.size == OFF_RING + _RING.size == OFF_DRAIN_REQUEST and OFF_DRAIN_MEMORY + _U32.size <= SIZE


def create_channel(path: os.PathLike | str) -> None:
    """The agent's side: a fresh, zeroed channel file (a new inode: nothing of an earlier worker can leak in)."""
    path = os.fspath(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    blank = bytearray(SIZE)
    _HEADER.pack_into(blank, 0, MAGIC, VERSION)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, bytes(blank))
    finally:
        os.close(fd)


def request_drain(path: os.PathLike | str, number: int, in_memory: bool = False) -> None:
    """The agent's side: ask the worker of the channel at `path` for drain `number` (0 withdraws the request),
    answered by a snapshot in memory alone if `in_memory`."""
    fd = os.open(os.fspath(path), os.O_WRONLY)
    try:
        os.pwrite(fd, _U32.pack(int(in_memory)), OFF_DRAIN_MEMORY)  # first: the number makes the request
        os.pwrite(fd, _U64.pack(number), OFF_DRAIN_REQUEST)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class DrainState:
    """What a worker said of drains, read from its channel by the agent."""

    drainable: bool
    done: int
    step: int | None


def read_owner(view) -> int:
    """The pid of the worker that opened the channel (0: none yet)."""
    return _PID_SIGNAL.unpack_from(view, OFF_PID)[0]


def read_inprocess(view) -> bool:
    """Whether the worker takes new rounds in process (it runs under `elastic.run`)."""
    return bool(_U32.unpack_from(view, OFF_INPROCESS)[0])


def read_drain(view) -> DrainState:
    done, step = _DRAIN_DONE.unpack_from(view, OFF_DRAIN_DONE)
    return DrainState(bool(_U32.unpack_from(view, OFF_DRAINABLE)[0]), done, step if done else None)


@dataclass(frozen=True)
class LongOp:
    name: str
    timeout: float | None  # None: the agent's --watchdog-long-op


@dataclass(frozen=True)
class Snapshot:
    """One read of a worker's channel."""

    pid: int
    dump_signal: int
    seq: int
    beats: int
    last_step: int | None
    intervals: tuple[float, ...]  # oldest first, at most WINDOW
    long_op: LongOp | None


def parse(raw: bytes) -> Snapshot | None:
    """A snapshot from the channel's bytes; None when they are not a channel of this layout."""
    if len(raw) < _SNAPSHOT.size:
        return None
    (
        magic,
        version,
        pid,
        dump_signal,
        seq,
        beats,
        last_step,
        _last_beat,
        depth,
        total,
        op_timeout,
        _op_started,
        op_name,
        *ring,
    ) = _SNAPSHOT.unpack_from(raw)
    if magic != MAGIC or version != VERSION:
        return None
    count = min(total, WINDOW)
    intervals = tuple(ring[(total - count + i) % WINDOW] for i in range(count))
    long_op = None
    if depth:
        name = op_name.rstrip(b"\0").decode(errors="replace")
        long_op = LongOp(name, None if math.isnan(op_timeout) else op_timeout)
    return Snapshot(
        pid=pid,
        dump_signal=dump_signal,
        seq=seq,
        beats=beats,
        last_step=None if last_step == NO_STEP or not beats else last_step,  # a blank channel is all zeros
        intervals=intervals,
        long_op=long_op,
    )


def read_seq(view) -> int:
    """The channel's change counter alone: what the agent looks at on every poll."""
    return _U64.unpack_from(view, OFF_SEQ)[0]


def read_beats(view) -> int:
    """The heartbeats the worker sent on this channel (a counter that only grows: no torn read misleads)."""
    return _U64.unpack_from(view, OFF_BEAT)[0]


def read(view) -> Snapshot | None:
    """A consistent snapshot of a mapped channel (seqlock); a torn one after a few tries: `seq` still tells."""
    raw = b""
    for _ in range(4):
        raw = bytes(view[: _SNAPSHOT.size])
        seq = _U64.unpack_from(raw, OFF_SEQ)[0]
        if seq % 2 == 0 and _U64.unpack_from(view, OFF_SEQ)[0] == seq:
            break
    return parse(raw)


class Channel:
    """The worker's end of one channel (the owner process only; thread-safe)."""

    def __init__(self, fd: int, view: mmap.mmap, clock=time.monotonic) -> None:
        self._fd = fd  # kept open: it holds the flock that makes this process the owner
        self._stacks_fd: int | None = None  # the dump's file, while faulthandler writes there
        self._view = view
        self._clock = clock
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._seq = _U64.unpack_from(view, OFF_SEQ)[0] & ~1
        self._beats = 0
        self._last_beat: float | None = None
        self._ops: dict[int, tuple[str, float | None]] = {}  # token -> (name, timeout), oldest first
        self._tokens = 0
        self._op_began = 0.0  # when the outermost long operation in progress began (or the last heartbeat in it)
        self._op_time = 0.0  # seconds inside long operations since the last heartbeat: not part of a step
        self._ring_total = 0
        self._last_step = NO_STEP
        _PID_SIGNAL.pack_into(view, OFF_PID, self._pid, 0)

    def close(self) -> None:
        """Give the channel up (its lock too); later calls on this object do nothing."""
        self._pid = -1
        self._view.close()
        os.close(self._fd)
        if self._stacks_fd is not None:
            faulthandler.unregister(DUMP_SIGNAL)  # before its file closes: the number may be reused
            os.close(self._stacks_fd)

    def register_dump(self, stacks_path: str) -> None:
        """Have `DUMP_SIGNAL` write every thread's stack to `stacks_path`, and tell the agent it does."""
        fd = os.open(stacks_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        try:
            faulthandler.register(DUMP_SIGNAL, file=fd, all_threads=True, chain=False)
        except (ValueError, RuntimeError):
            os.close(fd)
            raise
        self._stacks_fd = fd
        _PID_SIGNAL.pack_into(self._view, OFF_PID, self._pid, int(DUMP_SIGNAL))

    def _begin_write(self) -> None:
        self._seq += 1
        _U64.pack_into(self._view, OFF_SEQ, self._seq)

    def _end_write(self) -> None:
        self._seq += 1
        _U64.pack_into(self._view, OFF_SEQ, self._seq)

    def beat(self, step: int | None) -> None:
        if os.getpid() != self._pid:
            return  # a forked child (a DataLoader worker): only the worker itself makes progress
        now = self._clock()
        with self._lock:
            view = self._view
            self._begin_write()
            inside = self._op_time + (now - self._op_began if self._ops else 0.0)
            if self._last_beat is not None:  # the step's interval: the time since the last one, less long operations
                interval = max(0.0, now - self._last_beat - inside)
                _F64.pack_into(view, OFF_RING + 8 * (self._ring_total % WINDOW), interval)
                self._ring_total += 1
                _U64.pack_into(view, OFF_RING_TOTAL, self._ring_total)
            self._op_time, self._op_began = 0.0, now
            self._last_beat = now
            self._beats += 1
            if step is not None:
                self._last_step = int(step)
            _BEAT.pack_into(view, OFF_BEAT, self._beats, self._last_step, now)
            self._end_write()

    def begin(self, name: str, timeout: float | None) -> int | None:
        """A long operation began; the token that ends it."""
        if os.getpid() != self._pid:
            return None
        now = self._clock()
        with self._lock:
            self._tokens += 1
            self._ops[self._tokens] = (name, timeout)
            if len(self._ops) == 1:
                self._op_began = now
            self._write_ops(started=len(self._ops) == 1)
            return self._tokens

    def end(self, token: int | None) -> None:
        if os.getpid() != self._pid or token is None:
            return
        now = self._clock()
        with self._lock:
            if self._ops.pop(token, None) is None:
                return
            if not self._ops:
                self._op_time += now - self._op_began
            self._write_ops(started=False)

    def drain_requested(self) -> int:
        if self._pid == -1:
            return 0  # given up for a new round's channel: that one carries the drains now
        return _U64.unpack_from(self._view, OFF_DRAIN_REQUEST)[0]

    def drain_in_memory(self) -> bool:
        """Whether a snapshot in memory answers the drain requested (read after `drain_requested`)."""
        return self._pid != -1 and bool(_U32.unpack_from(self._view, OFF_DRAIN_MEMORY)[0])

    def set_drainable(self) -> None:
        if os.getpid() == self._pid:
            _U32.pack_into(self._view, OFF_DRAINABLE, 1)

    def set_inprocess(self) -> None:
        if os.getpid() == self._pid:
            _U32.pack_into(self._view, OFF_INPROCESS, 1)

    def report_drained(self, number: int, step: int) -> None:
        if os.getpid() == self._pid:
            _I64.pack_into(self._view, OFF_DRAIN_DONE + 8, step)  # the step first: the number makes it count
            _U64.pack_into(self._view, OFF_DRAIN_DONE, number)
            ring_agent()  # the agent answers the controller with it: the planned change waits on that

    def _write_ops(self, started: bool) -> None:
        view = self._view
        self._begin_write()
        if self._ops:
            timeouts = [t for _, t in self._ops.values() if t is not None]
            timeout = max(timeouts) if timeouts else math.nan
            name = next(iter(self._ops.values()))[0].encode()[:NAME_BYTES]
            op_started = self._op_began if started else _F64.unpack_from(view, OFF_OP + 8)[0]
            _OP.pack_into(view, OFF_OP, timeout, op_started, name)
        _U32.pack_into(view, OFF_DEPTH, len(self._ops))
        self._end_write()


class _Disabled:
    """No channel: every call is a no-op."""

    def beat(self, step: int | None) -> None:
        pass

    def begin(self, name: str, timeout: float | None) -> None:
        return None

    def end(self, token: int | None) -> None:
        pass

    def drain_requested(self) -> int:
        return 0

    def drain_in_memory(self) -> bool:
        return False

    def set_drainable(self) -> None:
        pass

    def set_inprocess(self) -> None:
        pass

    def report_drained(self, number: int, step: int) -> None:
        pass


_DISABLED = _Disabled()
_channel: Channel | _Disabled | None = None  # None: not looked up yet
_open_lock = threading.Lock()
# set by `elastic.rounds.run`: raises `RoundChanged` at the step boundary once the agent offered a new round
round_check: Callable[[], None] | None = None


def open_channel(path: str | None, clock=time.monotonic, install_hooks: bool = True) -> Channel | _Disabled:
    """The channel at `path`, owned by this process; the no-op channel when there is none to own.

    `install_hooks`: register the stack dump with faulthandler and the interpreter-exit long operation."""
    if not path:
        return _DISABLED
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return _DISABLED  # this is not an elastic-run worker
    try:
        if os.fstat(fd).st_size != SIZE:
            raise OSError(errno.EINVAL, "not a heartbeat channel")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise  # another process (the worker that started us) owns it
            # a filesystem without flock: go on without the ownership check
        view = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        if _HEADER.unpack_from(view, 0) != (MAGIC, VERSION):
            view.close()
            raise OSError(errno.EINVAL, "heartbeat channel of another version")
    except OSError:
        os.close(fd)
        return _DISABLED
    channel = Channel(fd, view, clock)
    if install_hooks:
        # interpreter shutdown (atexit handlers, module teardown, torch's own) comes after the last heartbeat:
        # it gets a long operation's allowance, so a slow exit is not taken for a hang, and a hung one still is
        atexit.register(channel.begin, "interpreter exit", None)  # never ended: the process is going
        try:
            channel.register_dump(os.path.join(os.path.dirname(path), STACKS_FILE))
        except (OSError, ValueError, RuntimeError):
            pass  # the agent then kills without a dump
    return channel


def _current() -> Channel | _Disabled:
    global _channel
    with _open_lock:
        if _channel is None:
            _channel = open_channel(os.environ.get(HEARTBEAT_ENV))
        return _channel


def reopen() -> Channel | _Disabled:
    """Give up this worker's channel and own the one `ELASTIC_HEARTBEAT_FILE` names now (a new round's)."""
    global _channel
    with _open_lock:
        if isinstance(_channel, Channel):
            _channel.close()
        _channel = open_channel(os.environ.get(HEARTBEAT_ENV))
        return _channel


def heartbeat(step: int | None = None) -> None:
    """This worker made progress (call once per training step); `step` shows in the log if it is found hung.

    A no-op outside elastic-run and in a forked child; unjudged with `--watchdog-timeout off`. Under
    `elastic.run`, it raises `elastic.RoundChanged` once the agent has handed this worker a new round.
    """
    channel = _channel
    if channel is None:
        channel = _current()
    channel.beat(step)
    if round_check is not None:
        round_check()


def drain_channel() -> Channel | _Disabled:
    """This worker's channel, for `elastic.checkpoint`'s drains (the no-op one outside elastic-run)."""
    return _channel if _channel is not None else _current()


def socket_address(name: str) -> str:
    """The `socket` address of a doorbell name: `@name` is `name` in the abstract namespace."""
    return "\0" + name[1:] if name.startswith("@") else name


def ring_agent() -> None:
    """Wake this worker's agent now instead of at its next poll (--monitor-interval): something it acts on
    happened here and no exit shows it (main raised, a drain committed). Never blocks or raises; a no-op outside
    elastic-run."""
    name = os.environ.get(AGENT_DOORBELL_ENV)
    if not name:
        return
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC) as bell:
            bell.sendto(b"!", socket_address(name))
    except OSError:
        pass  # no agent listens (it is gone, or polls instead), or its queue is full of rings already


class long_operation:
    """`with long_operation("checkpoint load"):` marks a phase that may legitimately take long.

    While it runs, the worker's allowance is the larger of its normal one and `timeout` seconds (default: the
    agent's `--watchdog-long-op`, 30 minutes; `math.inf`: not watched meanwhile). Its begin and end count as
    signs of life, and the time inside it is not counted in the step interval it falls in. It nests,
    may run in any thread, and works as a decorator too. A no-op where `heartbeat` is one.
    """

    def __init__(self, name: str, timeout: float | None = None) -> None:
        if timeout is not None and not timeout > 0:
            raise ValueError(f"long_operation timeout must be positive seconds (or math.inf), not {timeout!r}")
        self.name = name
        self.timeout = None if timeout is None else float(timeout)
        self._tokens: list = []  # one per entry in progress: the same object may be entered again, nested

    def __enter__(self) -> long_operation:
        channel = _channel if _channel is not None else _current()
        self._tokens.append((channel, channel.begin(self.name, self.timeout)))
        return self

    def __exit__(self, *exc_info) -> None:
        channel, token = self._tokens.pop()
        channel.end(token)

    def __call__(self, function):
        import functools

        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            with long_operation(self.name, self.timeout):
                return function(*args, **kwargs)

        return wrapper


if os.environ.get(HEARTBEAT_ENV):
    try:
        _current()  # own the channel now, before the worker forks or spawns anything
    except Exception:  # pragma: no cover - never let a heartbeat channel break an import
        _channel = _DISABLED
