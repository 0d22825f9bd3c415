"""Fenced checkpoints: saves of two rounds never mix, a stale round never commits, damaged steps are set aside.

Rounds are simulated as elastic-run does it: ELASTIC_ROUND and TORCHELASTIC_RUN_ID in the environment
of the process that creates the CheckpointManager. A stale round is a manager of an older round whose
background write is held at a chosen point (a Gate) while a newer round saves, then let go.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from multiproc import Job, run_ranks
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from elastic.checkpoint import CheckpointManager, ModelState
from elastic.checkpoint.cli import main as cli_main
from elastic.checkpoint.layout import COMMIT_FILE, scan
from elastic.checkpoint.ranks import RankFailure
from elastic.checkpoint.retention import prune
from elastic.checkpoint.writer import CheckpointWriter

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

RUN_ID = "fencing-test"


def model_state(value: float) -> dict:
    """A tiny model whose every weight is ``value``, so a load shows which save it came from."""
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.fill_(value)
        model.bias.fill_(value)
    return {"model": ModelState(model), "progress": {"value": value}}


def loaded_value(directory: Path, monkeypatch, step: int) -> float:
    """Load the newest checkpoint of ``directory`` in a fresh manager; check it is ``step`` and return its value."""
    state = model_state(-1.0)
    manager = round_manager(directory, 99, monkeypatch)
    assert manager.load_latest(state) == step
    manager.close()
    weight = state["model"].model.weight
    assert torch.all(weight == weight.flatten()[0]) and state["progress"]["value"] == weight.flatten()[0].item()
    return weight.flatten()[0].item()


def round_manager(directory: Path, round_: int, monkeypatch, **options) -> CheckpointManager:
    monkeypatch.setenv("ELASTIC_ROUND", str(round_))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", RUN_ID)
    options.setdefault("check_at_start", False)
    return CheckpointManager(directory, **options)


def commit_record(folder: Path) -> dict:
    return json.loads((folder / COMMIT_FILE).read_text())


def digests(folder: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(folder.iterdir())}


def committed_steps(directory: Path) -> list[int]:
    return [entry.step for entry in scan(directory) if entry.committed]


def wait_for(path: Path) -> None:
    deadline = time.monotonic() + 30
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


class Gate:
    """Holds the background write of round-0 saves at one point until the test opens it."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.opened = threading.Event()

    def hold(self) -> None:
        self.reached.set()
        assert self.opened.wait(30), "the test never opened the gate"

    def wait_reached(self) -> None:
        assert self.reached.wait(30), "the round-0 save never reached the gate"


def is_round0(writer: FileSystemWriter) -> bool:
    return "-r0-" in Path(writer.path).name


def hold_round0_before_writing(monkeypatch, gate: Gate, scribble: bool = False) -> None:
    """Round-0 writers stop before writing their data; with ``scribble`` they hold an open data file
    and, once let go, write junk into it before DCP writes: a stale writer that keeps on writing."""
    write_data = FileSystemWriter.write_data

    def held(self, plan, planner):
        if not is_round0(self):
            return write_data(self, plan, planner)
        stale = open(Path(self.path) / "__0_0.distcp", "wb") if scribble else None
        gate.hold()
        if stale is not None:
            stale.write(b"\xff" * 65536)
            stale.flush()
            stale.close()
        return write_data(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", held)


def hold_round0_before_commit(monkeypatch, gate: Gate) -> None:
    """Round-0 saves stop once their data and metadata are durable, right before rank 0 commits."""
    finish = CheckpointWriter.finish

    def held(self, metadata, results):
        finish(self, metadata, results)
        if is_round0(self):
            gate.hold()

    monkeypatch.setattr(CheckpointWriter, "finish", held)


def test_same_step_from_two_rounds_commits_only_the_newer_rounds_files(tmp_path: Path, monkeypatch) -> None:
    # Leftovers of an earlier round-0 save of step 5 that died, plus a round-0 save of step 5 in flight.
    leftover = tmp_path / "step-5.attempt-e1-r0-0123456789abcdef"
    leftover.mkdir(parents=True)
    (leftover / "__0_0.distcp").write_bytes(b"old round")
    (leftover / "__1_0.distcp").write_bytes(b"old round, a rank the new round does not have")
    gate = Gate()
    hold_round0_before_writing(monkeypatch, gate)
    stale = round_manager(tmp_path, 0, monkeypatch)
    stale.save(5, model_state(0.0))
    gate.wait_reached()

    current = round_manager(tmp_path, 1, monkeypatch, async_save=False)
    current.save(5, model_state(1.0))
    current.close()
    gate.opened.set()
    with pytest.raises(RankFailure, match="background save of step 5"):
        stale.wait()
    stale.close()

    step5 = tmp_path / "step-5"
    assert {path.name for path in step5.iterdir()} == {".metadata", "__0_0.distcp", COMMIT_FILE}
    record = commit_record(step5)
    assert record["round"] == 1 and record["run_id"] == RUN_ID and record["attempt"] and record["epoch"] == 2
    assert loaded_value(tmp_path, monkeypatch, 5) == 1.0
    assert not list(tmp_path.glob("step-5.attempt-*")), "attempts of older rounds are deleted once the newer commits"


def test_commit_refuses_a_folder_whose_metadata_another_save_wrote(tmp_path: Path, monkeypatch) -> None:
    other = round_manager(tmp_path / "other", 0, monkeypatch, async_save=False)
    other.save(7, model_state(2.0))
    other.close()
    gate = Gate()
    hold_round0_before_commit(monkeypatch, gate)
    manager = round_manager(tmp_path, 0, monkeypatch)
    manager.save(7, model_state(0.0))
    gate.wait_reached()
    [attempt] = tmp_path.glob("step-7.attempt-*")
    (attempt / ".metadata").write_bytes((tmp_path / "other" / "step-7" / ".metadata").read_bytes())
    gate.opened.set()
    with pytest.raises(RankFailure, match=r"\.metadata is not the one its save wrote"):
        manager.wait()
    manager.close()
    assert committed_steps(tmp_path) == [] and not list(tmp_path.glob("step-7*"))


@pytest.mark.parametrize("newer_round_prunes_first", [True, False])
def test_stale_writer_still_writing_after_the_newer_commit_leaves_it_intact(
    tmp_path: Path, monkeypatch, newer_round_prunes_first: bool
) -> None:
    gate = Gate()
    hold_round0_before_writing(monkeypatch, gate, scribble=True)
    stale = round_manager(tmp_path, 0, monkeypatch)
    stale.save(5, model_state(0.0))
    gate.wait_reached()

    current = round_manager(tmp_path, 1, monkeypatch)  # async: its commit lands before wait() prunes
    current.save(5, model_state(1.0))
    wait_for(tmp_path / "step-5" / COMMIT_FILE)
    if newer_round_prunes_first:
        current.wait()  # the stale attempt's folder is renamed and deleted under its open file
    committed = digests(tmp_path / "step-5")
    gate.opened.set()  # the stale writer writes junk into its open file, then its whole save
    with pytest.raises(RankFailure, match="background save of step 5"):
        stale.wait()
    stale.close()
    current.close()

    assert digests(tmp_path / "step-5") == committed
    assert commit_record(tmp_path / "step-5")["round"] == 1
    assert loaded_value(tmp_path, monkeypatch, 5) == 1.0
    assert not list(tmp_path.glob("step-5.*")), "the stale save's folder is gone"


def test_complete_save_of_a_stale_round_is_refused_at_commit(tmp_path: Path, monkeypatch) -> None:
    gate = Gate()
    hold_round0_before_commit(monkeypatch, gate)
    stale = round_manager(tmp_path, 0, monkeypatch)
    stale.save(7, model_state(0.0))
    gate.wait_reached()  # every byte of step 7 is written; only the commit is left

    current = round_manager(tmp_path, 1, monkeypatch)
    current.save(3, model_state(1.0))  # the newer round's first save claims the directory
    wait_for(tmp_path / "step-3" / COMMIT_FILE)  # committed, not yet pruned: the stale folder is still whole
    gate.opened.set()
    with pytest.raises(RankFailure, match="this worker's round is no longer current"):
        stale.wait()
    stale.close()
    current.close()
    assert committed_steps(tmp_path) == [3]
    assert not list(tmp_path.glob("step-7*")), "the refused save's folder is deleted"
    assert loaded_value(tmp_path, monkeypatch, 3) == 1.0


def test_stale_commit_after_the_newer_round_listed_its_load_is_fenced_out(tmp_path: Path, monkeypatch) -> None:
    stale = round_manager(tmp_path, 0, monkeypatch, async_save=False)
    stale.save(1, model_state(0.5))
    current = round_manager(tmp_path, 1, monkeypatch, async_save=False)
    assert current.load_latest(model_state(1.0)) == 1
    stale.save(5, model_state(0.0))  # the newer round has loaded but not saved yet, so nothing refuses this
    stale.close()
    assert commit_record(tmp_path / "step-5")["round"] == 0

    current.save(2, model_state(1.0))  # its claim admits only what it loaded from: step 5 is fenced out
    [aside] = tmp_path.glob("step-5.fenced-*")
    assert commit_record(aside)["round"] == 0, "set aside as a whole, not deleted"
    assert committed_steps(tmp_path) == [1, 2]
    assert loaded_value(tmp_path, monkeypatch, 2) == 1.0
    current.save(5, model_state(1.0))
    current.close()
    assert commit_record(tmp_path / "step-5")["round"] == 1
    assert loaded_value(tmp_path, monkeypatch, 5) == 1.0


def test_stale_commit_slipping_between_fence_check_and_rename_is_never_loaded(
    tmp_path: Path, monkeypatch, caplog, capsys
) -> None:
    stale = round_manager(tmp_path, 0, monkeypatch, async_save=False)
    stale.save(1, model_state(0.5))
    current = round_manager(tmp_path, 1, monkeypatch, async_save=False)
    assert current.load_latest(model_state(1.0)) == 1
    current.save(2, model_state(1.0))  # claims the directory
    with monkeypatch.context() as race:
        # The stale commit passed its fence check just before that claim and renames just after it;
        # the stale worker is killed before it gets to prune.
        race.setattr("elastic.checkpoint.attempt.ensure_current", lambda *args: None)
        race.setattr(stale, "_prune", lambda: None)
        stale.save(5, model_state(0.0))
    stale.close()
    assert commit_record(tmp_path / "step-5")["round"] == 0
    assert [entry.step for entry in scan(tmp_path) if entry.fenced] == [5]
    assert cli_main(["list", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(row["step"], row["state"], row["round"]) for row in rows] == [
        (1, "committed", 0),
        (2, "committed", 1),
        (5, "fenced", 0),
    ]
    assert cli_main(["inspect", str(tmp_path), "5"]) == 1
    assert "its round was no longer current" in capsys.readouterr().err

    with caplog.at_level(logging.WARNING):
        assert loaded_value(tmp_path, monkeypatch, 2) == 1.0
    assert f"skipping fenced checkpoint {tmp_path / 'step-5'}" in caplog.text
    assert "its round was no longer current" in caplog.text
    current.save(5, model_state(1.0))  # the stale commit is set aside, never deleted, and step 5 saved anew
    current.close()
    assert commit_record(tmp_path / "step-5")["round"] == 1
    [aside] = tmp_path.glob("step-5.fenced-*")
    assert loaded_value(tmp_path, monkeypatch, 5) == 1.0
    assert cli_main(["list", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"set aside (not loaded): {aside.name}"


def damage(folder: Path, how: str) -> None:
    data_file = folder / "__0_0.distcp"
    if how == "truncated":
        data_file.write_bytes(data_file.read_bytes()[:100])
    elif how == "corrupted":  # same length, so only reading the bytes finds it
        data_file.write_bytes(b"\x00" * data_file.stat().st_size)
    else:  # another save's metadata: valid DCP, but not what this commit vouches for
        (folder / ".metadata").write_bytes((folder.parent / "step-2" / ".metadata").read_bytes())


@pytest.mark.parametrize("how", ["truncated", "corrupted", "metadata swapped"])
def test_unreadable_committed_step_is_set_aside_and_saved_again(tmp_path: Path, monkeypatch, caplog, how: str) -> None:
    manager = round_manager(tmp_path, 0, monkeypatch, keep=2)
    for step in (1, 2, 3):
        manager.save(step, model_state(float(step)))
    manager.close()
    assert committed_steps(tmp_path) == [2, 3]
    damage(tmp_path / "step-3", how)

    manager = round_manager(tmp_path, 1, monkeypatch, keep=2)
    state = model_state(-1.0)
    with caplog.at_level(logging.WARNING):
        assert manager.load_latest(state) == 2
    assert state["model"].model.weight.flatten()[0].item() == 2.0
    [set_aside] = tmp_path.glob("step-3.unreadable-*")
    assert f"set aside unreadable checkpoint {tmp_path / 'step-3'} as {set_aside}" in caplog.text
    assert committed_steps(tmp_path) == [2]

    manager.save(3, model_state(30.0))  # no "already committed": step 3 is saved again
    manager.wait()
    assert committed_steps(tmp_path) == [2, 3], "keep=2 keeps two readable checkpoints; step 2 is not deleted"
    manager.save(4, model_state(40.0))
    manager.close()
    assert committed_steps(tmp_path) == [3, 4]
    assert set_aside.exists(), "a set-aside checkpoint is never deleted"
    assert loaded_value(tmp_path, monkeypatch, 4) == 40.0
    (tmp_path / "step-4" / COMMIT_FILE).unlink()  # now step 3 is the newest: the one saved again
    assert loaded_value(tmp_path, monkeypatch, 3) == 30.0


def test_prune_sets_aside_an_unreadable_newest_and_keeps_readable_ones(tmp_path: Path, monkeypatch, caplog) -> None:
    manager = round_manager(tmp_path, 0, monkeypatch, keep=5, async_save=False)
    for step in (1, 2, 3):
        manager.save(step, model_state(float(step)))
    manager.close()
    damage(tmp_path / "step-3", "truncated")
    with caplog.at_level(logging.WARNING):
        deleted = prune(tmp_path, keep=2)
    assert [path.name for path in deleted] == []
    assert committed_steps(tmp_path) == [1, 2] and len(list(tmp_path.glob("step-3.unreadable-*"))) == 1
    assert f"set aside unreadable checkpoint {tmp_path / 'step-3'}" in caplog.text


# Two process groups, as two rounds of elastic-run: round 0's ranks are still writing step 1 when round 1's
# ranks save step 1 too.


def save_step1_in_round(rank: int, world_size: int, directory: str, round_: int, ready: str, go: str) -> str | None:
    os.environ["ELASTIC_ROUND"] = str(round_)
    os.environ["TORCHELASTIC_RUN_ID"] = RUN_ID
    if round_ == 0:
        write_data = FileSystemWriter.write_data

        def held(self, plan, planner):
            Path(f"{ready}.{rank}").touch()
            deadline = time.monotonic() + 60
            while not Path(go).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            return write_data(self, plan, planner)

        FileSystemWriter.write_data = held
    manager = CheckpointManager(directory, check_at_start=False, async_save=round_ == 0)
    model = torch.nn.Linear(8, 16)
    with torch.no_grad():
        model.weight.fill_(float(round_))
        model.bias.fill_(float(round_))
    manager.save(1, {"model": ModelState(model)})
    try:
        manager.wait()
        return None
    except RankFailure as error:
        return str(error)
    finally:
        manager.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_process_groups_racing_on_one_step(tmp_path: Path, monkeypatch) -> None:
    directory, ready, go = tmp_path / "ckpt", tmp_path / "ready", tmp_path / "go"
    stale = Job(2, save_step1_in_round, str(directory), 0, str(ready), str(go))
    try:
        deadline = time.monotonic() + 90
        while not all(Path(f"{ready}.{rank}").exists() for rank in range(2)):
            assert time.monotonic() < deadline, "round 0 never started writing step 1"
            time.sleep(0.1)
        assert run_ranks(2, save_step1_in_round, str(directory), 1, str(ready), str(go)) == [None, None]
        go.touch()
        failures = stale.join(timeout=90)
    finally:
        stale.kill()
    assert all(failure and "background save of step 1" in failure for failure in failures), failures

    step1 = directory / "step-1"
    record = commit_record(step1)
    assert record["round"] == 1 and record["world_size"] == 2 and record["epoch"] == 2
    named = {info.relative_path for info in FileSystemReader(step1).read_metadata().storage_data.values()}
    assert {path.name for path in step1.iterdir()} == named | {".metadata", COMMIT_FILE}
    loaded = torch.nn.Linear(8, 16)
    manager = round_manager(directory, 2, monkeypatch)
    assert manager.load_latest({"model": ModelState(loaded)}) == 1
    manager.close()
    assert torch.all(loaded.weight == 1.0) and torch.all(loaded.bias == 1.0), "every value is round 1's"
    assert [path.name for path in directory.iterdir() if not path.name.startswith(".")] == ["step-1"]
