"""Data order that survives resizes: global batches cut from a seeded sample stream.

The sample stream is the concatenation of one seeded permutation of the
dataset per epoch. Global batch k is the slice [k * global_batch, (k + 1) *
global_batch) of that stream, whatever the world size; each data-parallel
rank takes a contiguous part of the slice at the current world size. The only
progress to checkpoint is therefore global (seed, epoch, samples consumed),
identical on every rank, and a resized or restarted run that resumes from it
sees the same samples in the same order as an uninterrupted one.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch.utils.data import Sampler

from elastic.rng import derive_seed

logger = logging.getLogger(__name__)


class SamplingConfig(BaseModel):
    """What fixes the sample stream and how it is cut into steps."""

    model_config = ConfigDict(frozen=True)

    dataset_size: int = Field(gt=0, description="number of samples in the dataset")
    global_batch: int = Field(gt=0, description="samples per optimizer step, over all ranks")
    micro_batch: int | None = Field(
        default=None, gt=0, description="most samples one forward pass may take; None: the whole share"
    )
    seed: int = Field(default=0, ge=0, description="seed of the per-epoch permutations")
    shuffle: bool = Field(default=True, description="False: every epoch in dataset order")

    @model_validator(mode="after")
    def _micro_batch_fits(self) -> SamplingConfig:
        if self.micro_batch is not None and self.micro_batch > self.global_batch:
            raise ValueError(
                f"micro_batch ({self.micro_batch}) is larger than global_batch ({self.global_batch}); "
                "a rank never holds more than its share of the global batch"
            )
        return self


@dataclass(frozen=True)
class MicroBatch:
    """One forward/backward pass of one rank.

    `loss_weight` multiplies the mean loss over `indices` so that, after the
    data-parallel gradient reduction averages over ranks, the gradient is the
    mean over the global batch however unevenly it was shared. Padding passes
    (a rank whose share is shorter than the common number of passes) repeat a
    sample with weight 0: every rank must run the same number of passes
    because each one takes part in the sharded-model collectives.
    """

    indices: tuple[int, ...]
    loss_weight: float
    padding: bool = False


@functools.lru_cache(maxsize=4)
def epoch_permutation(config: SamplingConfig, epoch: int) -> torch.Tensor:
    """The order of the dataset in `epoch` (cached: every step of an epoch slices the same one)."""
    if not config.shuffle:
        return torch.arange(config.dataset_size)
    generator = torch.Generator()
    generator.manual_seed(derive_seed(config.seed, epoch))
    return torch.randperm(config.dataset_size, generator=generator)


def stream_slice(config: SamplingConfig, start: int, length: int) -> list[int]:
    """Dataset indices at stream positions [start, start + length), crossing epochs as needed."""
    indices: list[int] = []
    position = start
    while len(indices) < length:
        epoch, offset = divmod(position, config.dataset_size)
        take = min(length - len(indices), config.dataset_size - offset)
        indices.extend(epoch_permutation(config, epoch)[offset : offset + take].tolist())
        position += take
    return indices


def share_bounds(global_batch: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of `rank`'s part of a global batch: the first `global_batch % world_size` ranks take one more."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of size {world_size}")
    base, extra = divmod(global_batch, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def passes_per_step(config: SamplingConfig, world_size: int) -> int:
    """Forward/backward passes every rank runs per step (gradient accumulation)."""
    largest_share = math.ceil(config.global_batch / world_size)
    if config.micro_batch is None:
        return 1
    return math.ceil(largest_share / config.micro_batch)


def rank_micro_batches(config: SamplingConfig, global_batch: list[int], world_size: int, rank: int) -> list[MicroBatch]:
    """Split `rank`'s share of `global_batch` into the step's common number of passes."""
    start, stop = share_bounds(len(global_batch), world_size, rank)
    share = global_batch[start:stop]
    passes = passes_per_step(config, world_size)
    micro_batches = []
    for part in range(passes):
        part_start, part_stop = share_bounds(len(share), passes, part)
        indices = tuple(share[part_start:part_stop])
        if indices:
            weight = len(indices) * world_size / config.global_batch
            micro_batches.append(MicroBatch(indices, weight))
        else:
            # Any real sample will do: its loss is multiplied by 0.
            micro_batches.append(MicroBatch((global_batch[0],), 0.0, padding=True))
    return micro_batches


class ElasticSampler(Sampler[list[int]]):
    """Batch sampler over the global sample stream; a `Stateful` holding only global progress.

    Use it as `DataLoader(dataset, batch_sampler=sampler, ...)`: it yields this
    rank's micro-batches step after step, starting from the progress it holds
    when the iterator is created (create the iterator after loading a
    checkpoint). The DataLoader prefetches, so progress moves only when the
    trainer calls `complete_step()` after the step's optimizer update.
    """

    def __init__(self, config: SamplingConfig, rank: int, world_size: int) -> None:
        share_bounds(config.global_batch, world_size, rank)  # validates rank
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.samples_consumed = 0

    @property
    def epoch(self) -> int:
        return self.samples_consumed // self.config.dataset_size

    def global_batch(self, samples_consumed: int | None = None) -> list[int]:
        """Dataset indices of the step that starts after `samples_consumed` (default: the current one)."""
        start = self.samples_consumed if samples_consumed is None else samples_consumed
        return stream_slice(self.config, start, self.config.global_batch)

    def step_plan(self, samples_consumed: int | None = None) -> list[MicroBatch]:
        """This rank's passes for the step that starts after `samples_consumed` (default: the current one)."""
        return rank_micro_batches(self.config, self.global_batch(samples_consumed), self.world_size, self.rank)

    def complete_step(self) -> None:
        self.samples_consumed += self.config.global_batch

    def __iter__(self) -> Iterator[list[int]]:
        position = self.samples_consumed
        while True:
            for micro_batch in self.step_plan(position):
                yield list(micro_batch.indices)
            position += self.config.global_batch

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.config.seed, "epoch": self.epoch, "samples_consumed": self.samples_consumed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        samples_consumed = int(state_dict["samples_consumed"])
        epoch = int(state_dict["epoch"])
        if samples_consumed // self.config.dataset_size != epoch:
            raise ValueError(
                f"checkpointed sampler is in epoch {epoch} after {samples_consumed} samples, which does not fit "
                f"a dataset of {self.config.dataset_size} samples: the dataset changed since the checkpoint"
            )
        seed = int(state_dict["seed"])
        if seed != self.config.seed:
            # The committed history was drawn with the checkpointed seed; switching would repeat and skip samples.
            logger.warning(
                "continuing with the checkpointed sampling seed %d, not the configured %d", seed, self.config.seed
            )
            self.config = self.config.model_copy(update={"seed": seed})
        self.samples_consumed = samples_consumed

    def regenerate_state(self, step: int) -> None:
        """Rebuild progress from the global step when the checkpoint holds it in a foreign layout."""
        self.samples_consumed = step * self.config.global_batch
        logger.info(
            "sampler progress regenerated from step %d: %d samples consumed, epoch %d",
            step,
            self.samples_consumed,
            self.epoch,
        )
