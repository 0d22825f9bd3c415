"""A worker's environment: torchrun's contract (ranks, sizes, master, restart count) and the files the agent
shares with the worker in its attempt folder (the error file, the heartbeat channel)."""

from __future__ import annotations

import os
from pathlib import Path

from elastic.channel import AGENT_DOORBELL_ENV, HEARTBEAT_ENV
from elastic.node_memory import MEMORY_DIR_ENV, node_memory_dir
from elastic.rounds import ROUND_WAIT_ENV, STANDBY_ENV
from launcher.config import LaunchConfig
from launcher.rendezvous.records import MasterRecord, Member, RoundHeader
from launcher.workers.network import gloo_interface_env
from launcher.workers.wakeups import doorbell_address

ERROR_FILE = "error.json"  # TORCHELASTIC_ERROR_FILE, in the worker's attempt folder
HEARTBEAT_FILE = "heartbeat"  # the worker's channel (elastic.channel), next to its error file
# what `worker_env` sets for each round, absent from a standby worker's environment until its first round
ROUND_VARIABLES = (
    "RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "ELASTIC_ROUND",
    HEARTBEAT_ENV,
)


def node_worker_env(addr: str, nproc: int) -> dict[str, str]:
    """The part of a worker's environment that stays the same from round to round on this node."""
    env = dict(os.environ)
    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"
    # gloo would otherwise bind where the hostname resolves, often 127.0.x.1, which peers on other hosts cannot reach
    env.update(gloo_interface_env(addr, os.environ))
    return env


def standby_env(config: LaunchConfig, node_env: dict[str, str], local_rank: int) -> dict[str, str]:
    """A worker's environment before its first round (`launcher.workers.standby`): what `worker_env` sets that
    does not depend on the round, and ELASTIC_STANDBY; the round's offer brings the rest."""
    env = _round_free_env(config, node_env, local_rank, config.nproc_per_node, config.node_id)
    for name in ROUND_VARIABLES:  # the agent's own environment may hold some (an outer launcher's)
        env.pop(name, None)
    return dict(env, **{STANDBY_ENV: "1"})


def worker_env(
    config: LaunchConfig, round_: RoundHeader, member: Member, master: MasterRecord, local_rank: int, error_file: Path
) -> dict[str, str]:
    """The variables torchrun sets for a worker, plus ELASTIC_ROUND, ELASTIC_HEARTBEAT_FILE, ELASTIC_MEMORY_DIR,
    ELASTIC_ROUND_WAIT and ELASTIC_AGENT_DOORBELL."""
    rank = member.first_rank + local_rank
    env = _round_free_env(config, node_worker_env(member.addr, member.nproc), local_rank, member.nproc, member.node)
    env.update(
        RANK=str(rank),
        GROUP_RANK=str(member.group_rank),
        ROLE_RANK=str(rank),
        WORLD_SIZE=str(round_.world_size),
        GROUP_WORLD_SIZE=str(round_.size),
        ROLE_WORLD_SIZE=str(round_.world_size),
        MASTER_ADDR=master.addr,
        MASTER_PORT=str(master.port),
        TORCHELASTIC_RESTART_COUNT=str(round_.restart_count),
        # a fresh store on the round's own port, served by group rank 0's agent (listening before any worker
        # starts) or by rank 0: no key of an earlier round can be read back
        TORCHELASTIC_USE_AGENT_STORE=str(master.agent_store),
        TORCHELASTIC_ERROR_FILE=str(error_file),
        ELASTIC_ROUND=str(round_.round),
    )
    # the worker's channel to its agent (heartbeats for the watchdog, drains): a file next to the error file,
    # created by WorkerGroup; never the channel of an outer elastic-run
    env[HEARTBEAT_ENV] = str(error_file.parent / HEARTBEAT_FILE)
    return env


def _round_free_env(
    config: LaunchConfig, node_env: dict[str, str], local_rank: int, nproc: int, node: str
) -> dict[str, str]:
    env = dict(node_env)
    env.update(
        LOCAL_RANK=str(local_rank),
        ROLE_NAME=config.role,
        LOCAL_WORLD_SIZE=str(nproc),
        TORCHELASTIC_MAX_RESTARTS=str(config.max_restarts),
        TORCHELASTIC_RUN_ID=config.rdzv_id,
        # as torchrun: the user's value wins; by default a failed NCCL collective tears its process down
        TORCH_NCCL_ASYNC_ERROR_HANDLING=os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    )
    # where CheckpointManager(memory_every=...) keeps snapshots; the agent holds the folder for the job's life
    env[MEMORY_DIR_ENV] = str(node_memory_dir(config.rdzv_id, node, os.getpid()))  # built by the agent
    # under elastic.run, how long a worker whose collective failed waits for the round that replaces the lost
    # peer: the peer's lease must expire first, then the round is handed over
    env[ROUND_WAIT_ENV] = f"{config.rdzv.lease_ttl + config.inprocess_timeout:g}"
    env[AGENT_DOORBELL_ENV] = doorbell_address(node)  # wakes the agent (launcher.workers.wakeups)
    return env
