"""Lightning under elastic-run: a snapshot in node memory every step, the newest one loaded at start.

    from elastic.integrations.lightning import ElasticCallback

    elastic = ElasticCallback(global_batch=32)
    trainer = L.Trainer(strategy="ddp", num_nodes=int(os.environ["GROUP_WORLD_SIZE"]), max_steps=1000,
                        callbacks=[elastic], use_distributed_sampler=False)
    trainer.fit(model, train_dataloaders=elastic.dataloader(dataset, num_workers=2))  # no ckpt_path: it resumes

At ``on_fit_start`` (every rank, once the strategy built the optimizers and schedulers, before Lightning restores or
runs its loops) the callback makes a CheckpointManager under ``<default_root_dir>/elastic`` and loads the newest state
it has (a snapshot the surviving nodes hold in memory, else a committed checkpoint on disk): the LightningModule and
its optimizers through DCP at this world size, the LR schedulers, the fit loop's progress (the global step) as
Lightning's own checkpoints hold it, and the data position. At every ``on_train_batch_end`` it snapshots into node
memory, and to disk every ``every`` steps (default: the ModelCheckpoint's ``every_n_train_steps``), or when
elastic-run drains before a planned change. Lightning's own checkpoints are written as before; the callback does
not read them.

``dataloader(dataset, **kwargs)`` builds the training DataLoader on an ``ElasticSampler``: step k trains on global
batch k of a seeded permutation, each rank on its part at the current world size, so the order does not depend on
the world size and the position is the step. Lightning injects a DistributedSampler unless the Trainer has
``use_distributed_sampler=False`` (it then refuses the batch sampler with a message saying so). The sampler has no
length: the epoch never ends, so give the Trainer ``max_steps``. Each step seeds python, numpy and torch from
(seed, step), so a redone step draws the same.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader, Dataset

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


class ElasticCallback(pl.Callback):
    """Snapshots every ``memory_every`` steps into node memory, to disk every ``every``; resumes from the newest.

    - ``directory``: the checkpoint folder, shared by every node (default ``<default_root_dir>/elastic``; one named
      here must exist).
    - ``global_batch`` and ``seed``: the data order of ``dataloader()`` (samples per step over all ranks, whatever
      the world size).
    - ``every``: disk checkpoints every this many steps (None: the ModelCheckpoint's ``every_n_train_steps``, else
      only when elastic-run drains); ``memory_every``: 0 checkpoints to disk only (and works outside elastic-run);
      ``keep``: disk checkpoints kept.
    """

    def __init__(
        self,
        directory: str | os.PathLike | None = None,
        global_batch: int | None = None,
        seed: int = 0,
        every: int | None = None,
        memory_every: int = 1,
        keep: int = 3,
    ) -> None:
        self.directory = check_settings(directory, memory_every, global_batch)
        if every is not None and every < 0:
            raise ElasticCallbackError(f"every must be >= 0 (0: disk checkpoints only on drains), got {every}")
        self.global_batch = global_batch
        self.seed = seed
        self.every = every
        self.memory_every = memory_every
        self.keep = keep
        self.sampler: ElasticSampler | None = None
        self.last_samples: list[int] = []  # this rank's samples of the step that just ended (with dataloader())
        self._manager: CheckpointManager | None = None
        self._state: dict[str, Any] = {}
        self._saved_step = -1

    def dataloader(self, dataset: Dataset, **kwargs: Any) -> DataLoader:
        """The training DataLoader: ``dataset`` in the ElasticSampler's order (kwargs: DataLoader's, less batching)."""
        if self.global_batch is None:
            raise ElasticCallbackError("ElasticCallback.dataloader() needs ElasticCallback(global_batch=...)")
        if not hasattr(dataset, "__len__"):
            raise ElasticCallbackError("ElasticCallback.dataloader() needs a dataset with a length")
        self.sampler = elastic_sampler(len(dataset), self.global_batch, self.seed)
        return DataLoader(dataset, batch_sampler=self.sampler, **kwargs)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.ckpt_path is not None:
            raise ElasticCallbackError(
                f"the Trainer was asked to resume from {trainer.ckpt_path}; ElasticCallback resumes the job itself: "
                "call trainer.fit() without ckpt_path"
            )
        if self.sampler is not None and trainer.accumulate_grad_batches != 1:
            raise ElasticCallbackError(
                "ElasticCallback.dataloader() gives each rank its whole share in one batch: set "
                f"accumulate_grad_batches=1 (it is {trainer.accumulate_grad_batches})"
            )
        fit_loop = trainer.fit_loop
        self._state = {
            "model": ModelState(pl_module, trainer.optimizers),
            "loops": Progress(fit_loop.state_dict, fit_loop.load_state_dict),
        }
        for index, config in enumerate(trainer.lr_scheduler_configs):
            self._state[f"lr_scheduler_{index}"] = config.scheduler
        if self.sampler is not None:
            self._state["dataloader"] = self.sampler
        directory = self.directory or Path(trainer.default_root_dir) / "elastic"
        self._manager = manager(directory, self._disk_every(trainer), self.memory_every, self.keep)
        step = self._manager.load_latest(self._state)
        if step:
            self._saved_step = step
            logger.info("ElasticCallback: resumed at step %d from %s", step, directory)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        seed_all(derive_seed(self.seed, trainer.global_step + 1))  # the RNG is a function of the step

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self._manager is None or step == self._saved_step:  # accumulating gradients: no optimizer step yet
            return
        self._saved_step = step
        if self.sampler is not None:
            self.last_samples = [i for pass_ in self.sampler.step_plan() for i in pass_.indices]
            self.sampler.complete_step()
        if self._manager.should_save(step):  # a collective: every rank asks at every step
            self._manager.save(step, self._state)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._manager is not None:
            # the last step to disk, unless it is there: a run resumed at its end may have loaded it from memory
            self._manager.finish(trainer.global_step, self._state)
            self._manager = None

    def _disk_every(self, trainer: pl.Trainer) -> int:
        if self.every is not None:
            return self.every
        # ModelCheckpoint keeps its schedule in a private attribute only; without one, disk saves on drains only
        schedules = [getattr(callback, "_every_n_train_steps", 0) or 0 for callback in trainer.checkpoint_callbacks]
        return min((every for every in schedules if every > 0), default=0)
