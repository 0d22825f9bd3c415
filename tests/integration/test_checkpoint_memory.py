"""Snapshots in memory: the choice of snapshot and transfers as tables, then real ranks on "nodes" that are
folders of their own (as elastic-run's agents give them), losing a node and resharding from what survived."""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from multiproc import run_ranks
from small_tmpfs import small_tmpfs
from test_checkpoint_reshard import assert_identical, full_state, sharded
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from elastic import process_groups
from elastic.checkpoint import CheckpointManager, ModelState, memory
from elastic.checkpoint.layout import scan
from elastic.checkpoint.memory import (
    METADATA,
    RECORD,
    Inventory,
    MemorySnapshots,
    RangeTransfer,
    SnapshotRecord,
    Transfer,
    found_in,
    merged,
    newest_loadable,
    node_of,
    plan_range_transfers,
    plan_transfers,
)
from elastic.checkpoint.ranks import Ranks
from elastic.checkpoint.snapshot_format import SnapshotWriter, data_file
from elastic.node_memory import MEMORY_DIR_ENV


def record(step: int, files: tuple[str, ...] = ("__0_0.distcp", "__1_0.distcp")) -> SnapshotRecord:
    return SnapshotRecord(step=step, world_size=len(files), files=files, metadata_sha256=f"digest{step}")


def holding(*records_and_files: tuple[SnapshotRecord, bool, tuple[str, ...]]) -> Inventory:
    """A node's inventory: per snapshot, whether it has the record (and so the metadata), and which data files."""
    records = tuple(rec for rec, has_record, _ in records_and_files if has_record)
    files: dict[str, dict[str, int]] = {}
    for rec, has_record, names in records_and_files:
        held = files.setdefault(rec.metadata_sha256, {})
        held.update({name: 10 for name in names})
        if has_record:
            held[METADATA] = 3
    return Inventory(records, files)


A, B = "__0_0.distcp", "__1_0.distcp"


@pytest.mark.parametrize(
    ("inventories", "expected_step"),
    [
        pytest.param([], None, id="no nodes hold anything"),
        pytest.param([holding((record(5), True, (A, B)))], 5, id="one node holds the whole snapshot"),
        pytest.param(
            [holding((record(5), True, (A,))), holding((record(5), False, (B,)))],
            5,
            id="each node holds a part: the second only as a peer copy",
        ),
        pytest.param(
            [holding((record(4), True, (A, B)), (record(5), True, (A,)))],
            4,
            id="the newest lacks a file (its node was lost before the copy): the one before",
        ),
        pytest.param(
            [holding((record(5), False, (A, B)))], None, id="files without a record (a save not finished) never count"
        ),
        pytest.param(
            [holding((record(6), True, (A, B)), (record(7), True, (A, B)))], 7, id="the newest whole one wins"
        ),
    ],
)
def test_newest_loadable_snapshot(inventories: list[Inventory], expected_step: int | None) -> None:
    found = newest_loadable(inventories)
    assert (found.step if found else None) == expected_step


def test_transfers_send_each_lacking_node_each_file_from_the_first_holder() -> None:
    five = record(5)
    inventories = [
        holding((five, True, (A,))),  # rank 0's node: its own file, the metadata
        holding((five, False, (B,))),  # rank 2's node: the lost node's file, from its peer copy
        Inventory((), {}),  # rank 4's node joined with nothing
    ]
    assert plan_transfers(five, [0, 2, 4], inventories) == [
        Transfer(A, 10, 0, 2),
        Transfer(A, 10, 0, 4),
        Transfer(B, 10, 2, 0),
        Transfer(B, 10, 2, 4),
        Transfer(METADATA, 3, 0, 2),
        Transfer(METADATA, 3, 0, 4),
    ]


def test_a_file_no_node_holds_is_refused() -> None:
    with pytest.raises(ValueError, match="no node holds __1_0.distcp"):
        plan_transfers(record(5), [0], [holding((record(5), True, (A,)))])


@pytest.mark.parametrize(
    ("ranges", "expected"),
    [
        ([], ()),
        ([(64, 8), (0, 16)], ((0, 16), (64, 8))),
        ([(0, 16), (16, 16)], ((0, 32),)),  # adjacent: one range
        ([(0, 32), (8, 8), (24, 24)], ((0, 48),)),  # inside, then overlapping past the end
    ],
)
def test_read_ranges_are_sorted_and_joined(ranges, expected) -> None:
    assert merged(ranges) == expected


def test_range_transfers_send_only_what_a_node_lacks_and_reads() -> None:
    five = record(5, (A, B, "__2_0.distcp"))
    inventories = [
        holding((five, True, (A, B))),  # rank 0's node holds two files whole
        holding((five, True, ("__2_0.distcp",))),  # rank 2's node the third
        Inventory((), {}),  # rank 4's node joined with nothing
    ]
    reads = [
        {A: [(0, 8)]},  # what node 0's ranks read: all of it held
        {A: [(0, 8), (4, 8)], B: [(32, 4)]},
        {"__2_0.distcp": [(0, 10)]},  # node 4 reads nothing of A or B
    ]
    assert plan_range_transfers(five, [0, 2, 4], inventories, reads) == [
        RangeTransfer(A, 10, ((0, 12),), 0, 2),
        RangeTransfer(B, 10, ((32, 4),), 0, 2),
        RangeTransfer("__2_0.distcp", 10, ((0, 10),), 2, 4),
    ]


SNAPSHOT_STEP = 3


def train_with_snapshots(rank: int, world_size: int, disk: str, node_dirs: list[str]) -> dict[str, Any] | None:
    """Two ranks per node; a memory snapshot every step, and the last step to disk as well."""
    os.environ[MEMORY_DIR_ENV] = node_dirs[rank // 2]
    model, optimizer = sharded(seed=0)
    manager = CheckpointManager(disk, keep=2, async_save=False, check_at_start=False, memory_every=1)
    state = {"model": ModelState(model, optimizer)}
    assert manager.load_latest(state) is None
    for step in range(1, SNAPSHOT_STEP + 1):
        torch.manual_seed(100 * step + rank)
        model(torch.randn(4, 6)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        assert manager.should_save(step)
        manager.save(step, state)  # into memory
    manager.save(SNAPSHOT_STEP, state)  # not chosen by should_save: to disk
    manager.close()
    expected = full_state(model, optimizer)
    return expected if rank == 0 else None


def load_after_loss(rank: int, world_size: int, disk: str, node_dirs: list[str], memory: bool) -> Any:
    if memory:
        os.environ[MEMORY_DIR_ENV] = node_dirs[rank // 2]
    model, optimizer = sharded(seed=1 + rank)  # differs from what was saved, so a no-op load would fail
    manager = CheckpointManager(disk, async_save=False, memory_every=1 if memory else 0)
    step = manager.load_latest({"model": ModelState(model, optimizer)})
    manager.close()
    loaded = full_state(model, optimizer)  # a collective: every rank gathers
    return step, loaded if rank == 0 else None


def load_counting_bytes(rank: int, world_size: int, disk: str, node_dirs: list[str]) -> Any:
    """load_after_loss from memory, with the bytes the load says it sent between nodes and how many local load
    plans this rank made: to gather the bytes (`make_load_plan`) and in DCP's planner."""
    from torch.distributed.checkpoint import default_planner

    plans: list[int] = []
    dcps, ours = default_planner.create_default_local_load_plan, memory.make_load_plan
    default_planner.create_default_local_load_plan = lambda *args, **kwargs: (plans.append(1), dcps(*args, **kwargs))[1]
    memory.make_load_plan = lambda *args, **kwargs: (plans.append(1), ours(*args, **kwargs))[1]
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda entry: said.append(entry.getMessage())  # type: ignore[method-assign]
    logging.getLogger(memory.__name__).addHandler(handler)
    logging.getLogger(memory.__name__).setLevel(logging.INFO)
    step, loaded = load_after_loss(rank, world_size, disk, node_dirs, True)
    sent = [int(re.search(r"; (\d+) bytes sent between nodes", line).group(1)) for line in said if "bytes sent" in line]
    return step, loaded, sent, len(plans)


def load_with_slow_leaders(rank: int, world_size: int, disk: str, node_dirs: list[str]) -> Any:
    """load_after_loss from memory, each node's leader slow to assemble its snapshot: its node's other ranks must
    wait for it before reading the metadata it receives."""
    assemble = memory.MemorySnapshots._assemble

    def slowly(self, *args, **kwargs):
        if self.is_leader:
            time.sleep(0.5)
        return assemble(self, *args, **kwargs)

    memory.MemorySnapshots._assemble = slowly
    return load_after_loss(rank, world_size, disk, node_dirs, True)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [3, 4])
def test_reshard_from_memory_after_a_node_loss_equals_reshard_from_disk(tmp_path: Path, world_size: int) -> None:
    """4 ranks on 2 nodes snapshot into memory; node 1 is lost (its memory with it); 3 or 4 ranks load on node 0
    (its own snapshot and node 1's part from its peer copy) and on a new node 2 (one rank, or a leader that
    receives the files and a rank that reads them), value for value as from disk."""
    disk = str(tmp_path / "disk")
    nodes = [str(tmp_path / f"node{index}") for index in range(3)]
    for node in nodes:
        Path(node).mkdir()
    expected = run_ranks(4, train_with_snapshots, disk, nodes[:2])[0]
    assert expected["optimizer"]["state"], "AdamW state must be part of the comparison"
    node1 = Path(nodes[1])
    assert list((node1 / "own").iterdir()) and list((node1 / "peer").iterdir()), "node 1 held a snapshot and a copy"
    shutil.rmtree(node1)

    survivors = [nodes[0], nodes[2]]  # two ranks per node: ranks 0, 1 on node 0; 2 (and 3) on the new node 2
    nothing_on_disk = str(tmp_path / "empty")  # had the memory load failed, the disk's step would have passed
    from_memory = run_ranks(world_size, load_with_slow_leaders, nothing_on_disk, survivors)
    from_disk = run_ranks(world_size, load_after_loss, disk, survivors, False)
    assert [step for step, _ in from_memory] == [SNAPSHOT_STEP] * world_size
    assert [step for step, _ in from_disk] == [SNAPSHOT_STEP] * world_size
    assert_identical(from_memory[0][1], from_disk[0][1])
    assert_identical(from_memory[0][1], expected)
    assert (Path(nodes[2]) / "own" / f"step-{SNAPSHOT_STEP}" / "snapshot.json").exists(), "node 2 was given the files"


@pytest.mark.timeout(240)
def test_a_load_sends_a_new_node_only_what_its_ranks_read(tmp_path: Path) -> None:
    """4 ranks on 2 nodes snapshot into memory; node 1 is lost; 4 ranks load on node 0 and a new node 2. Node 2
    holds nothing: its ranks read all of the lost node's files and a few entries of node 0's (DCP spreads the
    replicated ones over the ranks' files). Only that is sent, with the metadata, not the four whole files, and
    what loads is what was saved. Each rank plans its reads once."""
    disk = str(tmp_path / "disk")
    nodes = [str(tmp_path / f"node{index}") for index in range(3)]
    for node in nodes:
        Path(node).mkdir()
    expected = run_ranks(4, train_with_snapshots, disk, nodes[:2])[0]
    own = Path(nodes[0]) / "own" / f"step-{SNAPSHOT_STEP}"
    (peer,) = (Path(nodes[0]) / "peer").iterdir()
    sizes = {f.name: f.stat().st_size for folder in (own, peer) for f in folder.iterdir() if f.suffix == ".distcp"}
    assert sorted(sizes) == [data_file(rank) for rank in range(4)]
    shutil.rmtree(nodes[1])

    loaded = run_ranks(4, load_counting_bytes, str(tmp_path / "empty"), [nodes[0], nodes[2]])
    assert [step for step, _, _, _ in loaded] == [SNAPSHOT_STEP] * 4
    assert_identical(loaded[0][1], expected)
    assert [plans for _, _, _, plans in loaded] == [1] * 4, "the reads to gather and DCP's load share one plan"
    sent = {said[0] for _, _, said, _ in loaded}
    assert len(sent) == 1, f"the ranks disagree on what was sent: {sent}"
    (sent_bytes,) = sent
    metadata = (own / METADATA).stat().st_size
    lost_nodes_files = sizes[data_file(2)] + sizes[data_file(3)]
    assert lost_nodes_files + metadata <= sent_bytes < sum(sizes.values()) + metadata, (sent_bytes, sizes, metadata)
    assert not (Path(nodes[2]) / "load").exists() or not any((Path(nodes[2]) / "load").iterdir())


@pytest.mark.timeout(240)
def test_a_snapshot_one_node_cannot_read_is_loaded_from_disk_on_every_rank(tmp_path: Path) -> None:
    """Node 0's copy of the snapshot's metadata is damaged, node 1's is whole: node 0's ranks fail to read it and
    node 1's do not, and every rank, not only node 0's, falls back to the disk checkpoint of the same step (the
    ranks agree on the failure instead of node 1's waiting in a collective node 0's left)."""
    disk = str(tmp_path / "disk")
    nodes = [str(tmp_path / f"node{index}") for index in range(2)]
    for node in nodes:
        Path(node).mkdir()
    expected = run_ranks(4, train_with_snapshots, disk, nodes)[0]
    metadata = Path(nodes[0]) / "own" / f"step-{SNAPSHOT_STEP}" / METADATA
    metadata.write_bytes(b"not a pickle" * 8)

    loaded = run_ranks(4, load_after_loss, disk, nodes, True)
    assert [step for step, _ in loaded] == [SNAPSHOT_STEP] * 4
    assert_identical(loaded[0][1], expected)


def snapshots_through_a_layout_change(rank: int, world_size: int, disk: str, node_dirs: list[str]) -> Any:
    """One rank per node, a snapshot at steps 1-4; the state gains an entry at step 3. How many snapshots DCP
    planned after each step, and rank 0's model and optimizer at the end."""
    os.environ[MEMORY_DIR_ENV] = node_dirs[rank]
    plans = []
    save = memory.dcp.save
    memory.dcp.save = lambda *args, **kwargs: (plans.append(1), save(*args, **kwargs))[1]
    model, optimizer = sharded(seed=0)
    manager = CheckpointManager(disk, keep=2, async_save=False, check_at_start=False, memory_every=1)
    state = {"model": ModelState(model, optimizer)}
    planned = []
    for step in range(1, 5):
        if step > 1:
            torch.manual_seed(100 * step + rank)
            model(torch.randn(4, 6)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        if step == 3:
            state["tokens_seen"] = torch.tensor([step * 100])
        assert manager.should_save(step)
        manager.save(step, state)
        planned.append(len(plans))
    manager.close()
    expected = full_state(model, optimizer)
    return planned, expected if rank == 0 else None


@pytest.mark.timeout(240)
def test_a_snapshot_reuses_the_last_ones_plan_while_the_layout_holds(tmp_path: Path) -> None:
    """DCP plans the first snapshot and the one after the state's layout changed; the others are written with the
    plan of the one before. Each node's leader completes their metadata alone, to the same bytes on both nodes and
    to other bytes for each snapshot, and they load value for value, on one node as on two."""
    disk = str(tmp_path / "disk")
    nodes = [str(tmp_path / f"node{index}") for index in range(2)]
    for node in nodes:
        Path(node).mkdir()
    (planned, expected), _ = run_ranks(2, snapshots_through_a_layout_change, disk, nodes)
    assert planned == [1, 1, 2, 2]
    metadata = {
        (node, step): (Path(node) / "own" / f"step-{step}" / METADATA).read_bytes() for node in nodes for step in (3, 4)
    }
    for step in (3, 4):
        assert metadata[(nodes[0], step)] == metadata[(nodes[1], step)], f"step {step}: one snapshot, one metadata"
    assert metadata[(nodes[0], 3)] != metadata[(nodes[0], 4)], "the digest names one snapshot"

    assert [step for step, _ in run_ranks(2, load_after_loss, disk, nodes[:1], True)] == [4, 4]
    step, loaded = run_ranks(1, load_after_loss, disk, nodes[:1], True)[0]
    assert step == 4
    assert_identical(loaded, expected)


def train_step_and_snapshot(model: torch.nn.Module, optimizer: Any, manager: Any, state: dict, step: int) -> None:
    torch.manual_seed(100 * step + dist.get_rank())
    model(torch.randn(4, 6)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    assert manager.should_save(step)
    manager.save(step, state)


def a_round_after_a_load(rank: int, world_size: int, disk: str, node_dirs: list[str], first: bool, extra: bool) -> Any:
    """One rank per node. In the ``first`` round, snapshots of steps 1-2; in a later one, a load from memory and
    snapshots of steps 3-4, rank 1's state with an entry more where ``extra``. How many snapshots DCP planned in
    this round, the step loaded, and rank 0's model and optimizer as loaded and at the end."""
    os.environ[MEMORY_DIR_ENV] = node_dirs[rank]
    plans = []
    save = memory.dcp.save
    memory.dcp.save = lambda *args, **kwargs: (plans.append(1), save(*args, **kwargs))[1]
    model, optimizer = sharded(seed=1 + rank)  # a load must set every value
    manager = CheckpointManager(disk, keep=2, async_save=False, check_at_start=False, memory_every=1)
    state: dict[str, Any] = {"model": ModelState(model, optimizer)}
    loaded = manager.load_latest(state)
    # a copy: the optimizer's step counts are the state's own tensors, which training advances in place
    as_loaded = copy.deepcopy(full_state(model, optimizer)) if loaded else None
    if extra and rank == 1:
        state["tokens_seen"] = torch.tensor([300])
    for step in (1, 2) if first else (3, 4):
        train_step_and_snapshot(model, optimizer, manager, state, step)
    manager.close()
    at_end = full_state(model, optimizer)
    return len(plans), loaded, (as_loaded, at_end) if rank == 0 else None


@pytest.mark.timeout(240)
def test_a_rounds_first_snapshot_takes_the_plan_of_the_snapshot_it_loaded(tmp_path: Path) -> None:
    """At an unchanged world size and layout (a crashed worker replaced), a round's first snapshot is written with
    the plan of the snapshot the round loaded, read from its metadata: DCP plans none of the round's snapshots,
    and what they hold loads value for value. At another world size, or with an entry more on one rank, DCP plans
    the round's first snapshot, as it does without a load."""
    disk = str(tmp_path / "disk")
    nodes = [str(tmp_path / f"node{index}") for index in range(3)]
    for node in nodes:
        Path(node).mkdir()
    first = run_ranks(3, a_round_after_a_load, disk, nodes, True, False)
    assert [(planned, loaded) for planned, loaded, _ in first] == [(1, None)] * 3

    again = run_ranks(3, a_round_after_a_load, disk, nodes, False, False)
    assert [(planned, loaded) for planned, loaded, _ in again] == [(0, 2)] * 3, "the loaded snapshot's plan"
    assert_identical(again[0][2][0], first[0][2][1])

    with_extra = run_ranks(3, a_round_after_a_load, disk, nodes, False, True)
    assert [(planned, loaded) for planned, loaded, _ in with_extra] == [(1, 4)] * 3, "rank 1 has an entry more"
    assert_identical(with_extra[0][2][0], again[0][2][1])  # step 4 as the loaded snapshot's plan wrote it
    fewer = run_ranks(2, a_round_after_a_load, disk, nodes[:2], False, False)
    assert [(planned, loaded) for planned, loaded, _ in fewer] == [(1, 4)] * 2, "another world size"
    assert_identical(fewer[0][2][0], with_extra[0][2][1])


def save_two_steps(rank: int, world_size: int, disk: str, node: str, async_save: bool) -> list[int] | None:
    os.environ[MEMORY_DIR_ENV] = node
    model, optimizer = sharded(seed=0)
    manager = CheckpointManager(disk, every=2, async_save=async_save, check_at_start=False, memory_every=1)
    state = {"model": ModelState(model, optimizer)}
    for step in (1, 2):
        assert manager.should_save(step)
        manager.save(step, state)
    manager.close()
    return sorted(int(path.parent.name[5:]) for path in Path(node).glob("own/step-*/snapshot.json")) if rank else None


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("async_save", "in_memory"), [(True, [1, 2]), (False, [1])], ids=["async", "sync"])
def test_a_disk_step_saved_async_is_snapshotted_in_memory_too(tmp_path: Path, async_save, in_memory) -> None:
    """Until an async save commits (a node lost before, and it never does), the snapshot is the newest state;
    a sync save has committed when it returns, so that step needs none."""
    disk, node = tmp_path / "disk", tmp_path / "node"
    node.mkdir()
    assert run_ranks(2, save_two_steps, str(disk), str(node), async_save)[1] == in_memory
    assert (disk / "step-2" / "commit.json").exists()


def steps_marked_long(rank: int, world_size: int, disk: str, node: str) -> list[tuple[int, str]]:
    import elastic.checkpoint.manager as manager_module

    os.environ[MEMORY_DIR_ENV] = node
    marked: list[tuple[int, str]] = []
    step = 0
    manager_module.long_operation = lambda name: contextlib.nullcontext(marked.append((step, name)))
    model, optimizer = sharded(seed=0)
    manager = CheckpointManager(disk, every=2, check_at_start=False, memory_every=1)
    for step in (1, 2, 3):
        assert manager.should_save(step)
        manager.save(step, {"model": ModelState(model, optimizer)})
    manager.close()
    return marked


@pytest.mark.timeout(120)
def test_only_a_save_to_disk_is_a_long_operation_for_the_watchdog(tmp_path: Path) -> None:
    """A snapshot in memory is part of its step, watched as the step is: were it a long operation, a rank hung in
    one would get the long-operation allowance (30 minutes by default) at every step."""
    node = tmp_path / "node"
    node.mkdir()
    assert run_ranks(2, steps_marked_long, str(tmp_path / "disk"), str(node)) == [[(2, "checkpoint save")]] * 2


def test_a_new_snapshot_is_written_over_the_oldest_files_never_over_a_peer_copy(tmp_path: Path) -> None:
    """Once KEEP are held, a snapshot takes the oldest one's folder and writes over its files in place; a file
    that is also a peer copy (a load linked it in) is replaced, not written over, and a file this node's ranks no
    longer write (of another rank, from a load) goes: in the new snapshot it would pass for that rank's part."""
    snapshots = MemorySnapshots(tmp_path, Ranks(None), None, [node_of(tmp_path)])
    model = torch.nn.Linear(4, 4)
    state = {"model": ModelState(model)}
    own = tmp_path / "own"
    for step in (1, 2):
        snapshots.save(step, state)
    first = (own / "step-1" / data_file(0)).stat().st_ino
    snapshots.save(3, state)
    assert sorted(path.name for path in own.iterdir()) == ["step-2", "step-3"]
    assert (own / "step-3" / data_file(0)).stat().st_ino == first, "step 3 was written over step 1's file"

    peer = tmp_path / "peer" / "digest"
    peer.mkdir(parents=True)
    os.link(own / "step-2" / data_file(0), peer / data_file(0))
    copied = (peer / data_file(0)).read_bytes()
    (own / "step-2" / data_file(7)).write_bytes(b"of a rank this node no longer has")
    with torch.no_grad():
        model.weight.add_(1.0)
    snapshots.save(4, state)

    assert (peer / data_file(0)).read_bytes() == copied, "the peer copy is as it was"
    assert sorted(path.name for path in (own / "step-4").iterdir()) == sorted([data_file(0), METADATA, RECORD])
    saved = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    newest = found_in([snapshots.inventory()])
    assert newest is not None and newest.step == 4
    snapshots.load(newest, state)
    assert torch.equal(model.weight, saved)


def test_a_snapshot_after_a_failed_copy_keeps_the_last_one_the_next_node_holds(tmp_path: Path) -> None:
    """The next node died while step 2's part was copied to it, after step 1's had arrived: preparing step 3 (which
    the dead node's peers may never complete) takes a new folder, so step 1 stays whole, the newest snapshot the
    survivors can assemble; once a copy succeeded again, the oldest folder is written over as before."""
    snapshots = MemorySnapshots(tmp_path, Ranks(None), None, [node_of(tmp_path)])
    state = {"model": ModelState(torch.nn.Linear(4, 4))}
    own = tmp_path / "own"
    for step in (1, 2):
        snapshots.save(step, state)
    snapshots._copied = 1  # what the copy thread records; step 2's copy failed
    snapshots._prepare(snapshots._own(3))
    assert (own / "step-1" / RECORD).is_file() and (own / "step-3").is_dir()
    snapshots._copied = 3
    snapshots._prepare(snapshots._own(4))
    assert not (own / "step-1").exists() and (own / "step-4").is_dir()


def test_a_snapshot_the_groups_were_aborted_during_does_not_count(tmp_path: Path, monkeypatch) -> None:
    """elastic.run aborts the groups when a new round is offered, and an NCCL collective the abort ended returns
    without error: a snapshot written meanwhile is not published, and the last one stays the newest."""
    snapshots = MemorySnapshots(tmp_path, Ranks(None), None, [node_of(tmp_path)])
    state = {"model": ModelState(torch.nn.Linear(4, 4))}
    snapshots.save(1, state)
    write = SnapshotWriter.write_data

    def abort_then_write(self, *args, **kwargs):
        process_groups.abort_all()
        return write(self, *args, **kwargs)

    monkeypatch.setattr(SnapshotWriter, "write_data", abort_then_write)
    with pytest.raises(process_groups.GroupsAborted, match="memory snapshot of step 2"):
        snapshots.save(2, state)
    monkeypatch.undo()
    newest = found_in([snapshots.inventory()])
    assert newest is not None and newest.step == 1


def copy_cut_by_its_peer(rank: int, world_size: int, root: str) -> tuple[bool, bool, float, int] | None:
    """Rank 0 waits for a copy to rank 1 that only an abort of its own groups ends; rank 1 leaves the round."""
    process_groups.track_group_sockets()
    group = dist.new_group(backend="gloo")  # the copy group: its connections are told apart from the others
    dist.barrier(group=group)
    closed_while_healthy = process_groups.peer_closed(group)
    dist.barrier()
    if rank == 1:
        process_groups.abort_all()  # as when it takes a new round, or as its death closes them
        return None
    snapshots = MemorySnapshots(Path(root), Ranks(None), None, [node_of(Path(root))])
    snapshots._copy_group = group
    aborts = process_groups.aborts()

    def copy_only_an_abort_ends() -> None:
        # what gloo does when the peer died mid-message (process_groups.peer_closed): it waits, for good
        deadline = time.monotonic() + 30
        while process_groups.aborts() == aborts and time.monotonic() < deadline:
            time.sleep(0.01)
        snapshots._copy_error = RuntimeError("Connection closed by peer")

    snapshots._copy = threading.Thread(target=copy_only_an_abort_ends, daemon=True)
    snapshots._copy.start()
    began = time.monotonic()
    snapshots.wait_for_copy()
    return closed_while_healthy, process_groups.peer_closed(group), time.monotonic() - began, process_groups.aborts()


@pytest.mark.timeout(120)
def test_a_save_does_not_wait_for_a_copy_whose_peer_closed_its_connection(tmp_path: Path) -> None:
    """The next save waits for the last copy. One whose peer is gone never ends by itself, and the node stood
    until elastic-run found it stalled and probed (2.44 s instead of 1.17 s after a node's SIGKILL, in a chaos
    run): now the save sees the closed connection, aborts the groups, and fails at once like its peers."""
    closed_while_healthy, closed_after, waited_s, aborts = run_ranks(2, copy_cut_by_its_peer, str(tmp_path))[0]
    assert not closed_while_healthy, "a live peer's connections are not closed"
    assert closed_after
    assert waited_s < 5, f"the save waited {waited_s:.1f}s for a copy whose peer was gone"
    assert aborts == 1


def copy_failing_before_its_exchange(rank: int, world_size: int, disk: str, node_dirs: list[str]) -> tuple[str, float]:
    """Rank 0's copy of step 1 fails in its first exchange, before it sent or received a byte; how each rank's save
    of step 2 ends."""
    process_groups.track_group_sockets()  # as elastic.run does: the manager's groups are made after this
    os.environ[MEMORY_DIR_ENV] = node_dirs[rank]
    if rank == 0:

        def broken(self: MemorySnapshots, data: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("the copy group's connection broke before the first send")

        MemorySnapshots._exchange = broken  # type: ignore[method-assign]
    model, optimizer = sharded(seed=0)
    manager = CheckpointManager(disk, every=100, async_save=False, check_at_start=False, memory_every=1)
    state = {"model": ModelState(model, optimizer)}
    for step in (1, 2):
        assert manager.should_save(step)
        began = time.monotonic()
        try:
            manager.save(step, state)  # step 1: rank 0's copy fails at once, rank 1's waits for rank 0's files
        except RuntimeError as error:
            return f"step {step}: {type(error).__name__}", time.monotonic() - began
    return "saved", time.monotonic() - began


@pytest.mark.timeout(120)
def test_a_copy_that_failed_before_its_exchange_fails_every_ranks_next_save_at_once(tmp_path: Path) -> None:
    """A leader's copy that fails before its sends and receives (here in its first exchange) left the next
    node's copy waiting for good, and that node's next save with it, while the failed leader went on into the
    save's collective: every rank stood until the watchdog's allowance (60 s in a test run where a neighbouring
    test emptied a node's folder). Now the failed leader aborts its groups, and both saves fail within seconds
    (a failed collective: elastic.run takes the next round)."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        node.mkdir()
    outcomes = run_ranks(
        2, copy_failing_before_its_exchange, str(tmp_path / "disk"), [str(n) for n in nodes], timeout=60
    )
    for outcome, seconds in outcomes:
        assert outcome.startswith("step 2:"), outcomes
        assert seconds < 10, outcomes


class Said(logging.Handler):
    """The messages of one logger, kept."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.messages: list[str] = []
        logging.getLogger(name).addHandler(self)
        logging.getLogger(name).setLevel(logging.INFO)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def wide_model() -> torch.nn.Module:
    """1 MB of weights per rank of two, sharded: a snapshot larger than the small memory below."""
    model = torch.nn.Linear(1024, 512, bias=False)
    fully_shard(model)
    return model


def train_in_small_memory(
    rank: int, world_size: int, disk: str, node_dirs: list[str], every: int, freed_after_step_1: bool
) -> Any:
    """Memory snapshots every step into a node memory too small for one (or, ``freed_after_step_1``, one that a
    ballast file fills until step 1's has failed); to disk every ``every`` steps."""
    os.environ[MEMORY_DIR_ENV] = node_dirs[rank]
    said = Said("elastic.checkpoint.manager")
    ballast = Path(node_dirs[rank]) / "ballast"
    if freed_after_step_1:
        free = os.statvfs(node_dirs[rank])
        ballast.write_bytes(b"\0" * (free.f_bavail * free.f_frsize - (64 << 10)))
    model = wide_model()
    manager = CheckpointManager(disk, keep=2, async_save=False, check_at_start=False, every=every, memory_every=1)
    state = {"model": ModelState(model)}
    for step in range(1, 5):
        with torch.no_grad():
            model.weight.add_(1.0)
        if manager.should_save(step):
            manager.save(step, state)
        if step == 1 and freed_after_step_1:
            ballast.unlink()  # another process's memory given back
    paused = manager._memory_pause.failures > 0
    manager.close()
    return paused, said.messages, sorted(os.listdir(Path(node_dirs[rank]) / "own"))


@pytest.mark.timeout(120)
def test_a_snapshot_that_does_not_fit_in_memory_turns_snapshots_off_and_training_goes_on(tmp_path: Path) -> None:
    """A container's /dev/shm is 64 MB unless told otherwise. A snapshot larger than the room left killed every
    rank with SIGBUS at its first step, and again in every round until the job failed, its root cause a peer's
    broken connection. Now the first snapshot fails with ENOSPC on some rank, every rank turns snapshots in
    memory off with one warning that names the fix, frees what it wrote, and the disk checkpoints go on."""
    with contextlib.ExitStack() as mounts:
        nodes = [str(mounts.enter_context(small_tmpfs(tmp_path / f"node{index}", 256 << 10))) for index in range(2)]
        outcomes = run_ranks(2, train_in_small_memory, str(tmp_path / "disk"), nodes, 2, False, timeout=90)
        for turned_off, _, own in outcomes:
            assert turned_off
            assert own == [], "the failed snapshot's files were freed"
        warnings = [message for message in outcomes[0][1] if "snapshots in memory are off" in message]
        assert "tried again at step 2" in warnings[0], warnings
        assert len(warnings) == 1 and "No space left on device" in warnings[0] and "--shm-size" in warnings[0]
        assert outcomes[1][1] == [line for line in outcomes[1][1] if "memory" not in line], "rank 0 warns alone"
    assert sorted(path.name for path in (tmp_path / "disk").iterdir() if path.name.startswith("step-")) == [
        "step-2",
        "step-4",
    ]


@pytest.mark.timeout(120)
def test_snapshots_in_memory_that_did_not_fit_are_tried_again_and_resume_once_there_is_room(tmp_path: Path) -> None:
    """Snapshots in memory that failed for want of room stayed off until the next round, however soon the room
    came back. Now they are tried again after 1, 2, 4, ... scheduled snapshots: here the memory is freed after
    step 1's failed, and steps 2-4 are snapshotted; one warning, and one line that they are on again."""
    with contextlib.ExitStack() as mounts:
        nodes = [str(mounts.enter_context(small_tmpfs(tmp_path / f"node{index}", 6 << 20))) for index in range(2)]
        disk = str(tmp_path / "disk")
        (paused0, said0, own0), (paused1, said1, own1) = run_ranks(
            2, train_in_small_memory, disk, nodes, 100, True, timeout=90
        )
    assert not paused0 and not paused1
    assert [line for line in said0 if "memory" in line and "step" in line] == [
        said0[0],
        "snapshots in memory are on again, from step 2",
    ], said0
    assert "No space left on device" in said0[0] and "tried again at step 2" in said0[0], said0
    assert own0 == own1 and own0[-1] == "step-4" and "step-1" not in own0, (own0, own1)


def uneven_state() -> dict[str, Any]:
    """3 rows of 0.5 MB over 2 ranks: rank 0 holds 2 (its file is 1 MB), rank 1 holds 1."""
    mesh = init_device_mesh("cpu", (2,))
    rows = torch.arange(3 * 131072, dtype=torch.float32).reshape(3, 131072)
    return {"model": {"rows": distribute_tensor(rows, mesh, [Shard(0)])}}


def snapshot_steps(rank: int, node_dirs: list[str], steps: int) -> tuple[int, list[str], list[str]]:
    """Snapshots of ``steps`` steps of ``uneven_state`` in memory, each node's copied to the next; the groups aborted
    meanwhile, the peer copies this node holds at the end, and what the snapshots said."""
    said = Said(memory.__name__)
    root = Path(node_dirs[rank])
    ranks = Ranks(dist.group.WORLD)
    snapshots = MemorySnapshots(root, ranks, dist.new_group(backend="gloo"), ranks.gather(node_of(root)))
    state = uneven_state()
    aborts = process_groups.aborts()
    for step in range(1, steps + 1):
        snapshots.save(step, state)
    snapshots.wait_for_copy()
    peer = root / "peer"
    copies = sorted(path.name for folder in peer.iterdir() for path in folder.iterdir()) if peer.is_dir() else []
    return process_groups.aborts() - aborts, copies, said.messages


def snapshot_with_no_room_for_a_copy(rank: int, world_size: int, node_dirs: list[str]) -> Any:
    return snapshot_steps(rank, node_dirs, 4)


def first_file_to_send_vanishes() -> None:
    mapped = memory.mapped_file
    vanished: list[Path] = []

    def vanishing_once(path: Path) -> torch.Tensor:
        if not vanished:
            vanished.append(path)
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return mapped(path)

    memory.mapped_file = vanishing_once  # type: ignore[assignment]


def snapshot_with_a_file_that_vanishes(rank: int, world_size: int, node_dirs: list[str]) -> Any:
    if rank == 0:
        first_file_to_send_vanishes()
    return snapshot_steps(rank, node_dirs, 3)


def copied_everywhere_after_each_step(rank: int, world_size: int, node_dirs: list[str]) -> list[bool]:
    if rank == 0:
        first_file_to_send_vanishes()
    root = Path(node_dirs[rank])
    ranks = Ranks(dist.group.WORLD)
    snapshots = MemorySnapshots(root, ranks, dist.new_group(backend="gloo"), ranks.gather(node_of(root)))
    state = uneven_state()
    everywhere = []
    for step in (1, 2):
        snapshots.save(step, state)
        everywhere.append(snapshots.copied_everywhere())
    return everywhere


@pytest.mark.timeout(120)
def test_every_rank_knows_whether_each_nodes_part_reached_the_next_node(tmp_path: Path) -> None:
    """What a drain answered in memory needs (a node that leaves takes its memory): step 1's copy from node 0
    failed (a file vanished), so no rank counts step 1 as on every next node; step 2's went through."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        node.mkdir()
    outcomes = run_ranks(2, copied_everywhere_after_each_step, [str(n) for n in nodes], timeout=90)
    assert outcomes == [[False, True], [False, True]]


@pytest.mark.timeout(120)
def test_a_leader_that_cannot_read_its_files_offers_none_and_the_snapshots_go_on(tmp_path: Path) -> None:
    """Node 0's leader cannot map one of its data files for step 1's copy (it vanished). The copy used to fail
    before its exchange and abort every group: one round change for a file of the node's own. Now it offers no
    file, node 1 waits for none, nothing aborts, node 0 says why, and the next snapshots' copies go through."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        node.mkdir()
    outcomes = run_ranks(2, snapshot_with_a_file_that_vanishes, [str(n) for n in nodes], timeout=90)
    (aborts0, copies0, said0), (aborts1, copies1, said1) = outcomes
    assert aborts0 == aborts1 == 0
    assert copies0 == [data_file(1)] and copies1 == [data_file(0)], "step 3's copies, both ways"
    failed = [line for line in said0 if "could not copy the last memory snapshot" in line]
    assert len(failed) == 1 and "No such file or directory" in failed[0], said0
    assert not [line for line in said1 if "could not copy" in line or "room" in line], said1


@pytest.mark.timeout(120)
def test_a_node_with_no_room_for_its_peer_copy_refuses_it_and_the_snapshots_go_on(tmp_path: Path) -> None:
    """Node 1's memory holds its own two snapshots, not node 0's 1 MB part beside them. The copy used to map the
    file unallotted and receive into it: SIGBUS in node 1's leader. Now node 1 says it has no room before a byte
    is sent; node 0 sends nothing, neither side aborts, every snapshot completes, node 1's part still reaches
    node 0, and each side says so once, not at every step."""
    node0 = tmp_path / "node0"
    node0.mkdir()
    with small_tmpfs(tmp_path / "node1", 1280 << 10) as node1:
        outcomes = run_ranks(2, snapshot_with_no_room_for_a_copy, [str(node0), str(node1)], timeout=90)
    (aborts0, copies0, said0), (aborts1, copies1, said1) = outcomes
    assert aborts0 == aborts1 == 0
    assert copies0 == [data_file(1)] and copies1 == []
    assert [line for line in said1 if "no room in" in line and "No space left" in line] == said1[:1]
    assert len([line for line in said0 if "next node had no room" in line]) == 1


def finish_after_resuming_from_memory(rank: int, world_size: int, disk: str, node_dirs: list[str]) -> Any:
    """Snapshots of steps 1-3 in memory only; a second manager resumes at step 3, the job's last, and finishes."""
    os.environ[MEMORY_DIR_ENV] = node_dirs[rank]
    model, optimizer = sharded(seed=0)
    state = {"model": ModelState(model, optimizer)}
    first = CheckpointManager(disk, async_save=False, check_at_start=False, every=100, memory_every=1)
    for step in range(1, 4):
        model(torch.randn(4, 6)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        assert first.should_save(step)
        first.save(step, state)
    first.close()
    resumed = CheckpointManager(disk, async_save=False, check_at_start=False, every=100, memory_every=1)
    assert resumed.load_latest(state) == 3
    committed_before = [entry.step for entry in scan(disk) if entry.committed]
    resumed.finish(3, state)
    again = CheckpointManager(disk, async_save=False, check_at_start=False)
    again.finish(3, state)  # committed already: nothing is written
    return committed_before, [(entry.step, entry.record.round) for entry in scan(disk) if entry.committed]


@pytest.mark.timeout(120)
def test_finish_commits_a_last_step_loaded_from_memory(tmp_path: Path) -> None:
    """A run that resumes at its last step from a snapshot in memory has nothing left to train. The example, the
    HF and the Lightning callbacks then closed the manager, and the job ended with its last state in memory only:
    gone with the agents (a full disk that failed every save made exactly that happen, with exit code 0).
    ``finish`` commits it to disk, and only once."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        node.mkdir()
    for before, after in run_ranks(
        2, finish_after_resuming_from_memory, str(tmp_path / "disk"), [str(n) for n in nodes]
    ):
        assert before == []
        assert after == [(3, 0)]
