"""Runs of examples/train.py: resized, failed, loading foreign checkpoints, refusing bad flags.

Each scenario is compared with one uninterrupted 2-rank run of the same configuration:
same samples per step, same learning rate per step, losses equal up to float rounding.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from example_modules import load_example
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from elastic.checkpoint import write_commit_record

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TRAIN = Path(__file__).resolve().parents[2] / "examples" / "train.py"
STEPS = 12
GLOBAL_BATCH = 8
# 1200 characters in windows of 32 make 37 sequences, so 12 steps of 8 cross two epoch boundaries mid-step.
DATASET_SIZE = 37
TINY_RUN = [
    "--steps",
    str(STEPS),
    "--global-batch",
    str(GLOBAL_BATCH),
    "--micro-batch",
    "2",
    "--seed",
    "3",
    "--lr",
    "3e-3",
    "--warmup-steps",
    "3",
    "--ckpt-every",
    "4",
    "--seq-len",
    "32",
    "--d-model",
    "32",
    "--n-layer",
    "2",
    "--n-head",
    "2",
    "--dropout",
    "0.1",
    "--corpus-chars",
    "1200",
]

# Loss tolerance. Every world size computes the same math, but fp32 sums run in another order:
# another micro-batch composition changes the BLAS blocking of the matmuls, and FSDP's gradient
# reduce-scatter adds 1, 2 or 3 shards. Each reordering moves a sum by about one fp32 ulp
# (2**-24 ~ 6e-8 relative) and AdamW carries that into the weights of later steps. Measured
# over these 12 steps: largest relative loss difference 2e-8 (printed by the resize test).
# 1e-6 (~16 ulps) leaves a 50x margin. It still catches the smallest real bug we know: weighting
# each rank's mean loss equally (plain DDP averaging) instead of by its share of an uneven
# global batch moves the next step's loss by 1.7e-4; a wrong sample or dropout mask by ~1e-2.
LOSS_RTOL = 1e-6


def torchrun(
    nproc: int, log: Path, ckpt: Path, *extra: str, round_number: int = 0, timeout: float = 120
) -> subprocess.CompletedProcess:
    """Run the trainer on `nproc` local ranks; kill the whole launch on timeout."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        str(TRAIN),
        *TINY_RUN,
        "--ckpt-dir",
        str(ckpt),
        "--sample-log",
        str(log),
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ELASTIC_ROUND": str(round_number)}
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"torchrun with {nproc} ranks ran past {timeout}s:\n{output[-4000:]}")
    return subprocess.CompletedProcess(command, process.returncode, output)


def expect_success(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout[-4000:]
    return result.stdout


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def committed_history(records: list[dict]) -> dict[int, list[dict]]:
    """Per step, the records of the last round that ran it (a redone step supersedes the failed one), by rank."""
    latest_round: dict[int, int] = {}
    for record in records:
        latest_round[record["step"]] = max(latest_round.get(record["step"], -1), record["round"])
    history: dict[int, list[dict]] = defaultdict(list)
    for record in records:
        if record["round"] == latest_round[record["step"]]:
            history[record["step"]].append(record)
    for step_records in history.values():
        step_records.sort(key=lambda record: record["rank"])
        assert [r["rank"] for r in step_records] == list(range(step_records[0]["world_size"]))
    return dict(history)


def step_samples(step_records: list[dict]) -> list[int]:
    """The step's global batch in stream order: rank shares are contiguous and in rank order."""
    return [index for record in step_records for index in record["samples"]]


def step_value(step_records: list[dict], key: str) -> float:
    values = {record[key] for record in step_records}
    assert len(values) == 1, f"ranks disagree on {key}: {values}"
    return values.pop()


def assert_follows(reference: dict[int, list[dict]], history: dict[int, list[dict]], steps: range) -> float:
    """Same samples, bitwise the same LR, losses within LOSS_RTOL; returns the largest relative loss difference."""
    largest = 0.0
    for step in steps:
        assert step_samples(history[step]) == step_samples(reference[step]), f"step {step}"
        assert step_value(history[step], "lr") == step_value(reference[step], "lr"), f"step {step}"
        expected, got = step_value(reference[step], "loss"), step_value(history[step], "loss")
        largest = max(largest, abs(got - expected) / abs(expected))
        assert got == pytest.approx(expected, rel=LOSS_RTOL), f"step {step}"
    return largest


def assert_exactly_once(history: dict[int, list[dict]]) -> None:
    """Cut the committed stream into epochs: each full one is a permutation of the dataset, none repeats a sample."""
    stream = [index for step in sorted(history) for index in step_samples(history[step])]
    assert sorted(history) == list(range(1, len(history) + 1)), "a step is missing from the committed history"
    for start in range(0, len(stream), DATASET_SIZE):
        epoch = Counter(stream[start : start + DATASET_SIZE])
        assert max(epoch.values()) == 1, f"epoch {start // DATASET_SIZE} repeats {epoch.most_common(1)}"
        if start + DATASET_SIZE <= len(stream):
            assert set(epoch) == set(range(DATASET_SIZE)), f"epoch {start // DATASET_SIZE} misses samples"


@pytest.fixture(scope="module")
def fixed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, list[dict]], Path]:
    """The uninterrupted 2-rank run every scenario is compared with, and its checkpoint directory."""
    root = tmp_path_factory.mktemp("fixed")
    log, ckpt = root / "samples.jsonl", root / "ckpt"
    expect_success(torchrun(2, log, ckpt))
    history = committed_history(read_log(log))
    assert sorted(history) == list(range(1, STEPS + 1))
    assert_exactly_once(history)
    return history, ckpt


def test_resized_run_matches_the_fixed_run(fixed_run: tuple[dict, Path], tmp_path: Path) -> None:
    reference, _ = fixed_run
    log, ckpt = tmp_path / "samples.jsonl", tmp_path / "ckpt"
    expect_success(torchrun(2, log, ckpt, "--stop-at", "4", round_number=0))
    expect_success(torchrun(3, log, ckpt, "--stop-at", "8", round_number=1))
    expect_success(torchrun(1, log, ckpt, round_number=2))

    history = committed_history(read_log(log))
    assert [history[step][0]["world_size"] for step in range(1, STEPS + 1)] == [2] * 4 + [3] * 4 + [1] * 4
    # Uneven shares at 3 ranks: 8 samples split 3, 3, 2, and the loss still matches (weighting is right).
    assert all([len(r["samples"]) for r in history[step]] == [3, 3, 2] for step in range(5, 9))
    largest = assert_follows(reference, history, range(1, STEPS + 1))
    assert_exactly_once(history)

    print(f"\nper-step loss, fixed 2 ranks vs resized 2 -> 3 -> 1 (largest relative difference {largest:.2e}):")
    for step in range(1, STEPS + 1):
        fixed, resized = step_value(reference[step], "loss"), step_value(history[step], "loss")
        print(
            f"  step {step:2d}  world {history[step][0]['world_size']}  fixed {fixed:.7f}  resized {resized:.7f}  "
            f"rel {abs(resized - fixed) / fixed:.1e}"
        )


def test_failure_redoes_uncommitted_steps_with_the_same_samples(fixed_run: tuple[dict, Path], tmp_path: Path) -> None:
    reference, _ = fixed_run
    log, ckpt = tmp_path / "samples.jsonl", tmp_path / "ckpt"
    crashed = torchrun(2, log, ckpt, "--ckpt-every", "2", "--crash-at", "7", round_number=0)
    assert crashed.returncode != 0 and "simulated failure after step 7" in crashed.stdout, crashed.stdout[-4000:]
    failed_steps = {record["step"] for record in read_log(log)}
    assert max(failed_steps) == 7

    expect_success(torchrun(3, log, ckpt, "--num-workers", "1", round_number=1))
    records = read_log(log)
    resumed_from = min(r["step"] for r in records if r["round"] == 1) - 1
    assert resumed_from in (4, 6), "the last commit before the crash is step 4 or 6 (6 may still be in flight)"

    redone = range(resumed_from + 1, 8)
    for step in redone:
        before = [r for r in records if r["step"] == step and r["round"] == 0]
        after = [r for r in records if r["step"] == step and r["round"] == 1]
        assert sorted(step_samples(before)) == sorted(step_samples(after)), f"step {step} redone with other samples"

    history = committed_history(records)
    assert_exactly_once(history)
    assert_follows(reference, history, range(1, STEPS + 1))


def rewrite_in_torchtitan_layout(source: Path, target: Path, step: int, world_size: int) -> None:
    """Copy a checkpoint, replacing its "dataloader" entry by torchtitan's per-rank layout.

    torchtitan's dataloader saves `{"dp_rank_<r>": pickled state, "world_size": n}` on each rank,
    so the checkpoint holds dataloader.dp_rank_0 .. dataloader.dp_rank_<n-1>.
    """
    metadata = FileSystemReader(source).read_metadata()
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype) if isinstance(meta, TensorStorageMetadata) else None
        for key, meta in metadata.state_dict_metadata.items()
    }
    dcp.load(state, checkpoint_id=source)
    assert {"dataloader.samples_consumed", "dataloader.seed", "dataloader.epoch"} <= set(state)
    state = {key: value for key, value in state.items() if not key.startswith("dataloader.")}
    for rank in range(world_size):
        state[f"dataloader.dp_rank_{rank}"] = pickle.dumps({"sample_in_epoch": 999, "rank": rank})
    state["dataloader.world_size"] = world_size
    dcp.save(state, checkpoint_id=target)
    write_commit_record(target, step, world_size)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the rewrite runs in this one process
def test_torchtitan_layout_loads_at_a_larger_world_size(fixed_run: tuple[dict, Path], tmp_path: Path) -> None:
    reference, fixed_ckpt = fixed_run
    ckpt = tmp_path / "ckpt"
    rewrite_in_torchtitan_layout(fixed_ckpt / "step-4", ckpt / "step-4", step=4, world_size=2)

    log = tmp_path / "samples.jsonl"
    output = expect_success(torchrun(3, log, ckpt, "--stop-at", "8", round_number=1))
    warnings = [line for line in output.splitlines() if "WARNING" in line and "regenerated" in line]
    assert len(warnings) == 1, output[-4000:]
    assert "'dataloader'" in warnings[0] and "dp_rank_{0..1}" in warnings[0] and "step 4" in warnings[0]

    history = committed_history(read_log(log))
    assert sorted(history) == [5, 6, 7, 8]
    assert_follows(reference, history, range(5, 9))


@pytest.mark.timeout(60)
def test_inconsistent_flags_fail_before_any_process_group_starts() -> None:
    result = subprocess.run(
        [sys.executable, str(TRAIN), "--steps", "10", "--stop-at", "12", "--ckpt-dir", "unused", "--d-model", "30"],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert result.returncode == 2
    assert "--stop-at (12) is past the last step (--steps 10)" in result.stderr
    assert "--d-model (30) must be a multiple of --n-head (4)" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--global-batch", "8", "--micro-batch", "16"], "--micro-batch (16) is larger than --global-batch (8)"),
        (["--corpus-chars", "10", "--seq-len", "64"], "--corpus-chars (10) must exceed --seq-len (64)"),
        (["--global-batch", "0"], "--global-batch: Input should be greater than 0"),
        (["--device", "gpu"], "--device: Input should be 'auto', 'cpu' or 'cuda'"),
        (["--backend", "mpi"], "--backend: Input should be 'auto', 'gloo' or 'nccl'"),
    ],
)
def test_each_bad_flag_is_one_line_and_exit_2(flags: list[str], message: str, monkeypatch, capsys) -> None:
    # in this process: the script's start is proven above, and importing torch once per flag took 3 s each
    monkeypatch.setattr(sys, "argv", [str(TRAIN), *flags])
    with pytest.raises(SystemExit) as exited:
        load_example("train").parse_config(flags)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("train.py: error: ") and message in lines[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--device", "cuda"], "train.py: --device cuda: no CUDA device is visible here; pass --device cpu (or auto)"),
        (
            ["--backend", "nccl"],
            "train.py: --backend nccl needs CUDA tensors: pass --backend gloo (or auto) for --device cpu",
        ),
    ],
)
def test_a_device_or_backend_this_machine_lacks_is_one_line_before_any_process_group(flags, message) -> None:
    no_gpu = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # a machine without CUDA, whatever this one has
    result = subprocess.run(
        [sys.executable, str(TRAIN), *flags], capture_output=True, text=True, timeout=50, env=no_gpu
    )
    assert result.returncode == 1 and result.stderr.strip() == message
