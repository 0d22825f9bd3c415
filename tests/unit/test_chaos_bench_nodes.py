"""bench/chaos_bench.py's elastic-run nodes: on CUDA, NCCL on each node with a host id of its own (so that the
simulated nodes of one machine can share its GPUs); --no-inprocess passed through to elastic-run; a join counted
when the node registered."""

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
