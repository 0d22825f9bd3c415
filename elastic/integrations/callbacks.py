"""What the framework callbacks share: their settings' checks, the CheckpointManager they build, and the data order.

``elastic.integrations.hf.ElasticCallback`` (Transformers' Trainer) and ``elastic.integrations.lightning.
ElasticCallback`` (Lightning's Trainer) differ only in where their framework keeps the step, the model, the
optimizers and the schedulers; this module imports neither framework.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic.node_memory import MEMORY_DIR_ENV

if TYPE_CHECKING:  # torch.distributed.checkpoint takes seconds to import: only where a callback starts training
    from elastic.checkpoint import CheckpointManager
    from elastic.sampling import ElasticSampler


class ElasticCallbackError(RuntimeError):
    """A callback cannot work as configured; the message says what to change (one line)."""


def check_settings(directory: str | os.PathLike | None, memory_every: int, global_batch: int | None) -> Path | None:
    """Fail at construction, before any process group exists: elastic-run's environment when snapshots in memory
    are asked for, an existing checkpoint directory when one is named, a positive global batch."""
    if memory_every < 0:
        raise ElasticCallbackError(f"memory_every must be >= 0 (0: no snapshots in memory), got {memory_every}")
    if memory_every and not os.environ.get(MEMORY_DIR_ENV):
        raise ElasticCallbackError(
            f"ElasticCallback snapshots into node memory, which needs elastic-run's environment ({MEMORY_DIR_ENV} is "
            "not set): start the script with elastic-run (e.g. elastic-run --standalone --nproc-per-node 2 "
            "script.py), or pass memory_every=0 to checkpoint to disk only"
        )
    if global_batch is not None and global_batch <= 0:
        raise ElasticCallbackError(f"global_batch must be > 0, got {global_batch}")
    if directory is None:
        return None
    path = Path(directory)
    if not path.is_dir():
        raise ElasticCallbackError(
            f"checkpoint directory {path} does not exist: create it (every node must see it at the same path), "
            "or leave directory out to use a folder under the trainer's output directory"
        )
    return path


def world_from_env() -> tuple[int, int]:
    """This worker's rank and the world size, from torchrun's (and elastic-run's) environment; (0, 1) alone."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def elastic_sampler(dataset_size: int, global_batch: int, seed: int) -> ElasticSampler:
    """A batch sampler of one pass per step: this rank's part of a global batch fixed by (seed, step) alone."""
    from elastic.sampling import ElasticSampler, SamplingConfig

    if global_batch > dataset_size:
        raise ElasticCallbackError(f"global_batch ({global_batch}) exceeds the dataset's {dataset_size} samples")
    rank, world_size = world_from_env()
    if global_batch < world_size:
        raise ElasticCallbackError(
            f"global_batch ({global_batch}) is smaller than the world size ({world_size}): every rank needs a sample"
        )
    return ElasticSampler(
        SamplingConfig(dataset_size=dataset_size, global_batch=global_batch, seed=seed), rank, world_size
    )


def manager(directory: Path, every: int, memory_every: int, keep: int) -> CheckpointManager:
    """The callbacks' CheckpointManager: disk every ``every`` steps (asynchronous), memory every ``memory_every``."""
    from elastic.checkpoint import CheckpointManager

    directory.mkdir(parents=True, exist_ok=True)
    return CheckpointManager(directory, keep=keep, async_save=True, every=every, memory_every=memory_every)


class Progress:
    """A Stateful of plain global values (the same on every rank): the framework's step counters."""

    def __init__(self, read: Any, write: Any) -> None:
        self._read = read
        self._write = write

    def state_dict(self) -> dict[str, Any]:
        return self._read()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._write(state_dict)
