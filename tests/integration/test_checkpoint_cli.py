"""elastic-ckpt: list, inspect, convert, adopt, prune, and one-line errors with a non-zero exit."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elastic.checkpoint import CheckpointManager, ModelState
from elastic.checkpoint.cli import main
from elastic.checkpoint.layout import COMMIT_FILE

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    """Committed steps 0, 1, 2 of a Linear(4, 3) + AdamW, a foreign step-3 (whole, no commit record: another
    tool's), and a torn step-4 (no DCP metadata: a save that did not finish)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    state = {"model": ModelState(model, torch.optim.AdamW(model.parameters())), "progress": {"step": 0}}
    manager = CheckpointManager(tmp_path, async_save=False)
    manager.load_latest(state)
    for step in (1, 2):
        state["progress"]["step"] = step
        manager.save(step, state)
    manager.close()
    for step, removed in ((3, [COMMIT_FILE]), (4, [COMMIT_FILE, ".metadata"])):
        shutil.copytree(tmp_path / "step-2", tmp_path / f"step-{step}")
        for name in removed:
            (tmp_path / f"step-{step}" / name).unlink()
    return tmp_path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_list_json(directory: Path, capsys) -> None:
    code, out, _ = run(capsys, "list", directory, "--json")
    rows = json.loads(out)
    assert code == 0
    assert [(row["step"], row["state"], row["world_size"]) for row in rows] == [
        (0, "committed", 1),
        (1, "committed", 1),
        (2, "committed", 1),
        (3, "foreign", 1),
        (4, "torn", None),
    ]
    assert all(row["bytes"] > 0 for row in rows) and rows[0]["time"] and rows[3]["time"] is None
    assert "elastic-ckpt adopt" in rows[3]["problem"] and "no commit.json and no DCP .metadata" in rows[4]["problem"]


def test_list_table(directory: Path, capsys) -> None:
    code, out, _ = run(capsys, "list", directory)
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["step", "state", "world", "size", "time"]
    assert lines[3].split()[:3] == ["2", "committed", "1"] and lines[4].split()[:3] == ["3", "foreign", "1"]
    assert lines[5].split()[:3] == ["4", "torn", "-"]


def test_inspect_newest_and_given_step(directory: Path, capsys) -> None:
    code, out, _ = run(capsys, "inspect", directory)  # the newest whole one: the foreign step-3
    assert code == 0 and out.startswith(f"{directory / 'step-3'}: step 3, foreign")
    code, out, _ = run(capsys, "inspect", directory, "2")
    assert code == 0 and out.startswith(f"{directory / 'step-2'}: step 2, saved by 1 ranks")
    assert "  model.model.weight  float32  3x4" in out and "  model.optimizer.state.bias.exp_avg  float32  3" in out
    assert "  progress.step  object" in out
    code, out, _ = run(capsys, "inspect", directory, "1")
    assert code == 0 and "step 1" in out.splitlines()[0]


def test_foreign_checkpoint_is_inspected_converted_and_adopted(directory: Path, tmp_path_factory, capsys) -> None:
    code, out, _ = run(capsys, "inspect", directory, "3")
    assert code == 0 and out.startswith(f"{directory / 'step-3'}: step 3, foreign")
    assert "written by 1 ranks" in out and f"elastic-ckpt adopt {directory} 3" in out
    assert "  model.model.weight  float32  3x4" in out
    out_file = tmp_path_factory.mktemp("converted") / "step3.pt"
    assert run(capsys, "convert", directory, "3", "--to-torch", out_file)[0] == 0
    assert torch.load(out_file, weights_only=False)["progress"]["step"] == 2
    manager = CheckpointManager(directory, check_at_start=False)  # without adopt_foreign: step 3 is not loaded
    state = {"model": ModelState(torch.nn.Linear(4, 3)), "progress": {"step": 0}}
    assert manager.load_latest(state) == 2
    manager.close()
    code, out, _ = run(capsys, "adopt", directory)
    assert code == 0 and out == f"adopted {directory / 'step-3'}\n"
    assert [row["state"] for row in json.loads(run(capsys, "list", directory, "--json")[1])][3:] == [
        "committed",
        "torn",
    ]
    code, out, _ = run(capsys, "inspect", directory, "3")
    assert code == 0 and "step 3, saved by 1 ranks" in out and out.splitlines()[0].endswith(", adopted")
    assert run(capsys, "adopt", directory)[1].endswith(
        "holds no foreign checkpoint (a whole DCP checkpoint without a commit record)\n"
    )


@pytest.mark.parametrize(
    "argv, problem",
    [
        (["inspect", "{dir}", "4"], "step-4 is torn: it has no commit.json and no DCP .metadata"),
        (["inspect", "{dir}", "9"], "step-9 does not exist"),
        (["list", "{dir}/missing"], "missing is not a directory"),
        (["convert", "{dir}", "4", "--to-torch", "{dir}/out.pt"], "step-4 is torn"),
        (["adopt", "{dir}", "4"], "cannot adopt {dir}/step-4: {dir}/step-4 is torn"),
        (["adopt", "{dir}", "2"], "cannot adopt {dir}/step-2: it is committed already"),
        (["convert", "{dir}", "2", "--from-torch", "{dir}/nothing.pt"], "nothing.pt is not a file"),
        (["prune", "{dir}/missing", "--keep", "1"], "missing is not a directory"),
    ],
)
def test_bad_input_gets_one_line_and_nonzero_exit(directory: Path, capsys, argv: list[str], problem: str) -> None:
    code, out, err = run(capsys, *[arg.format(dir=directory) for arg in argv])
    assert code == 1 and out == ""
    assert err.startswith("elastic-ckpt: error: ") and err.count("\n") == 1 and problem.format(dir=directory) in err


def test_convert_to_torch_and_back(directory: Path, tmp_path_factory, capsys) -> None:
    out_file = tmp_path_factory.mktemp("converted") / "step2.pt"
    code, _, _ = run(capsys, "convert", directory, "2", "--to-torch", out_file)
    assert code == 0
    flat = torch.load(out_file, weights_only=False)
    assert flat["model"]["model"]["weight"].shape == (3, 4) and flat["progress"]["step"] == 2
    code, _, _ = run(capsys, "convert", directory, "7", "--from-torch", out_file)
    assert code == 0
    restored = torch.nn.Linear(4, 3)
    state = {"model": ModelState(restored, torch.optim.AdamW(restored.parameters())), "progress": {"step": 0}}
    manager = CheckpointManager(directory, check_at_start=False)
    assert manager.load_latest(state) == 7
    manager.close()
    assert torch.equal(restored.weight, flat["model"]["model"]["weight"]) and state["progress"]["step"] == 2
    code, _, err = run(capsys, "convert", directory, "7", "--from-torch", out_file)
    assert code == 1 and "step-7 already exists" in err


def test_prune_keeps_newest(directory: Path, capsys) -> None:
    code, out, _ = run(capsys, "prune", directory, "--keep", "1")
    assert code == 0 and "deleted 2 folder(s)" in out
    # Hidden entries are the directory's fence (.elastic-fence), which decides which save may commit.
    # The foreign step-3 is not counted nor deleted; the torn step-4 is newer than the newest committed: kept.
    assert sorted(path.name for path in directory.iterdir() if not path.name.startswith(".")) == [
        "step-2",
        "step-3",
        "step-4",
    ]


def test_console_script_runs(directory: Path) -> None:
    script = Path(sys.executable).with_name("elastic-ckpt")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "elastic.checkpoint.cli"]
    done = subprocess.run([*command, "list", str(directory / "nope")], capture_output=True, text=True, timeout=50)
    assert done.returncode == 1 and done.stderr.strip().endswith("pass the directory that holds the step-<N> folders")
