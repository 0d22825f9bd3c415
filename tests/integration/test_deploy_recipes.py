"""The recipes in deploy/: every manifest parses, and every elastic-run command line in them parses with
elastic-run's own parser (its training script's with train.py's)."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from example_modules import load_example
from launcher_harness import REPO

from launcher.commands.cli import build_parser, config_from_args
from launcher.config import LaunchConfig

pytestmark = pytest.mark.timeout(60)
DEPLOY = REPO / "deploy"
# what Kubernetes or Slurm would put in place of a variable, and a GPU count where this machine has none
POD = {"POD_NAME": "gpt-train-1-abcde", "POD_IP": "10.1.2.3"}
SLURM = {
    "MIN_NODES": "2",
    "SLURM_NNODES": "4",
    "ETCD_ENDPOINTS": "node001:2379",
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NAME": "gpt-train",
}


def manifests() -> list[dict]:
    return [doc for path in sorted(DEPLOY.glob("kubernetes/*.yaml")) for doc in yaml.safe_load_all(path.read_text())]


def train_config(args: list[str]):
    return load_example("train").parse_config(args)


def parse(argv: list[str], monkeypatch) -> LaunchConfig:
    monkeypatch.chdir(REPO)  # the recipes run examples/train.py from the repository root
    argv = list(argv)
    for index, arg in enumerate(argv):  # no CUDA here to count
        argv[index] = arg.replace("--nproc-per-node=gpu", "--nproc-per-node=8")
        if arg == "gpu" and argv[index - 1] == "--nproc-per-node":
            argv[index] = "8"
    return config_from_args(build_parser().parse_args(argv))


def test_the_etcd_statefulset_has_three_members_behind_a_headless_service():
    kinds = {doc["kind"]: doc for doc in manifests() if doc["metadata"]["name"] == "etcd"}
    assert kinds["Service"]["spec"]["clusterIP"] == "None"
    statefulset = kinds["StatefulSet"]
    assert statefulset["spec"]["replicas"] == 3 and statefulset["spec"]["serviceName"] == "etcd"
    args = statefulset["spec"]["template"]["spec"]["containers"][0]["args"]
    cluster = next(a for a in args if a.startswith("--initial-cluster="))
    assert cluster.count("=http://etcd-") == 3


def test_every_elastic_run_in_the_kubernetes_manifests_parses(monkeypatch):
    commands = [
        (doc, c)
        for doc in manifests()
        if doc["kind"] in ("Job", "StatefulSet")
        for c in doc["spec"]["template"]["spec"]["containers"]
        if c.get("command") == ["elastic-run"]
    ]
    assert commands, "the training job runs elastic-run"
    endpoints = {f"etcd-{i}.etcd:2379" for i in range(3)}
    for doc, container in commands:
        argv = [re.sub(r"\$\((\w+)\)", lambda m: POD[m.group(1)], arg) for arg in container["args"]]
        config = parse(argv, monkeypatch)
        assert config.node_id == POD["POD_NAME"] and config.local_addr == POD["POD_IP"]
        assert set(config.rdzv_endpoint.split(",")) == endpoints
        assert doc["spec"]["completionMode"] == "Indexed" and doc["spec"]["completions"] == config.max_nodes
        assert doc["spec"]["parallelism"] >= config.min_nodes
        grace = doc["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= config.drain_timeout + config.worker_stop_timeout, "an eviction drains before the pod goes"
        assert train_config(config.args).ckpt_dir is not None


@pytest.mark.parametrize("script", sorted(DEPLOY.glob("slurm/*.sbatch")), ids=lambda p: p.name)
def test_every_elastic_run_in_the_slurm_scripts_parses(script: Path, monkeypatch):
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    text = script.read_text()
    directives = dict(re.findall(r"^#SBATCH --([a-z-]+)=?(\S*)", text, flags=re.MULTILINE))
    assert directives["ntasks-per-node"] == "1" and directives["signal"].startswith("B:TERM@")
    lines = re.findall(r"^srun [^\n]*?\belastic-run (.*?) &$", text.replace("\\\n", " "), flags=re.MULTILINE)
    assert lines, "one elastic-run per node, through srun"
    for line in lines:
        config = parse(shlex.split(re.sub(r"\$(\w+)", lambda m: SLURM[m.group(1)], line)), monkeypatch)
        assert (config.min_nodes, config.max_nodes) == (2, int(SLURM["SLURM_NNODES"]))
        assert config.rdzv_endpoint == SLURM["ETCD_ENDPOINTS"] and config.rdzv_id == SLURM["SLURM_JOB_ID"]
        assert train_config(config.args).ckpt_every == 200
