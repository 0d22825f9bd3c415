"""bench/chaos_bench.py's elastic-run nodes: on CUDA, NCCL on each node with a host id of its own (so that the
simulated nodes of one machine can share its GPUs); --no-inprocess passed through to elastic-run; a join counted
when the node registered; the fault-free baseline bracketing the chaos run."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import chaos_bench  # noqa: E402

pytestmark = pytest.mark.timeout(60)


class RecordingJob(SimpleNamespace):
    def start_agent(self, node: int, command: list[str], env: dict[str, str] | None = None) -> None:
        self.agents.append((command, env or {}))


def started_nodes(argv: list[str], nodes: int = 3) -> list[tuple[list[str], dict[str, str]]]:
    args = chaos_bench.parse_args(argv)
    system = chaos_bench.ElasticRun(args)
    etcd = SimpleNamespace(endpoint="127.0.0.1:2379")
    job = RecordingJob(agents=[], etcd=etcd, rdzv_id="bench-x", workdir=Path("/w"))
    job.log_dir = lambda node: Path(f"/w/node{node}")
    for slot in range(nodes):
        system.start_node(job, slot)  # type: ignore[arg-type]
    return job.agents


def test_cpu_nodes_train_on_gloo_in_process_by_default() -> None:
    for command, env in started_nodes([]):
        assert "--device" not in command and "--no-inprocess" not in command and "NCCL_HOSTID" not in env


def test_no_inprocess_reaches_elastic_run_not_the_script() -> None:
    for command, _ in started_nodes(["--no-inprocess"]):
        assert command.index("--no-inprocess") < command.index(str(chaos_bench.TRAIN))


def test_cuda_without_a_gpu_is_refused_naming_the_count(capsys, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(SystemExit):
        chaos_bench.parse_args(["--device", "cuda", "--nproc", "1"])
    assert "0 GPU(s) visible" in capsys.readouterr().err


def test_cuda_nodes_use_nccl_each_a_host_of_its_own(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    nodes = started_nodes(["--device", "cuda", "--nproc", "1"])
    for command, _ in nodes:
        script = command[command.index(str(chaos_bench.TRAIN)) :]
        assert script[script.index("--device") + 1] == "cuda" and script[script.index("--backend") + 1] == "nccl"
    host_ids = [env["NCCL_HOSTID"] for _, env in nodes]
    assert len(set(host_ids)) == len(nodes)


def test_a_join_counts_when_the_node_registered_not_when_it_started() -> None:
    changes = [
        chaos_bench.Change(100.0, "kill node1"),
        chaos_bench.Change(105.0, "node3 joins"),
        chaos_bench.Change(120.0, "node4 joins"),
    ]
    moved = chaos_bench.joins_when_registered(changes, {"node3": 114.5, "node1": 1.0})
    assert [(c.at, c.what) for c in moved] == [(100.0, "kill node1"), (114.5, "node3 joins"), (120.0, "node4 joins")]


def steps_every(interval: float, until: float, gaps: dict[float, float]) -> list[tuple[float, int, int]]:
    """Committed steps every `interval` s from 0; after the first step at or past each time in `gaps`, a pause of
    that length instead."""
    steps, now, pending = [], 0.0, sorted(gaps.items())
    while now <= until:
        steps.append((now, len(steps) + 1, 6))
        if pending and now >= pending[0][0]:
            now += pending.pop(0)[1]
        else:
            now += interval
    return steps


def test_every_change_gets_its_own_pause_however_short() -> None:
    # steps every 0.25 s; a 0.9 s pause begins at 10.0 (a kill at 10.1), a 1.9 s one at 25.0 (a stop at 24.0, found
    # after a stall), and a join at 30.0 costs nothing
    steps = steps_every(0.25, 40.0, {10.0: 0.9, 25.0: 1.9})
    changes = [
        chaos_bench.Change(30.0, "node4 joins"),
        chaos_bench.Change(10.1, "kill node1"),
        chaos_bench.Change(24.0, "stop node2"),
    ]
    pauses = chaos_bench.change_pauses(steps, changes, window_s=6.0)
    assert [(p["what"], p["s"]) for p in pauses] == [("kill node1", 0.9), ("stop node2", 1.9), ("node4 joins", 0.25)]
    after = {p["what"]: p["after_step"] for p in pauses}
    assert after["kill node1"] == next(step for at, step, _ in steps if at >= 10.0)


def test_a_gap_long_after_a_change_is_not_its_pause() -> None:
    steps = steps_every(0.25, 30.0, {20.0: 3.0})
    pauses = chaos_bench.change_pauses(steps, [chaos_bench.Change(10.0, "crash node0")], window_s=6.0)
    assert [(p["what"], p["s"]) for p in pauses] == [("crash node0", 0.25)]


def test_a_join_just_before_a_fault_does_not_take_the_faults_pause() -> None:
    steps = steps_every(0.25, 30.0, {15.0: 0.8})  # a kill at 15.1 pauses the step in progress
    changes = [chaos_bench.Change(10.0, "node6 joins"), chaos_bench.Change(15.1, "kill node3")]
    pauses = chaos_bench.change_pauses(steps, changes, window_s=6.0)
    assert [(p["what"], p["s"]) for p in pauses] == [("node6 joins", 0.25), ("kill node3", 0.8)]


@pytest.mark.parametrize(
    "kind, node, controller, label",
    [
        ("stop", "node0", "node0", "stop node0, the controller's"),
        ("stop", "node1", "node0", "stop node1"),
        ("kill", "node2", None, "kill node2"),
    ],
)
def test_a_fault_on_the_controllers_node_is_named_so(kind, node, controller, label) -> None:
    assert chaos_bench.fault_label(kind, node, controller) == label
    assert label.split()[0] == kind  # the faults by kind are counted from the first word


def test_the_bracketed_baseline_is_the_mean_of_the_fault_free_runs_rates() -> None:
    """A machine that slowed from 4 to 3.2 steps per second between the runs before and after the chaos run:
    the baseline is 3.6, not the first run's 4, which would charge the drift to the chaos run."""
    before = (SimpleNamespace(cut_at=None), steps_every(0.25, 20.0, {}))
    after = (SimpleNamespace(cut_at=None), steps_every(0.3125, 25.0, {}))
    assert chaos_bench.fault_free_rate([before], False) == pytest.approx(4.0)
    assert chaos_bench.fault_free_rate([before, after], False) == pytest.approx(3.6)
