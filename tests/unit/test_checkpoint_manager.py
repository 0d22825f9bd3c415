"""CheckpointManager in one process: commit protocol, torn and garbage folders, retention, background failures."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from elastic import process_groups
from elastic.checkpoint import CheckpointError, CheckpointManager, ModelState
from elastic.checkpoint.layout import COMMIT_FILE, scan
from elastic.checkpoint.manager import SnapshotPause
from elastic.checkpoint.ranks import RankFailure
from elastic.checkpoint.retention import prune

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


class Progress:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def make_state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    return {"model": ModelState(model, torch.optim.AdamW(model.parameters())), "progress": Progress()}


def train(state: dict, step: int) -> None:
    model = state["model"].model
    model(torch.randn(2, 4)).sum().backward()
    state["model"].optimizers[0].step()
    state["progress"].step = step


def committed_steps(directory: Path) -> list[int]:
    return [entry.step for entry in scan(directory) if entry.committed]


def save_steps(directory: Path, steps: range, keep: int = 3, async_save: bool = True) -> dict:
    state = make_state(seed=0)
    manager = CheckpointManager(directory, keep=keep, async_save=async_save)
    manager.load_latest(state)
    for step in steps:
        train(state, step)
        manager.save(step, state)
    manager.close()
    return state


def load_into_fresh(directory: Path) -> tuple[int | None, dict]:
    state = make_state(seed=1)
    manager = CheckpointManager(directory, check_at_start=False)
    step = manager.load_latest(state)
    manager.close()
    return step, state


@pytest.mark.parametrize("async_save", [True, False])
def test_latest_committed_checkpoint_loads_exactly(tmp_path: Path, async_save: bool) -> None:
    saved = save_steps(tmp_path, range(1, 4), async_save=async_save)
    step, loaded = load_into_fresh(tmp_path)
    assert step == 3 and loaded["progress"].step == 3
    assert torch.equal(loaded["model"].model.weight, saved["model"].model.weight)
    record = json.loads((tmp_path / "step-3" / COMMIT_FILE).read_text())
    assert record["step"] == 3 and record["world_size"] == 1
    assert record["torch_version"] == torch.__version__ and record["elastic_version"] and record["time"]


def test_nothing_committed_saves_step_zero_and_returns_none(tmp_path: Path, caplog) -> None:
    state = make_state(seed=0)
    manager = CheckpointManager(tmp_path / "fresh")
    with caplog.at_level(logging.INFO, logger="elastic.checkpoint.manager"):
        assert manager.load_latest(state) is None
    manager.close()
    assert committed_steps(tmp_path / "fresh") == [0]
    assert "step-0 checkpoint check" in caplog.text and "passed in" in caplog.text


def test_check_at_start_off_writes_nothing(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, check_at_start=False)
    assert manager.load_latest(make_state(seed=0)) is None
    manager.close()
    assert scan(tmp_path) == []


def test_unwritable_directory_fails_at_step_zero_naming_it(tmp_path: Path) -> None:
    # Root ignores permission bits, but nobody can create a folder below a regular file.
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    directory = blocker / "checkpoints"
    manager = CheckpointManager(directory)
    with pytest.raises(CheckpointError) as failure:
        manager.load_latest(make_state(seed=0))
    manager.close()
    message = str(failure.value)
    assert str(directory) in message and "Not a directory" in message and "step-0 check" in message
    assert "\n" not in message


def test_garbage_and_torn_folders_are_skipped_with_a_warning(tmp_path: Path, caplog) -> None:
    save_steps(tmp_path, range(1, 3))
    garbage = tmp_path / "step-7"
    garbage.mkdir()
    (garbage / ".metadata").write_bytes(b"\x00garbage")
    (garbage / "__0_0.distcp").write_bytes(b"junk")
    lying = tmp_path / "step-8"  # a valid-looking commit record over garbage data
    lying.mkdir()
    (lying / ".metadata").write_bytes(b"not a pickle")
    (lying / COMMIT_FILE).write_text((tmp_path / "step-2" / COMMIT_FILE).read_text().replace('"step": 2', '"step": 8'))
    (tmp_path / "step-9").mkdir()
    with caplog.at_level(logging.WARNING):
        step, loaded = load_into_fresh(tmp_path)
    assert step == 2 and loaded["progress"].step == 2
    for folder in ("step-7", "step-8", "step-9"):
        assert str(tmp_path / folder) in caplog.text
    # step-8 is committed but unreadable: set aside (renamed, not deleted) once step 2 loaded.
    assert committed_steps(tmp_path) == [0, 1, 2]
    assert len(list(tmp_path.glob("step-8.unreadable-*"))) == 1


def test_missing_data_file_is_skipped_and_previous_loads(tmp_path: Path, caplog) -> None:
    save_steps(tmp_path, range(1, 3))
    (tmp_path / "step-2" / "__0_0.distcp").unlink()
    with caplog.at_level(logging.WARNING):
        step, _ = load_into_fresh(tmp_path)
    assert step == 1
    assert "__0_0.distcp is not visible" in caplog.text and str(tmp_path / "step-2") in caplog.text


def test_every_committed_checkpoint_unreadable_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    save_steps(tmp_path, range(1, 2))
    for step in (0, 1):
        (tmp_path / f"step-{step}" / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match="none of the 2 committed checkpoints"):
        load_into_fresh(tmp_path)


def test_saving_into_a_torn_folder_replaces_it(tmp_path: Path) -> None:
    torn = tmp_path / "step-2"
    torn.mkdir(parents=True)
    (torn / "__5_0.distcp").write_bytes(b"left by a crash")
    save_steps(tmp_path, range(1, 3))
    assert not (torn / "__5_0.distcp").exists()
    assert load_into_fresh(tmp_path)[0] == 2


def test_saving_a_committed_step_again_leaves_it_untouched(tmp_path: Path) -> None:
    save_steps(tmp_path, range(1, 2))
    before = (tmp_path / "step-1" / COMMIT_FILE).read_bytes()
    state = make_state(seed=5)
    manager = CheckpointManager(tmp_path, async_save=False)
    manager.save(1, state)
    manager.close()
    assert (tmp_path / "step-1" / COMMIT_FILE).read_bytes() == before


def test_retention_keeps_newest_committed(tmp_path: Path) -> None:
    save_steps(tmp_path, range(1, 6), keep=2)
    assert committed_steps(tmp_path) == [4, 5]


def test_prune_never_drops_newest_committed_nor_a_newer_torn_save_nor_a_foreign_one(tmp_path: Path) -> None:
    save_steps(tmp_path, range(1, 4), keep=4)
    (tmp_path / "step-1" / COMMIT_FILE).unlink()  # whole, without a commit record: another tool's (foreign)
    for name in (COMMIT_FILE, ".metadata"):
        (tmp_path / "step-2" / name).unlink()  # torn, older than the newest committed
    (tmp_path / "step-5").mkdir()  # torn, newer: may be a save in flight
    deleted = prune(tmp_path, keep=1)
    assert sorted(path.name for path in deleted) == ["step-0", "step-2"]
    assert [(entry.step, entry.state.value) for entry in scan(tmp_path)] == [
        (1, "foreign"),
        (3, "committed"),
        (5, "torn"),
    ]
    with pytest.raises(ValueError, match="keep must be at least 1"):
        prune(tmp_path, keep=0)


class FailingWrite:
    """Stands in for FileSystemWriter.write_data on the background thread; ``called`` says it ran."""

    def __init__(self) -> None:
        self.called = threading.Event()

    def __call__(self, *args, **kwargs):
        self.called.set()
        raise OSError(28, "No space left on device")


def test_background_failure_is_raised_at_wait_and_never_committed(tmp_path: Path, monkeypatch) -> None:
    state = make_state(seed=0)
    manager = CheckpointManager(tmp_path, keep=1)
    manager.load_latest(state)
    train(state, 1)
    manager.save(1, state)
    manager.wait()
    monkeypatch.setattr(FileSystemWriter, "write_data", FailingWrite())
    train(state, 2)
    manager.save(2, state)  # returns: the failure happens in the background
    with pytest.raises(RankFailure, match="No space left on device"):
        manager.wait()
    monkeypatch.undo()
    manager.close()
    assert committed_steps(tmp_path) == [1], "a failed save must not commit, nor let retention drop step 1"
    assert load_into_fresh(tmp_path)[0] == 1


def test_background_failure_is_raised_at_the_next_save(tmp_path: Path, monkeypatch) -> None:
    state = make_state(seed=0)
    manager = CheckpointManager(tmp_path, check_at_start=False)
    failing_write = FailingWrite()
    monkeypatch.setattr(FileSystemWriter, "write_data", failing_write)
    manager.save(1, state)
    assert failing_write.called.wait(timeout=30)
    monkeypatch.undo()
    with pytest.raises(RankFailure, match="background save of step 1"):
        manager.save(2, state)
    manager.save(2, state)  # the failure was reported once; the manager keeps working
    manager.close()
    assert committed_steps(tmp_path) == [2]


def aborting_write(write):
    """FileSystemWriter.write_data that aborts the process groups first, as elastic.run does when a new round is
    offered: an NCCL collective the abort ended returns without error, so what follows looks fine."""

    def write_data(self, *args, **kwargs):
        process_groups.abort_all()
        return write(self, *args, **kwargs)

    return write_data


@pytest.mark.parametrize("async_save", [True, False])
def test_a_save_the_groups_were_aborted_during_is_never_committed(
    tmp_path: Path, monkeypatch, async_save: bool
) -> None:
    state = make_state(seed=0)
    manager = CheckpointManager(tmp_path, async_save=async_save)
    manager.load_latest(state)
    train(state, 1)
    manager.save(1, state)
    manager.wait()
    monkeypatch.setattr(FileSystemWriter, "write_data", aborting_write(FileSystemWriter.write_data))
    train(state, 2)
    with pytest.raises(RankFailure, match="aborted for a new round"):
        manager.save(2, state)
        manager.wait()
    monkeypatch.undo()
    manager.save(3, state)  # groups aborted before a save began do not stop it
    manager.close()
    assert committed_steps(tmp_path) == [0, 1, 3]


def test_keep_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep"):
        CheckpointManager(tmp_path, keep=0)


def test_full_disk_fails_at_step_zero_naming_directory_and_cause(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(FileSystemWriter, "write_data", FailingWrite())
    manager = CheckpointManager(tmp_path / "full")
    with pytest.raises(CheckpointError) as failure:
        manager.load_latest(make_state(seed=0))
    manager.close()
    message = str(failure.value)
    assert f"checkpoint directory {tmp_path / 'full'} failed the step-0 check" in message
    assert "No space left on device" in message and "\n" not in message
    assert committed_steps(tmp_path / "full") == []


def test_model_without_optimizer_round_trips(tmp_path: Path) -> None:
    # Only tensors: every read takes the reader's byte-range path, none DCP's.
    torch.manual_seed(0)
    saved = torch.nn.Linear(4, 3)
    manager = CheckpointManager(tmp_path, async_save=False, check_at_start=False)
    manager.save(1, {"model": ModelState(saved)})
    manager.close()
    loaded = torch.nn.Linear(4, 3)
    manager = CheckpointManager(tmp_path, check_at_start=False)
    assert manager.load_latest({"model": ModelState(loaded)}) == 1
    manager.close()
    assert torch.equal(loaded.weight, saved.weight) and torch.equal(loaded.bias, saved.bias)


@pytest.mark.timeout(10)
def test_snapshots_that_failed_are_tried_again_less_and_less_often():
    pause = SnapshotPause()
    assert pause.over(1) and not pause.resumed(), "nothing failed: no pause"
    assert [pause.failed(step, every=2) for step in (2, 4, 8, 16)] == [4, 8, 16, 32], "after 1, 2, 4, 8 snapshots"
    assert not pause.over(31) and pause.over(32)
    for _ in range(10):
        pause.failed(100, every=1)
    assert pause.retry_at == 100 + 2**SnapshotPause.MAX_DOUBLINGS, "never further apart than 64 snapshots"
    assert pause.resumed() and pause.over(101) and pause.failed(101, every=1) == 102, "a success starts over"
