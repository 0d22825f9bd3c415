"""Snapshots in host memory, with a copy on the next node: how a crash or a node loss costs at most one step.

elastic-run's agent gives its workers a folder in shared memory (``ELASTIC_MEMORY_DIR``, on tmpfs) that it
creates when it starts and removes when it exits, so a snapshot outlives the worker that wrote it. Each node's
folder holds::

    own/step-<N>/      the DCP snapshot of step N as this node has it: .metadata, this node's ranks' data files
                       (tensors as raw bytes: snapshot_format.py), and snapshot.json, written once every rank's
                       data was written
    peer/<digest>/     the previous node's data files of one snapshot (named by its metadata's digest, so files
                       of two saves of one step never mix), each renamed into place once whole
    load/step-<N>/     while a load that receives ranges runs: links to the whole files the node holds, and
                       sparse files holding the received ranges; removed once every rank read it

A round's first snapshot is planned by DCP across the ranks, unless the round loaded a snapshot saved at its world
size, whose plan every rank's state still fits; the next ones reuse the plan while every rank's state keeps its
layout (snapshot_plans.py): two collectives a snapshot, one before the writes (the leaders
prepared the folders, and every rank says whether the plan still fits it) and one after (every rank wrote, and
the write results, from which each leader completes the metadata).
After a save, the leader of each node (its lowest rank) sends its node's data files to the leader of the next node
(nodes in rank order, the last to the first) in the background, over a gloo group of their own; the next save waits
for that copy, unless a peer of the copy closed its connection: gloo may then wait forever, so the save aborts the
groups and fails as its peers' collectives do. A copy that failed midway through its exchanges with its neighbours
aborts them too: their copies may wait on it for good. A leader that cannot read its own files offers none, and
one with no room for its previous node's files says so before any is sent: the two skip that copy, and nothing
aborts. Every file's pages are
allotted before it is written: a full tmpfs is an ENOSPC, not a SIGBUS. A step is loadable when
some node has its snapshot.json and every data file it lists is whole on some node. To load it, every rank plans its
DCP reads, and the nodes send each other only the byte ranges of the files they lack that their ranks' plans read
(point to point, over the snapshot group), into sparse files in a ``load/`` folder beside ``own/``; every rank then
loads with DCP from its node's folder: at any world size, as from disk. A whole file is never sent: at an unchanged
world size a rank reads all of its own file and a few percent of each other one (the replicated entries DCP spreads
over the ranks' files), and whole files would bring every node (N-2)/N of the job's state per change. At most
``KEEP`` own snapshots and one peer copy (two while the next arrives) stay per node. Once ``KEEP`` are held, a save
writes over the files of the oldest, through the mappings its ranks kept of them: a memory copy, no new pages,
nothing freed during the step.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pickle
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from pydantic import BaseModel, ConfigDict
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult

from elastic import process_groups
from elastic.checkpoint.load_plans import MadeLoadPlan, make_load_plan
from elastic.checkpoint.loading import load_folder, state_dicts
from elastic.checkpoint.ranks import Ranks
from elastic.checkpoint.snapshot_format import (
    MappedFiles,
    SnapshotReader,
    SnapshotWriter,
    data_file,
    filled_in_place,
    mapped_file,
)
from elastic.checkpoint.snapshot_plans import RecordingPlanner, SnapshotPlan, local_plan, plan_of_saved

logger = logging.getLogger(__name__)

COPY_CHECK_S = 0.05  # how often a save waiting for the last copy looks whether a peer of the copy closed
KEEP = 2  # own snapshots per node: the newest, and the one before it while the newest is copied
RECORD = "snapshot.json"
METADATA = ".metadata"


class SnapshotRecord(BaseModel):
    """snapshot.json: which save this is, and every data file it needs (from its DCP metadata)."""

    model_config = ConfigDict(frozen=True)

    step: int
    world_size: int
    files: tuple[str, ...]
    metadata_sha256: str


@dataclass(frozen=True)
class Inventory:
    """What one node holds: its snapshot records, and the size of every whole data file per snapshot digest."""

    records: tuple[SnapshotRecord, ...]
    files: dict[str, dict[str, int]]  # metadata digest -> file (data files, and .metadata with a record) -> size

    def held(self, record: SnapshotRecord) -> dict[str, int]:
        return self.files.get(record.metadata_sha256, {})


@dataclass(frozen=True)
class Found:
    """The newest snapshot the nodes can assemble, and what each node held when it was found: loading it right
    after needs no second look."""

    record: SnapshotRecord
    inventories: list[Inventory]

    @property
    def step(self) -> int:
        return self.record.step


@dataclass(frozen=True)
class Transfer:
    """One file sent from the leader of a node that has it to the leader of a node that lacks it."""

    name: str
    size: int
    source: int
    destination: int


def newest_loadable(inventories: list[Inventory]) -> SnapshotRecord | None:
    """The newest snapshot whose every data file is whole on some node (one inventory per node)."""
    records = {record.metadata_sha256: record for inventory in inventories for record in inventory.records}
    for record in sorted(records.values(), key=lambda r: r.step, reverse=True):
        held = set().union(*(inventory.held(record) for inventory in inventories))
        if held >= set(record.files):
            return record
    return None


def found_in(gathered: list[Inventory | None]) -> Found | None:
    """The newest snapshot the nodes can assemble, from every rank's ``MemorySnapshots.inventory()``."""
    inventories = [inventory for inventory in gathered if inventory is not None]
    record = newest_loadable(inventories)
    return None if record is None else Found(record, inventories)


def node_of(root: Path) -> str:
    """What names a node among the ranks: its host, and the folder its agent keeps snapshots in."""
    return f"{socket.gethostname()}:{root.resolve()}"


def plan_transfers(
    record: SnapshotRecord, leaders: list[int], inventories: list[Inventory], names: tuple[str, ...] | None = None
) -> list[Transfer]:
    """What each node lacks of ``record`` (its data files and its metadata; only ``names`` when given), each file
    sent by the first node in rank order that holds it; ``leaders[i]`` is the rank that speaks for the node of
    ``inventories[i]``."""
    transfers = []
    for name in names if names is not None else (*record.files, METADATA):
        source, size = _first_holder(record, name, leaders, inventories)
        transfers += [
            Transfer(name, size, source, leader)
            for leader, inv in zip(leaders, inventories)
            if name not in inv.held(record)
        ]
    return transfers


def _first_holder(
    record: SnapshotRecord, name: str, leaders: list[int], inventories: list[Inventory]
) -> tuple[int, int]:
    """The leader of the first node in rank order that holds ``name`` of ``record`` whole, and the file's size."""
    for leader, inventory in zip(leaders, inventories):
        if name in inventory.held(record):
            return leader, inventory.held(record)[name]
    raise ValueError(f"no node holds {name} of the memory snapshot of step {record.step}")


Ranges = dict[str, list[tuple[int, int]]]  # data file -> (offset, length) of the bytes read from it


@dataclass(frozen=True)
class RangeTransfer:
    """Byte ranges of one data file, sent from the leader of a node that holds the file to the leader of a node
    whose ranks read them; the receiver keeps them in a sparse file of the whole file's ``size``."""

    name: str
    size: int
    ranges: tuple[tuple[int, int], ...]
    source: int
    destination: int

    @property
    def length(self) -> int:
        return sum(length for _, length in self.ranges)


def merged(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """``ranges`` (offset, length) in order, overlapping and adjacent ones joined."""
    joined: list[tuple[int, int]] = []
    for offset, length in sorted(ranges):
        if joined and offset <= joined[-1][0] + joined[-1][1]:
            start, previous = joined[-1]
            joined[-1] = (start, max(previous, offset + length - start))
        else:
            joined.append((offset, length))
    return tuple(joined)


def plan_range_transfers(
    record: SnapshotRecord, leaders: list[int], inventories: list[Inventory], reads: list[Ranges]
) -> list[RangeTransfer]:
    """What each node's ranks read (``reads[i]``, the ranges of every rank of the node of ``inventories[i]``) of
    the data files that node lacks, each file's ranges sent by the first node in rank order that holds it whole."""
    transfers = []
    for leader, inventory, read in zip(leaders, inventories, reads):
        for name in sorted(set(read) - set(inventory.held(record))):
            source, size = _first_holder(record, name, leaders, inventories)
            transfers.append(RangeTransfer(name, size, merged(read[name]), source, leader))
    return transfers


def planned_reads(metadata: Metadata, made: MadeLoadPlan, lacking: set[str]) -> Ranges:
    """The byte ranges of the ``lacking`` data files that a DCP load with the plan ``made`` reads from the snapshot
    of ``metadata`` (SnapshotReader reads each item's whole stored range). Entries the snapshot lacks are left out:
    whether they are loaded or regenerated is decided later, alike on every rank (loading.py)."""
    reads: Ranges = {}
    for item in made.plan.items:
        stored = metadata.storage_data[item.storage_index]
        if stored.relative_path in lacking and stored.length:
            reads.setdefault(stored.relative_path, []).append((stored.offset, stored.length))
    return {name: list(merged(ranges)) for name, ranges in reads.items()}


class MemorySnapshots:
    """The snapshots of this job in its nodes' shared memory; every method is a collective of all ranks."""

    def __init__(self, root: Path, ranks: Ranks, copy_group: dist.ProcessGroup | None, nodes: list[str]) -> None:
        """``nodes``: every rank's ``node_of`` its root, gathered. Ranks of one node (one host, one folder) share
        its files; its lowest rank (the leader) writes them."""
        self.root = root
        self._ranks = ranks
        self._copy_group = copy_group
        self._leader_of = [nodes.index(node) for node in nodes]
        self._leaders = sorted(set(self._leader_of))
        self.leader = self._leader_of[ranks.rank]
        self._node_files = {data_file(rank) for rank, node in enumerate(nodes) if node == nodes[ranks.rank]}
        self.is_leader = self.leader == ranks.rank
        position = self._leaders.index(self.leader)
        self._next = self._leaders[(position + 1) % len(self._leaders)]
        self._previous = self._leaders[position - 1]
        self._written = MappedFiles(KEEP)
        self._copy: threading.Thread | None = None
        self._copy_error: BaseException | None = None
        self._copy_broke_off = False  # the failed copy left before its sends and receives all ended
        self._copied: int | None = None  # the newest own step whose part reached the next node
        self._room = (True, True)  # whether the last copy had room here, and on the next node
        self._plan: SnapshotPlan | None = None  # the last snapshot's plan, for the next one if it fits every rank
        self._loaded: Metadata | None = None  # the snapshot this round loaded, if saved at its world size

    @property
    def nodes(self) -> int:
        return len(self._leaders)

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Snapshot ``state`` as ``step`` into this node's memory; returns once every rank wrote it, and starts
        the copy of this node's part to the next node."""
        started = time.monotonic()
        aborts = process_groups.aborts()
        self.wait_for_copy()
        folder = self._own(step)
        state_dict = state_dicts(state)
        planner, fits = None, False
        if self._plan is not None or self._loaded is not None:  # else DCP plans: no plan to compare with
            planner = local_plan(state_dict, is_coordinator=self._ranks.rank == 0)
            if self._loaded is not None:  # the round's first snapshot: the plan the loaded one was written with
                self._plan = plan_of_saved(planner, self._loaded, self._ranks.rank)
                self._loaded = None
            fits = self._plan is not None and self._plan.fits(planner)

        def prepare() -> tuple[bool, str | None]:
            self._prepare(folder)
            return fits, str(uuid.uuid4()) if self._ranks.rank == 0 else None

        answers = self._ranks.each(prepare, f"preparing the memory snapshot of step {step}")
        if all(fitting for fitting, _ in answers):
            save_id = answers[0][1]
            assert save_id is not None and planner is not None
            written = self._write_as_planned(folder, step, planner, save_id)
        else:
            written = self._write_and_plan(folder, step, state_dict)
        if self.is_leader:
            assert written is not None, "a leader gets the metadata and the record"
            metadata, record = written
            process_groups.check_not_aborted(aborts, f"the memory snapshot of step {step}")
            self._publish(folder, metadata, record)
            self._prune_own(step)
            if self.nodes > 1:
                self._copy = threading.Thread(
                    target=self._copy_to_next, args=(folder, record), name="elastic-snapshot-copy", daemon=True
                )
                self._copy.start()
        logger.debug("memory snapshot of step %d in %.3fs", step, time.monotonic() - started)

    def copied_everywhere(self) -> bool:
        """Wait for this node's copy of the last snapshot; whether every node's part of it reached the next node,
        so that it outlives any one node (a collective)."""
        return all(self._ranks.gather(self.wait_for_copy()))

    def wait_for_copy(self) -> bool:
        """Wait until this node's part of the last snapshot is on the next node (leaders; others return); whether
        it got there, or nothing was left to copy. A copy whose peer closed its connection ends only when this
        process's groups are aborted (gloo may wait on a peer that died mid-message forever): they are, so this
        rank fails like its peers and takes the next round, instead of blocking until elastic-run finds its node
        stalled."""
        aborted = False
        if self._copy is not None:
            while self._copy.is_alive():
                self._copy.join(COPY_CHECK_S)
                if self._copy.is_alive() and process_groups.peer_closed(self._copy_group):
                    logger.warning(
                        "a peer closed its connection during the copy of the last memory snapshot (it died or left "
                        "the round): aborting this process's groups"
                    )
                    process_groups.abort_all()
                    aborted = True
                    self._copy.join()
            self._copy = None
        if self._copy_error is None:
            return True
        error, self._copy_error = self._copy_error, None
        logger.warning("could not copy the last memory snapshot to the next node: %s", error)
        if self._copy_broke_off and not aborted:
            # the neighbours' copies may wait for sends or receives this one never posted, and their next
            # saves with them, while this rank would wait in the next save's collective: all stood until the
            # watchdog's allowance ran out. Aborted, this rank fails at once and its neighbours' copies see
            # the closed connections, so every rank takes the next round as it does after a peer's death.
            logger.warning("aborting this process's groups: the next node's copy may wait on this one for good")
            process_groups.abort_all()
        return False

    def discard(self, step: int) -> None:
        """Free what a save of ``step`` that failed wrote on this node (leaders; it never counted: no record)."""
        folder = self._own(step)
        if self.is_leader and _record_in(folder) is None:
            shutil.rmtree(folder, ignore_errors=True)

    def load(self, found: Found, state: dict[str, Any]) -> None:
        """Gather what every node's ranks read of the snapshot ``found`` (``found_in``), then load it into
        ``state`` at this world size. Call it before the next save, which may write over what the inventories
        list."""
        started = time.monotonic()
        record = found.record
        folder = self._own(record.step)
        metadata = plan_transfers(record, self._leaders, found.inventories, names=(METADATA,))
        if metadata:
            # the ranks of a node that receives the metadata read it next: every leader done first
            self._ranks.agree(
                lambda: self._assemble(record, folder, metadata),
                f"gathering the metadata of step {record.step}'s snapshot",
            )
        dicts = state_dicts(state)
        lacking = [set(record.files) - set(inventory.held(record)) for inventory in found.inventories]
        transfers: list[RangeTransfer] = []
        made: MadeLoadPlan | None = None  # this rank's load plan, once the reads were planned: DCP's load takes it
        planned_from: Metadata | None = None  # the metadata that plan was made from: DCP's load takes it as read
        if any(lacking):  # alike on every rank; one node, or two whose copies completed, hold every file
            mine = lacking[self._leaders.index(self.leader)]

            def plan_reads() -> Ranges:
                nonlocal made, planned_from
                planned_from = SnapshotReader(folder).read_metadata()
                made = make_load_plan(dicts, planned_from)
                return planned_reads(planned_from, made, mine)

            reads = self._ranks.each(plan_reads, f"planning the reads of step {record.step}'s snapshot")
            by_node: list[Ranges] = [{} for _ in self._leaders]
            for rank, ranges in enumerate(reads):
                node = by_node[self._leaders.index(self._leader_of[rank])]
                for name, read in ranges.items():
                    node.setdefault(name, []).extend(read)
            transfers = plan_range_transfers(record, self._leaders, found.inventories, by_node)
        source = folder
        # without ranges to receive, every node holds whole what its ranks read: its leader links its peer copy
        prepare: Callable[[], None] | None = functools.partial(self._assemble, record, folder, [])
        if transfers:
            source, prepare = self.root / "load" / f"step-{record.step}", None
            self._ranks.agree(
                lambda: self._receive_ranges(record, folder, source, transfers),
                f"gathering the parts of step {record.step}'s snapshot that the ranks read",
            )
        loaded = load_folder(
            self._ranks,
            source,
            record.step,
            state,
            record.world_size,
            functools.partial(SnapshotReader, metadata=planned_from),
            prepare=prepare,
            dicts=dicts,
            load_plan=made,
        )
        if record.world_size == self._ranks.world_size and self._plan is None:
            self._loaded = loaded  # its files are named by the ranks that wrote them: data_file
        if transfers and self.is_leader:  # every rank's read ended before the load's last collective
            shutil.rmtree(source, ignore_errors=True)
        logger.info(
            "loaded step %d from memory (saved by %d ranks, now %d; %d bytes sent between nodes) in %.2fs",
            record.step,
            record.world_size,
            self._ranks.world_size,
            sum(transfer.length for transfer in transfers) + sum(transfer.size for transfer in metadata),
            time.monotonic() - started,
        )

    # -- the files ---------------------------------------------------------------------------------------------
    def _own(self, step: int) -> Path:
        return self.root / "own" / f"step-{step}"

    def _peer(self, digest: str) -> Path:
        return self.root / "peer" / digest

    def _prepare(self, folder: Path) -> None:
        """``folder`` holding no snapshot, for a new one: the oldest own snapshot's folder once ``KEEP`` are held,
        its files written over in place (cheaper than new pages, and nothing is freed during the step), less the
        files this node's ranks will not write again: those would pass for parts of the new snapshot."""
        if not self.is_leader:
            return
        held = sorted(_steps(self.root / "own"))
        # while the newest's copy failed (its next node died during it), the oldest is the newest whose part the
        # next node holds: kept, it is what the survivors load if this save never completes
        if not folder.is_dir() and len(held) >= KEEP and (self._copied is None or held[0] != self._copied):
            oldest = self._own(held[0])
            (oldest / RECORD).unlink(missing_ok=True)  # it stops counting before a byte of it changes
            oldest.rename(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / RECORD).unlink(missing_ok=True)
        for child in folder.iterdir():
            # a file linked from a peer copy (_assemble) is that copy too: writing over it would change the copy
            if child.name not in self._node_files or child.stat().st_nlink > 1:
                child.unlink()

    def _write_and_plan(self, folder: Path, step: int, state_dict: dict[str, Any]) -> tuple[bytes, SnapshotRecord]:
        """Save with DCP, its plan agreed among the ranks, and keep the plan for the next snapshots."""
        planner = RecordingPlanner()
        dcp.save(  # DCP's default planner, without DCP's plan caching: see elastic.checkpoint.saver
            state_dict,
            storage_writer=SnapshotWriter(folder, self._written),
            planner=planner,
            process_group=self._ranks.group,
            no_dist=self._ranks.group is None,
        )

        def describe() -> tuple[bytes, SnapshotRecord]:
            metadata = (folder / METADATA).read_bytes()
            storage = pickle.loads(metadata).storage_data
            return metadata, self._record(step, metadata, {info.relative_path for info in storage.values()})

        metadata, record = self._ranks.agree(
            describe, f"reading the metadata of the snapshot of step {step}", only_rank0=True
        )
        assert planner.local is not None and planner.agreed is not None, "DCP's save made and finished a plan"
        self._plan = SnapshotPlan(planner.local, planner.agreed, pickle.loads(metadata))
        return metadata, record

    def _write_as_planned(
        self, folder: Path, step: int, planner: RecordingPlanner, save_id: str
    ) -> tuple[bytes, SnapshotRecord] | None:
        """Write this rank's part with the plan of an earlier snapshot (every rank's state has its layout); one
        collective gathers the write results, from which every node's leader completes the metadata. None on
        the other ranks: only leaders publish."""
        assert self._plan is not None
        plan = self._plan

        def write() -> list[WriteResult]:
            writer = SnapshotWriter(folder, self._written)
            return writer.write_data(planner.finish_plan(plan.agreed), planner).value()

        results = self._ranks.each(write, f"writing the memory snapshot of step {step}")
        if not self.is_leader:
            return None
        metadata = plan.metadata_with(results, save_id)
        return metadata, self._record(step, metadata, {r.storage_data.relative_path for rs in results for r in rs})

    def _record(self, step: int, metadata: bytes, files: set[str]) -> SnapshotRecord:
        digest = hashlib.sha256(metadata).hexdigest()
        return SnapshotRecord(
            step=step, world_size=self._ranks.world_size, files=tuple(sorted(files)), metadata_sha256=digest
        )

    def _publish(self, folder: Path, metadata: bytes, record: SnapshotRecord) -> None:
        """Write the metadata and, last, the record that makes the snapshot count on this node."""
        _write_atomically(folder / METADATA, metadata)
        _write_atomically(folder / RECORD, record.model_dump_json().encode())

    def _prune_own(self, newest: int) -> None:
        steps = sorted(_steps(self.root / "own"))
        for step in steps[: max(0, len(steps) - KEEP)]:
            if step != newest:
                shutil.rmtree(self._own(step), ignore_errors=True)

    def inventory(self) -> Inventory | None:
        """What this node holds (its leader answers; the other ranks None), for ``found_in``."""
        if not self.is_leader:
            return None
        records = []
        files: dict[str, dict[str, int]] = {}
        for step in _steps(self.root / "own"):
            folder = self._own(step)
            record = _record_in(folder)
            if record is None:
                continue  # not written by every rank: never loaded
            records.append(record)
            held = files.setdefault(record.metadata_sha256, {})
            held.update(_whole_files(folder, record.files))
            held[METADATA] = (folder / METADATA).stat().st_size
        peers = self.root / "peer"
        for folder in peers.iterdir() if peers.is_dir() else ():
            files.setdefault(folder.name, {}).update(_whole_files(folder, None))
        return Inventory(tuple(records), files)

    def _assemble(self, record: SnapshotRecord, folder: Path, transfers: list[Transfer]) -> None:
        """Put every file of ``record`` into this node's ``folder``: links from its peer copy, the rest received
        (``transfers``) from the nodes that hold them; the record goes last, so the folder counts only once whole."""
        if not self.is_leader:
            return
        if _record_in(folder) != record:  # another save of this step, or a partial one: none of its files count
            shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True, exist_ok=True)
        peer = self._peer(record.metadata_sha256)
        for name in _whole_files(peer, record.files):
            if not (folder / name).exists():
                os.link(peer / name, folder / name)
        operations: list[dist.P2POp] = []
        received: list[Path] = []
        for tag, transfer in enumerate(transfers):
            if transfer.source == self._ranks.rank:
                data = mapped_file(folder / transfer.name)
                operations.append(
                    dist.P2POp(dist.isend, data, group=self._ranks.group, group_peer=transfer.destination, tag=tag)
                )
            elif transfer.destination == self._ranks.rank:
                path = folder / transfer.name
                buffer = _file_to_fill(path, transfer.size)
                operations.append(
                    dist.P2POp(dist.irecv, buffer, group=self._ranks.group, group_peer=transfer.source, tag=tag)
                )
                received.append(path)
        _complete(operations)
        for path in received:
            _partial(path).replace(path)
        _write_atomically(folder / RECORD, record.model_dump_json().encode())

    def _receive_ranges(
        self, record: SnapshotRecord, folder: Path, loading: Path, transfers: list[RangeTransfer]
    ) -> None:
        """Fill ``loading`` with what this node's ranks read of ``record``: links to the whole files the node
        holds (its peer copy linked into ``folder`` first), and sparse files holding the received ranges; and
        send other nodes the ranges they read of this node's files. Leaders; the other ranks return."""
        if not self.is_leader:
            return
        self._assemble(record, folder, [])
        shutil.rmtree(loading.parent, ignore_errors=True)  # and what a load that never ended left
        loading.mkdir(parents=True)
        for name in (*_whole_files(folder, record.files), METADATA):
            os.link(folder / name, loading / name)
        operations: list[dist.P2POp] = []
        received: list[tuple[RangeTransfer, torch.Tensor]] = []
        for tag, transfer in enumerate(transfers):
            if transfer.source == self._ranks.rank:
                data = mapped_file(folder / transfer.name)
                parts = torch.cat([data[offset : offset + length] for offset, length in transfer.ranges])
                operations.append(
                    dist.P2POp(dist.isend, parts, group=self._ranks.group, group_peer=transfer.destination, tag=tag)
                )
            elif transfer.destination == self._ranks.rank:
                buffer = torch.empty(transfer.length, dtype=torch.uint8)
                operations.append(
                    dist.P2POp(dist.irecv, buffer, group=self._ranks.group, group_peer=transfer.source, tag=tag)
                )
                received.append((transfer, buffer))
        _complete(operations)
        for transfer, buffer in received:
            # tmpfs allocates only the pages written: the ranges nobody reads take no memory
            file = filled_in_place(loading / transfer.name, transfer.size, transfer.ranges)
            at = 0
            for offset, length in transfer.ranges:
                file[offset : offset + length] = buffer[at : at + length]
                at += length

    def _copy_to_next(self, folder: Path, record: SnapshotRecord) -> None:
        """Send this node's data files of ``record`` to the next node's leader, and take the previous node's. A
        leader that has no room for the previous node's files says so before any is sent, and neither side posts
        them; one that cannot read its own files offers none: either way the copy ends at once on both, and the
        snapshot stays whole on its own node."""
        exchanged = False
        try:
            started = time.monotonic()
            mine, sending, unreadable = _files_to_send(folder, record)
            header = torch.frombuffer(bytearray(json.dumps(mine).encode()), dtype=torch.uint8)
            theirs = json.loads(self._exchange(header).numpy().tobytes())
            peer = self._peer(record.metadata_sha256)
            prepared = self._room_for(peer, theirs, record.step) if theirs else []
            receiving, no_room_here = (None, prepared) if isinstance(prepared, str) else (prepared, None)
            room = torch.tensor([receiving is not None], dtype=torch.uint8)
            next_room = torch.zeros(1, dtype=torch.uint8)
            self._send_receive(room, next_room, backwards=True)
            operations = []
            if next_room.item():
                operations = [
                    dist.P2POp(dist.isend, data, group=self._copy_group, group_peer=self._next, tag=tag)
                    for tag, data in enumerate(sending)
                ]
            operations += [
                dist.P2POp(dist.irecv, buffer, group=self._copy_group, group_peer=self._previous, tag=tag)
                for tag, buffer in enumerate(receiving or [])
            ]
            _complete(operations)
            exchanged = True
            self._report_room(no_room_here, bool(next_room.item()), record.step, mine)
            if receiving:
                for name, _ in theirs:
                    _partial(peer / name).replace(peer / name)
                for other in peer.parent.iterdir():
                    if other != peer:
                        shutil.rmtree(other, ignore_errors=True)
            if unreadable is not None:
                raise unreadable
            if next_room.item():
                self._copied = record.step
            logger.debug(
                "copied step %d's memory snapshot to the next node in %.3fs", record.step, time.monotonic() - started
            )
        except Exception as error:  # reported by the next save; the snapshot is still whole on this node
            self._copy_error = error
            self._copy_broke_off = not exchanged

    def _room_for(self, peer: Path, files: list[tuple[str, int]], step: int) -> list[torch.Tensor] | str:
        """The previous node's ``files`` mapped in ``peer`` with their pages allotted; or, where this node's memory
        has no room for them, why not (and nothing left behind)."""
        try:
            peer.mkdir(parents=True, exist_ok=True)
            return [_file_to_fill(peer / name, size) for name, size in files]
        except (OSError, RuntimeError) as error:  # torch.from_file raises RuntimeError for a file it cannot map
            shutil.rmtree(peer, ignore_errors=True)
            reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
            return f"{reason} ({sum(size for _, size in files)} bytes of step {step})"

    def _report_room(self, no_room_here: str | None, on_next: bool, step: int, mine: list[tuple[str, int]]) -> None:
        """Say when copies stop fitting, on either side (``no_room_here``: why not here), and when they fit again;
        not at every snapshot."""
        here = no_room_here is None
        if (here, on_next) == self._room:
            return
        self._room = (here, on_next)
        if not here:
            logger.warning(
                "no room in %s for the previous node's copy of its memory snapshot: %s. Until there is, a loss of "
                "that node loads an older snapshot or the disk checkpoint; give the node more shared memory "
                "(docker run --shm-size, or a larger /dev/shm)",
                self.root,
                no_room_here,
            )
        if not on_next:
            logger.warning(
                "the next node had no room for this node's part of step %d's memory snapshot (%d bytes): it is "
                "not copied, and a loss of this node loads an older snapshot or the disk checkpoint",
                step,
                sum(size for _, size in mine),
            )
        if here and on_next:
            logger.info("the memory snapshots are copied between nodes again, from step %d", step)

    def _exchange(self, data: torch.Tensor) -> torch.Tensor:
        """Send ``data`` to the next node's leader and return what the previous node's leader sent."""
        length = torch.tensor([data.numel()], dtype=torch.int64)
        their_length = torch.empty(1, dtype=torch.int64)
        self._send_receive(length, their_length)
        theirs = torch.empty(int(their_length.item()), dtype=torch.uint8)
        self._send_receive(data, theirs)
        return theirs

    def _send_receive(self, mine: torch.Tensor, theirs: torch.Tensor, backwards: bool = False) -> None:
        """Send ``mine`` to the next node's leader and receive ``theirs`` from the previous one's (``backwards``:
        the other way round)."""
        to, of = (self._previous, self._next) if backwards else (self._next, self._previous)
        _complete(
            [
                dist.P2POp(dist.isend, mine, group=self._copy_group, group_peer=to),
                dist.P2POp(dist.irecv, theirs, group=self._copy_group, group_peer=of),
            ]
        )


def _files_to_send(
    folder: Path, record: SnapshotRecord
) -> tuple[list[tuple[str, int]], list[torch.Tensor], Exception | None]:
    """This node's data files of ``record`` to copy, as (name, size) and mapped; none, and why, where one cannot be
    read (a file that vanished): the copy then offers nothing, and the next node, told so, waits for nothing."""
    try:
        mine = sorted(_whole_files(folder, record.files).items())
        return mine, [mapped_file(folder / name) for name, _ in mine], None
    except (OSError, RuntimeError) as error:  # torch.from_file raises RuntimeError for a file it cannot open
        return [], [], error


def _complete(operations: list[dist.P2POp]) -> None:
    """Post the sends and receives together (so two leaders sending each other never wait on each other's send),
    then wait for all of them."""
    if operations:
        for work in dist.batch_isend_irecv(operations):
            work.wait()


def _file_to_fill(path: Path, size: int) -> torch.Tensor:
    """A tensor mapped onto a new ``size``-byte file beside ``path`` (its .part, renamed over ``path`` once
    filled), so that what is received lands in the file with no copy in between."""
    partial = _partial(path)
    partial.unlink(missing_ok=True)
    return filled_in_place(partial, size)


def _partial(path: Path) -> Path:
    return path.with_name(path.name + ".part")


def _write_atomically(path: Path, data: bytes) -> None:
    partial = _partial(path)
    partial.write_bytes(data)
    partial.replace(path)


def _record_in(folder: Path) -> SnapshotRecord | None:
    try:
        return SnapshotRecord.model_validate_json((folder / RECORD).read_bytes())
    except (OSError, ValueError):  # absent (a save not every rank finished), or not written by this code
        return None


def _steps(folder: Path) -> list[int]:
    if not folder.is_dir():
        return []
    return [
        int(child.name[5:]) for child in folder.iterdir() if child.name.startswith("step-") and child.name[5:].isdigit()
    ]


def _whole_files(folder: Path, names: tuple[str, ...] | None) -> dict[str, int]:
    """Sizes of the data files in ``folder`` (only ``names`` when given); a partial file ends in .part."""
    if not folder.is_dir():
        return {}
    found = {child.name: child.stat().st_size for child in folder.iterdir() if child.name.endswith(".distcp")}
    return found if names is None else {name: size for name, size in found.items() if name in names}
