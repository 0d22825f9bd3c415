"""The Kubernetes and Slurm recipes in examples/deploy: their elastic-run and train.py command lines parse."""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys

import pytest
import yaml

from launcher.cli import build_parser, config_from_args
from launcher_harness import REPO

pytestmark = pytest.mark.timeout(60)
DEPLOY = REPO / "examples" / "deploy"


def train_config(args: list[str]):
    spec = importlib.util.spec_from_file_location("recipe_train", REPO / "examples" / "train.py")
    train = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = train  # pydantic resolves the config's annotations through it
    spec.loader.exec_module(train)
    return train.parse_config(args)


def launch(argv: list[str], monkeypatch):
    monkeypatch.chdir(REPO)  # the recipes run examples/train.py from the repository root
    return config_from_args(build_parser().parse_args(argv))


def test_the_kubernetes_job_runs_elastic_run_with_flags_it_takes(tmp_path, monkeypatch):
    job = yaml.safe_load((DEPLOY / "kubernetes.yaml").read_text())
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["command"] == ["elastic-run"]
    env = {e["name"]: e for e in container["env"]}
    assert env["ELASTIC_ETCD_PASSWORD"]["valueFrom"]["secretKeyRef"], "the password comes from a Secret"
    ca = tmp_path / "ca.crt"
    ca.write_text("a CA bundle")
    values = {"$(POD_NAME)": "gpt-train-1-abcde", "$(POD_IP)": "10.1.2.3", "/etc/elastic/ca.crt": str(ca),
              "--nproc-per-node=gpu": "--nproc-per-node=8"}  # fmt: skip  (no CUDA here to count)
    argv = []
    for arg in container["args"]:
        for name, value in values.items():
            arg = arg.replace(name, value)
        argv.append(arg)
    monkeypatch.setenv("ELASTIC_ETCD_PASSWORD", "pw")
    config = launch(argv, monkeypatch)
    assert (config.min_nodes, config.max_nodes, config.rdzv_id) == (2, 4, "gpt-train")
    assert config.node_id == "gpt-train-1-abcde" and config.local_addr == "10.1.2.3"
    assert config.etcd_security.user == "trainer" and config.etcd_security.cacert == ca
    assert pod["terminationGracePeriodSeconds"] >= config.drain_timeout + config.worker_stop_timeout
    assert job["spec"]["parallelism"] >= config.min_nodes and job["spec"]["completions"] == config.max_nodes
    assert train_config(config.args).ckpt_dir is not None


def test_the_slurm_script_runs_one_agent_per_node_with_flags_it_takes(monkeypatch):
    text = (DEPLOY / "slurm.sbatch").read_text()
    subprocess.run(["bash", "-n", str(DEPLOY / "slurm.sbatch")], check=True, timeout=30)
    directives = dict(re.findall(r"^#SBATCH --([a-z-]+)=?(\S*)", text, flags=re.MULTILINE))
    assert directives["ntasks-per-node"] == "1" and directives["signal"].startswith("B:TERM@")
    command = re.search(r"^srun [^\n]*?\belastic-run (.*?) &$", text.replace("\\\n", " "), flags=re.MULTILINE)
    variables = {"MIN_NODES": "2", "SLURM_NNODES": directives["nodes"], "ETCD_HOST": "node001", "ETCD_PORT": "2379",
                 "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "gpt-train"}  # fmt: skip
    line = re.sub(r"\$(\w+)", lambda m: variables[m.group(1)], command.group(1))
    argv = shlex.split(line)
    argv[argv.index("--nproc-per-node") + 1] = "8"  # no CUDA here to count
    config = launch(argv, monkeypatch)
    assert (config.min_nodes, config.max_nodes, config.rdzv_endpoint) == (2, 4, "node001:2379")
    assert config.rdzv_id == "4242" and config.drain_timeout > 0
    assert train_config(config.args).ckpt_every == 200
