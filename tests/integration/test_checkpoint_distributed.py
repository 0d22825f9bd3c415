"""Checkpointing across real gloo ranks: crash mid-save, per-rank values, step-0 failure, replica sync."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from multiproc import Job, run_ranks
from small_tmpfs import small_tmpfs
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from elastic.checkpoint import CheckpointError, CheckpointManager, ModelState, sync_module_states
from elastic.checkpoint.global_values import PerRankStateError
from elastic.checkpoint.layout import scan
from elastic.checkpoint.ranks import INLINE_MAX_BYTES, Ranks, gather_pickled

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def linear_state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(64, 64)
    return {"model": ModelState(model, torch.optim.AdamW(model.parameters()))}


def save_then_hang_in_async_save(rank: int, world_size: int, directory: str, ready: str) -> None:
    state = linear_state(seed=0)
    manager = CheckpointManager(directory, async_save=True)
    manager.load_latest(state)
    manager.save(1, state)
    manager.wait()
    write_data = FileSystemWriter.write_data

    def write_then_hang(self, plan, planner):
        written = write_data(self, plan, planner)
        written.wait()
        Path(f"{ready}.{rank}").touch()
        time.sleep(600)  # killed here, with this rank's data file on disk and no metadata or commit
        return written

    FileSystemWriter.write_data = write_then_hang
    manager.save(2, state)
    time.sleep(600)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigkill_during_async_save_leaves_a_torn_folder_that_load_skips(tmp_path: Path) -> None:
    directory, ready = tmp_path / "ckpt", tmp_path / "ready"
    job = Job(2, save_then_hang_in_async_save, str(directory), str(ready))
    try:
        deadline = time.monotonic() + 90
        while not all(Path(f"{ready}.{rank}").exists() for rank in range(2)):
            assert time.monotonic() < deadline, "the ranks never reached the background write of step 2"
            assert all(process.is_alive() for process in job.processes), "a rank died before step 2"
            time.sleep(0.1)
    finally:
        job.kill()
    # The unfinished save is in its own attempt folder; step-2 appears only when a save commits.
    assert not (directory / "step-2").exists()
    [attempt] = directory.glob("step-2.attempt-*")
    assert {path.name for path in attempt.iterdir()} == {"__0_0.distcp", "__1_0.distcp"}
    manager = CheckpointManager(directory, check_at_start=False)
    state = linear_state(seed=1)
    assert manager.load_latest(state) == 1
    manager.save(2, state)  # a new epoch of the directory: the killed save's attempt folder is deleted
    manager.close()
    assert [(entry.step, entry.committed) for entry in scan(directory)] == [(0, True), (1, True), (2, True)]
    assert not attempt.exists()


def save_per_rank_values(rank: int, world_size: int, directory: str) -> list[str]:
    manager = CheckpointManager(directory, async_save=False, check_at_start=False)
    messages = []
    for step, extra in enumerate(
        [{"seen": rank}, {f"dp_rank_{rank}": 1}, {"rng": torch.tensor([rank], dtype=torch.uint8)}], start=1
    ):
        state = {**linear_state(seed=0), "progress": extra}
        with pytest.raises(PerRankStateError) as failure:
            manager.save(step, state)
        messages.append(str(failure.value))
    manager.save(4, {**linear_state(seed=0), "progress": {"seen": 4}})
    manager.close()
    return messages


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_per_rank_values_are_rejected_on_every_rank(tmp_path: Path) -> None:
    for messages in run_ranks(2, save_per_rank_values, str(tmp_path)):
        assert "'progress.seen' differs between rank 0 and rank 1" in messages[0]
        assert "progress.dp_rank_" in messages[1] and "exists on only one of" in messages[1]
        assert "'progress.rng' differs" in messages[2]
        assert all("keep this state global" in message for message in messages)
    assert [(entry.step, entry.committed) for entry in scan(tmp_path)] == [(4, True)]


def start_in_unwritable_directory(rank: int, world_size: int, directory: str) -> str:
    manager = CheckpointManager(directory)
    with pytest.raises(CheckpointError) as failure:
        manager.load_latest(linear_state(seed=0))
    manager.close()
    return str(failure.value)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_unwritable_directory_fails_on_every_rank_at_step_zero(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    directory = blocker / "checkpoints"
    for message in run_ranks(2, start_in_unwritable_directory, str(directory)):
        assert str(directory) in message and "Not a directory" in message


def replicas_after_sync(rank: int, world_size: int) -> list[torch.Tensor]:
    # HSDP: 2 replicas x 2 shards, each replica initialised differently, plus a plain (unsharded) buffer.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(mesh.get_local_rank("replicate"))
    model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.BatchNorm1d(6))
    model[1].running_mean.uniform_()
    fully_shard(model, mesh=mesh)
    assert isinstance(model[0].weight, DTensor)
    sync_module_states(model, mesh.get_group("replicate"), src=0)
    local = [tensor.to_local() if isinstance(tensor, DTensor) else tensor for tensor in model.state_dict().values()]
    return [tensor.detach().clone() for tensor in local]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_sync_module_states_makes_replicas_identical() -> None:
    # Ranks 0 and 2 hold shard 0 in replicas 0 and 1; ranks 1 and 3 hold shard 1.
    results = run_ranks(4, replicas_after_sync)
    for first, second in ((0, 2), (1, 3)):
        assert len(results[first]) == len(results[second])
        for mine, theirs in zip(results[first], results[second]):
            assert torch.equal(mine, theirs)
    assert not torch.equal(results[0][0], results[1][0]), "different shards must stay different"


def plain_replicas_after_sync(rank: int, world_size: int) -> list[torch.Tensor]:
    torch.manual_seed(rank)
    model = torch.nn.Linear(3, 2)
    sync_module_states(model, None, src=1)
    return [tensor.detach().clone() for tensor in model.state_dict().values()]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_sync_module_states_on_a_plain_module_copies_from_src() -> None:
    results = run_ranks(2, plain_replicas_after_sync)
    torch.manual_seed(1)
    expected = torch.nn.Linear(3, 2).state_dict().values()
    for rank in range(2):
        assert all(torch.equal(got, want) for got, want in zip(results[rank], expected))


def sharded_state(value: float) -> dict:
    model = torch.nn.Linear(8, 8)
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(value)
    return {"model": ModelState(model)}


def load_with_one_rank_damaged(rank: int, world_size: int, directory: str) -> tuple[int | None, float]:
    manager = CheckpointManager(directory, async_save=False, check_at_start=False)
    for step in (1, 2):
        manager.save(step, sharded_state(float(step)))
    manager.close()
    torch.distributed.barrier()
    if rank == 1:  # same length, so only reading the bytes finds it; rank 0's own shard reads fine
        damaged = Path(directory) / "step-2" / "__1_0.distcp"
        damaged.write_bytes(b"\x00" * damaged.stat().st_size)
    torch.distributed.barrier()
    state = sharded_state(-1.0)
    manager = CheckpointManager(directory, async_save=False, check_at_start=False)
    step = manager.load_latest(state)
    manager.close()
    return step, state["model"].model.weight.to_local().flatten()[0].item()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_data_only_one_rank_cannot_decode_makes_every_rank_load_the_step_before(tmp_path: Path) -> None:
    """Every rank plans and reads its own part of a load (no collective inside DCP's); a failure on one rank still
    reaches all, which load the step before and set the damaged one aside."""
    results = run_ranks(2, load_with_one_rank_damaged, str(tmp_path))
    assert results == [(1, 1.0), (1, 1.0)]
    assert len(list(tmp_path.glob("step-2.unreadable-*"))) == 1


def gathered_as_torch_gathers(rank: int, world_size: int) -> bool:
    """Values small and large (past one rank's inline part, so a second collective), on a gloo group of 3 and
    on the default group; each compared with torch's all_gather_object."""
    group = dist.new_group(backend="gloo")
    values = [
        (None, (True, "a0b1")),
        {"rank": rank, "tensor": torch.arange(rank + 1)},
        b"x" * (INLINE_MAX_BYTES + 1000) if rank == 1 else rank,  # one rank's pickle is long
        "y" * (rank * INLINE_MAX_BYTES),  # ranks 1 and 2 too long
    ]
    for value in values:
        expected: list = [None] * world_size
        dist.all_gather_object(expected, value, group=group)
        for gathered in (Ranks(group).gather(value), gather_pickled(value, group, world_size)):
            assert len(gathered) == world_size
            for mine, theirs in zip(gathered, expected):
                if isinstance(theirs, dict):
                    assert mine["rank"] == theirs["rank"] and torch.equal(mine["tensor"], theirs["tensor"])
                else:
                    assert mine == theirs
    return True


def test_a_gather_gives_what_torchs_all_gather_object_gives() -> None:
    assert run_ranks(3, gathered_as_torch_gathers) == [True] * 3


def save_onto_a_full_disk(rank: int, world_size: int, directory: str, async_save: bool) -> tuple[str, str]:
    """Step 0 (the check at start) fits; step 1 does not fit beside it."""
    torch.manual_seed(0)
    state = {"weights": torch.randn(1 << 18)}  # 1 MiB, the same on both ranks: rank 0 writes it
    manager = CheckpointManager(directory, keep=2, async_save=async_save)
    assert manager.load_latest(state) is None
    try:
        manager.save(1, state)
        manager.wait()
    except Exception as error:  # DCP's own CheckpointException is a BaseException: it would pass this by
        return type(error).__name__, str(error)
    return "saved", ""


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_full_disk_fails_a_save_on_every_rank_with_one_error_that_names_it(tmp_path: Path, async_save) -> None:
    """A full disk failed a synchronous save with DCP's CheckpointException, which is no Exception: elastic.run
    and torchrun's error file missed it, and elastic-run reported "exit code 1" alone. A background save's
    failure read "unexpected pos 704 vs 598" (the zip writer's). Both now raise a RankFailure on every rank that
    says the directory is full, the failed attempt is deleted, and the committed step 0 stays."""
    with small_tmpfs(tmp_path / "disk", 1536 << 10) as disk:
        outcomes = run_ranks(2, save_onto_a_full_disk, str(disk), async_save)
        assert outcomes[0] == outcomes[1], outcomes
        kind, message = outcomes[0]
        assert kind == "RankFailure", outcomes
        assert message.startswith(f"no room in {disk} (0.0 MiB free of 1.5 MiB): "), message
        assert message.endswith("Free some space, or keep fewer checkpoints (CheckpointManager's keep)"), message
        assert [(entry.step, entry.committed) for entry in scan(disk)] == [(0, True)]
        assert sorted(path.name for path in disk.iterdir()) == [".elastic-fence", "step-0"]
