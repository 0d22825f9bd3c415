"""Transformers' Trainer under elastic-run: a snapshot in node memory every step, the newest one loaded at start.

    from elastic.integrations.hf import ElasticCallback

    trainer = Trainer(model, args, train_dataset=dataset, callbacks=[ElasticCallback(global_batch=32)])
    trainer.train()  # no resume_from_checkpoint: the callback resumes

At ``on_train_begin`` (every rank, once the Trainer built its optimizer and scheduler) the callback makes a
CheckpointManager under ``<output_dir>/elastic`` and loads the newest state it has (a snapshot the surviving nodes
hold in memory, else a committed checkpoint on disk): model and optimizer through DCP at this world size, the LR
scheduler, the global step, and the data position. At every ``on_step_end`` it snapshots into node memory, and to
disk on the Trainer's ``save_steps`` schedule (DCP, asynchronous), or when elastic-run drains before a planned
change. The Trainer's own checkpoints (``checkpoint-<N>``) are written as before; the callback does not read them.

With ``global_batch``, the callback puts an ``ElasticSampler`` in place of the Trainer's sampler: step k trains on
global batch k of a seeded permutation (seed: ``data_seed``, else ``seed``), each rank on its part at the current
world size, so the data order does not depend on the world size, and the position is the step. The Trainer has no
hook for a batch sampler, so the callback sets it on the prepared DataLoader at ``on_train_begin``, before the
Trainer iterates it. Each step seeds python, numpy and torch from (seed, step), so a redone step draws the same.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

from torch.utils.data import IterableDataset
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from elastic.checkpoint import CheckpointManager, ModelState
from elastic.integrations.callbacks import (
    ElasticCallbackError,
    Progress,
    check_settings,
    elastic_sampler,
    manager,
)
from elastic.rng import derive_seed, seed_all
from elastic.sampling import ElasticSampler

__all__ = ["ElasticCallback", "ElasticCallbackError"]

logger = logging.getLogger(__name__)


class ElasticCallback(TrainerCallback):
    """Snapshots every ``memory_every`` steps into node memory, to disk on ``save_steps``; resumes from the newest.

    - ``directory``: the checkpoint folder, shared by every node (default ``<output_dir>/elastic``; one named here
      must exist).
    - ``global_batch``: samples per optimizer step over all ranks, whatever the world size; with it the data order
      is the ElasticSampler's (needs ``gradient_accumulation_steps=1`` and a dataset with a length). Without it the
      Trainer's own sampler stays, whose order changes with the world size.
    - ``memory_every``: 0 checkpoints to disk only (and works outside elastic-run); ``keep``: disk checkpoints kept.
    """

    def __init__(
        self,
        directory: str | os.PathLike | None = None,
        global_batch: int | None = None,
        memory_every: int = 1,
        keep: int = 3,
    ) -> None:
        self.directory = check_settings(directory, memory_every, global_batch)
        self.global_batch = global_batch
        self.memory_every = memory_every
        self.keep = keep
        self.sampler: ElasticSampler | None = None
        self.last_samples: list[int] = []  # this rank's samples of the step that just ended (with global_batch)
        self._manager: CheckpointManager | None = None
        self._state: dict[str, Any] = {}
        self._seed = 0

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if state.global_step:
            raise ElasticCallbackError(
                f"the Trainer resumed from its own checkpoint (step {state.global_step}); ElasticCallback resumes the "
                "job itself: call trainer.train() without resume_from_checkpoint"
            )
        model, optimizer, scheduler = kwargs["model"], kwargs["optimizer"], kwargs["lr_scheduler"]
        # accelerate wraps them (AcceleratedOptimizer, AcceleratedScheduler); checkpoints hold the torch objects
        optimizer = getattr(optimizer, "optimizer", optimizer)
        scheduler = getattr(scheduler, "scheduler", scheduler)
        self._seed = args.data_seed if args.data_seed is not None else args.seed
        if self.global_batch is not None:
            self.sampler = self._install_sampler(kwargs["train_dataloader"], args)

        def progress() -> dict[str, Any]:
            return {"global_step": state.global_step, "epoch": float(state.epoch or 0.0)}

        def set_progress(saved: dict[str, Any]) -> None:
            state.global_step, state.epoch = int(saved["global_step"]), float(saved["epoch"])

        self._state = {"model": ModelState(model, optimizer), "trainer": Progress(progress, set_progress)}
        if scheduler is not None:
            self._state["lr_scheduler"] = scheduler
        if self.sampler is not None:
            self._state["dataloader"] = self.sampler
        every = _disk_every(args, state)
        directory = self.directory or Path(args.output_dir or ".") / "elastic"
        self._manager = manager(directory, every, self.memory_every, self.keep)
        step = self._manager.load_latest(self._state)
        if step:
            logger.info("ElasticCallback: resumed at step %d from %s", step, directory)
            if state.global_step >= state.max_steps:
                control.should_training_stop = True

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        seed_all(derive_seed(self._seed, state.global_step + 1))  # the RNG is a function of the step

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self._manager is None:
            return
        if self.sampler is not None:
            self.last_samples = [i for pass_ in self.sampler.step_plan() for i in pass_.indices]
            self.sampler.complete_step()
        step = state.global_step
        if self._manager.should_save(step):  # a collective: every rank asks at every step
            self._manager.save(step, self._state)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._manager is not None:
            # the last step to disk, unless it is there: a run resumed at its end may have loaded it from memory
            self._manager.finish(state.global_step, self._state)
            self._manager = None

    def _install_sampler(self, dataloader: Any, args: TrainingArguments) -> ElasticSampler:
        assert self.global_batch is not None
        dataset = getattr(dataloader, "dataset", None)
        if dataset is None or isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise ElasticCallbackError(
                "ElasticCallback(global_batch=...) needs a training dataset with a length (not an IterableDataset); "
                "drop global_batch to keep the Trainer's sampler"
            )
        if args.gradient_accumulation_steps != 1:
            raise ElasticCallbackError(
                f"ElasticCallback(global_batch=...) trains each rank's whole share in one pass: set "
                f"gradient_accumulation_steps=1 (it is {args.gradient_accumulation_steps}), or drop global_batch"
            )
        sampler = elastic_sampler(len(dataset), self.global_batch, self._seed)
        # accelerate's DataLoaderShard iterates its base_dataloader; torch refuses to reassign batch_sampler after
        # construction, which is exactly what the Trainer offers no other way to choose
        target = getattr(dataloader, "base_dataloader", dataloader)
        object.__setattr__(target, "batch_sampler", sampler)
        return sampler


def _disk_every(args: TrainingArguments, state: TrainerState) -> int:
    """The Trainer's save schedule in steps (a fraction of max_steps below 1), or 0 when it saves by epoch or never."""
    if getattr(args.save_strategy, "value", args.save_strategy) != "steps" or not args.save_steps:
        return 0
    if args.save_steps < 1:
        return max(1, math.ceil(args.save_steps * state.max_steps))
    return int(args.save_steps)
