"""Ending a round in a worker that goes on to the next: its process groups aborted (a collective blocked on a peer
that will never answer returns) and destroyed, and DTensor's caches of the round's device meshes dropped.

gloo has no working abort: `ProcessGroupGloo.abort()` returns at once but leaves a pending `all_reduce` blocked
until the peer's process exits (30 s later in a test on torch 2.13). Shutting down the group's TCP connections
does unblock it: the collective raises ("Connection closed by peer") and `destroy_process_group()` works
afterwards (its listening socket must stay as it is: shut down, gloo's accept loop aborts the process). Only
the group's own connections are shut down, never the user's: the sockets that appear while
torch builds a process group (`_new_process_group_helper`, which `init_process_group` and `new_group` both call;
gloo connects its full mesh there) are remembered by descriptor and inode. NCCL and other backends are aborted
with torch's own `_abort_process_group`. A set-up still in progress (a peer stopped before it joined, so the others
wait in a store read or a connect) has its connections shut down too: those opened since it began; and so has
the connection of `init_process_group`'s store, in which every later group's set-up reads its peers' addresses
(a set-up whose store's host was stopped waits there, on none of its own). Making that store's client is the one
set-up no shutdown ends (TCPStore retries the connection): `connecting_to_store` says when a worker is there.
"""

from __future__ import annotations

import functools
import logging
import os
import select
import socket
import stat
import sys
import threading
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

logger = logging.getLogger(__name__)

_lock = threading.Lock()
# (descriptor, inode) of the connections opened while a group was built (its listening socket is left out: shut
# down, one makes gloo's accept loop fail, and its thread aborts the process)
_group_connections: set[tuple[int, int]] = set()
_connections_of_group: dict[int, set[tuple[int, int]]] = {}  # id(group) -> the part of them it opened
# the connections init_process_group's store opened: every later group's set-up reads its peers' addresses there,
# and one whose store stopped answering (its host stopped) waits in that read, on no connection of its own
_store_connections: set[tuple[int, int]] = set()
# the sockets open when the group being set up now began (its store's connection included); None: none is. A peer
# stopped before it joined holds the others inside the set-up, in a store read or a connect, where no connection
# of a group is known yet
_setting_up_since: dict[int, int] | None = None
_connecting = False  # init_process_group is inside torch's rendezvous, making its store's client
_installed = False
_aborts = 0  # abort_all calls so far


class GroupsAborted(RuntimeError):
    """What a collective gave may be garbage: this process aborted its groups while it ran (a RuntimeError, as
    torch.distributed's errors are, so that `elastic.run` waits for the next round)."""


def aborts() -> int:
    """How many times this process aborted its groups. An NCCL collective that an abort ends returns without error,
    its output holding whatever the buffer held (measured on an H100, torch 2.11, NCCL 2.28.9); the collectives
    after it raise. A result gathered while this number changed must not be committed (`check_not_aborted`)."""
    return _aborts


def check_not_aborted(since: int, what: str) -> None:
    """Raise `GroupsAborted` if the groups were aborted after `aborts()` returned `since`."""
    if _aborts != since:
        raise GroupsAborted(
            f"{what}: not committed, since this process's groups were aborted for a new round meanwhile (a "
            "collective the abort ended may have returned without error)"
        )


def _socket_inodes() -> dict[int, int]:
    """This process's open socket descriptors and their inodes."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            info = os.stat(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor among them)
        if stat.S_ISSOCK(info.st_mode):
            found[int(name)] = info.st_ino
    return found


def track_group_sockets() -> None:
    """From now on, remember the sockets each new process group opens (idempotent)."""
    global _installed
    with _lock:
        if _installed or not hasattr(c10d, "_new_process_group_helper"):
            return
        build, rendezvous = c10d._new_process_group_helper, c10d.rendezvous

        @functools.wraps(rendezvous)
        def rendezvous_and_remember(*args, **kwargs):
            before, since = _socket_inodes(), _aborts
            _begin_setup(before)  # init_process_group: its store's connection comes before the group
            try:
                for found in _connecting_to_store(rendezvous(*args, **kwargs)):
                    opened = _clients_of(found[0], _connections_since(before))
                    with _lock:
                        _store_connections.update(opened)
                    if _aborts != since:  # a retry reached the store after the abort: the round's peers left
                        raise GroupsAborted(
                            "init_process_group: its store answered only after this process's groups were aborted "
                            "for a new round, whose peers are elsewhere"
                        )
                    yield found
            except BaseException:
                _end_setup()  # no group follows
                raise

        @functools.wraps(build)
        def build_and_remember(*args, **kwargs):
            before = _socket_inodes()
            _begin_setup(before)
            built = None
            try:
                built = build(*args, **kwargs)
                return built
            finally:
                opened = _connections_since(before)
                _end_setup()
                with _lock:
                    _group_connections.update(opened)
                    if isinstance(built, tuple) and isinstance(built[0], dist.ProcessGroup):
                        _connections_of_group[id(built[0])] = opened

        c10d._new_process_group_helper = build_and_remember
        c10d.rendezvous = rendezvous_and_remember
        _installed = True


def _connecting_to_store(found_stores: Iterator[tuple]) -> Iterator[tuple]:
    """`found_stores`, with `connecting_to_store()` true while the next is being made."""
    global _connecting
    while True:
        _connecting = True
        try:
            found = next(found_stores, None)
        finally:
            _connecting = False
        if found is None:
            return
        yield found


def connecting_to_store() -> bool:
    """Whether init_process_group is connecting to its store. A TCPStore client retries a failed connection until
    the set-up's timeout (30 minutes by default), whatever the abort shut down: a round's store whose host was
    stopped holds its peers there, answering their connects from its listen queue but never their handshake."""
    return _connecting


def _clients_of(store: object, connections: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """Those of `connections` that reach `store` (a rank that serves the store itself also holds the connections
    it accepted from its peers: those are theirs to shut)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    port = getattr(store, "port", None)
    if port is None:
        return connections
    return {(fd, inode) for fd, inode in connections if _peer_port(fd) == port}


def _peer_port(fd: int) -> int | None:
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            return sock.getpeername()[1]
    except (OSError, IndexError):
        return None


def _begin_setup(before: dict[int, int]) -> None:
    global _setting_up_since
    with _lock:
        if _setting_up_since is None:
            _setting_up_since = before


def _end_setup() -> None:
    global _setting_up_since
    with _lock:
        _setting_up_since = None


def _connections_since(before: dict[int, int]) -> set[tuple[int, int]]:
    """The TCP connections (descriptor, inode) open now that were not in ``before``."""
    return {(fd, inode) for fd, inode in _socket_inodes().items() if before.get(fd) != inode and _is_connection(fd)}


def peer_closed(group: dist.ProcessGroup | None) -> bool:
    """Whether a peer closed or reset one of `group`'s connections: its process died, or it aborted its groups for
    a new round. gloo can miss that: a send or receive posted before the peer died mid-message may wait forever
    (3 ranks in a ring, one SIGKILLed while each sends 16-64 MB to the next: the survivors' operations on it never
    returned in 2 runs of 3). The kernel knows at once: the connection reads end-of-stream, or gloo, where it did
    see the end, closed it."""
    if group is None:
        return False
    with _lock:
        connections = list(_connections_of_group.get(id(group), ()))
    poller = select.poll()
    for fd, inode in connections:
        if not _still_open(fd, inode):
            return True  # gloo closes a connection only once it failed
        poller.register(fd, select.POLLRDHUP)  # a hang-up or an error is reported without being asked for
    return any(not events & select.POLLNVAL for _, events in poller.poll(0))


def connections_closed() -> bool:
    """Whether gloo closed every connection of this process's groups (there were some): after `abort_all` it closes
    a connection once it saw the shutdown, and a collective that has not ended by then never will."""
    with _lock:
        connections = list(_group_connections)
    return bool(connections) and not any(_still_open(fd, inode) for fd, inode in connections)


def _still_open(fd: int, inode: int) -> bool:
    """Whether `fd` is still the connection of `inode` (not closed, nor closed and reused)."""
    try:
        return os.fstat(fd).st_ino == inode
    except OSError:
        return False


def _is_connection(fd: int) -> bool:
    """Whether `fd` is a TCP connection, not a listening socket."""
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            return sock.type == socket.SOCK_STREAM and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    except OSError:
        return False


def abort_all() -> int:
    """End every collective of this process's groups: gloo's raise (their connections shut down), NCCL's return,
    possibly without error (`aborts`), and every later one raises."""
    global _aborts
    with _lock:
        _aborts += 1
        connections = list(_group_connections | _store_connections)
        setting_up_since = _setting_up_since
    if setting_up_since is not None:  # a set-up waiting on a peer that never came: its store and its connects too
        connections += _connections_since(setting_up_since)
    shut = 0
    for fd, inode in connections:
        if not _still_open(fd, inode):
            continue  # closed, and perhaps reused for something else
        try:
            with socket.socket(fileno=os.dup(fd)) as connection:
                connection.shutdown(socket.SHUT_RDWR)
            shut += 1
        except OSError:
            continue  # closed already, or never connected
    if dist.is_initialized() and dist.get_backend() != "gloo":
        try:
            c10d._abort_process_group()
        except Exception as exc:  # an abort is best effort: destroying the groups comes next anyway
            logger.debug("aborting the process groups failed: %s", exc)
    return shut


def destroy_all() -> None:
    """Destroy every process group (after `abort_all`); the next round builds its own."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # the groups are broken on purpose; what is left is freed with them
            logger.debug("destroying the aborted process groups failed: %s", exc)
    # a set-up that failed had named its group already: torch resets the count only with a world it destroys, and a
    # rank that re-enters with a count one higher builds "1", where its fresh peers wait in "0", and never meets them
    c10d._world.group_count = 0
    _end_setup()
    with _lock:
        _group_connections.clear()
        _connections_of_group.clear()
        _store_connections.clear()


def forget_device_meshes() -> None:
    """Drop DTensor's caches of results per DeviceMesh: a DeviceMesh equals (== and hash) any other of the same
    shape whatever this process's rank in it, so a round re-entered at another rank got the last round's meshes
    back from them, with their coordinates (FSDP then saved the shards of the old rank: half a checkpoint)."""
    if "torch.distributed.tensor" not in sys.modules:
        return  # never imported, nothing cached (and importing it takes half a second)
    from torch.distributed.tensor import DTensor, _collective_utils, _redistribute
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    propagator = DTensor._op_dispatcher.sharding_propagator
    per_thread = type(propagator.propagate_op_sharding)  # one cache per thread: a new object empties them all
    caches: list[tuple[str, Callable[[], None]]] = [
        ("the C++ dispatch's sharding cache", torch._C._clear_DTensor_sharding_propagator_cache),
        (
            "ShardingPropagator.propagate_op_sharding",
            lambda: setattr(
                propagator, "propagate_op_sharding", per_thread(propagator.propagate_op_sharding_non_cached)
            ),
        ),
        (
            "ShardingPropagator._propagate_tensor_meta_cached",
            ShardingPropagator._propagate_tensor_meta_cached.cache_clear,
        ),
        ("_redistribute._gen_transform_infos", _redistribute._gen_transform_infos.cache_clear),
        ("_redistribute.clear_redistribute_planner_cache", _redistribute.clear_redistribute_planner_cache),
        ("MeshTopoInfo.build_from_mesh", _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear),
    ]
    for name, clear in caches:
        try:
            clear()
        except Exception as exc:  # a torch without that cache: nothing of it to forget
            logger.warning("could not clear DTensor's %s (%s): a new round may reuse the last one's meshes", name, exc)
