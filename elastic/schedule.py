"""Learning-rate schedules keyed to the global step, not to calls made on this rank.

A torch scheduler counts its own `step()` calls, and its state (a count plus,
for chainable schedulers, the last learning rate) means nothing after a
restart that reloads it at another step or from a foreign layout. Here the
global step is the only state: positioning at step N rebuilds the wrapped
scheduler and replays N steps, which performs the very same float operations
as an uninterrupted run and so gives bitwise the same learning rate. A
`LambdaLR` computes each learning rate from its step count alone
(base lr x lambda(step)), so it is set at step N - 1 and stepped once: the same
operations as its N-th step, where a replay costs every round change O(N)
(2 ms at step 400 and 0.7 s at step 100,000, on an idle core).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

logger = logging.getLogger(__name__)

SchedulerFactory = Callable[[Optimizer], LRScheduler]


class GlobalStepLR:
    """A torch LR scheduler driven by the global step; a `Stateful` holding only that step.

    `build` makes the scheduler for a fresh optimizer (it is called again on
    every repositioning). The optimizer's learning rates at construction are
    taken as the base learning rates, so construct this before loading a
    checkpoint into the optimizer.
    """

    def __init__(self, optimizer: Optimizer, build: SchedulerFactory) -> None:
        self.optimizer = optimizer
        self.build = build
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        self.global_step = 0
        self.scheduler = self._rebuild()

    def current_lrs(self) -> list[float]:
        """Learning rates the optimizer uses for the step after `global_step`."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def advance(self) -> None:
        """Call once per completed optimizer step."""
        self.scheduler.step()
        self.global_step += 1

    def set_step(self, step: int) -> None:
        """Put the optimizer's learning rates where an uninterrupted run has them after `step` steps."""
        if step < 0:
            raise ValueError(f"the global step cannot be negative, got {step}")
        self.scheduler = self._rebuild()
        replay = step
        if type(self.scheduler) is LambdaLR and step > 0:  # its learning rate is a function of its step count
            self.scheduler.last_epoch = step - 1
            replay = 1
        with warnings.catch_warnings():
            # Replaying without optimizer steps is the point here; torch warns about the call order.
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            for _ in range(replay):
                self.scheduler.step()
        self.global_step = step

    def state_dict(self) -> dict[str, Any]:
        return {"global_step": self.global_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.set_step(int(state_dict["global_step"]))

    def regenerate_state(self, step: int) -> None:
        """Position at the checkpoint's step when its scheduler state is in a foreign layout."""
        self.set_step(step)
        logger.info("learning-rate schedule regenerated at global step %d: lr %s", step, self.current_lrs())

    def _rebuild(self) -> LRScheduler:
        for group, base_lr in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base_lr
            group["initial_lr"] = base_lr
        return self.build(self.optimizer)


class WarmupCosineConfig(BaseModel):
    """Linear warm-up to the base learning rate, then cosine decay to `min_lr_ratio` of it."""

    model_config = ConfigDict(frozen=True)

    total_steps: int = Field(gt=0, description="steps the schedule spans")
    warmup_steps: int = Field(ge=0, description="steps of linear warm-up, within total_steps")
    min_lr_ratio: float = Field(default=0.1, ge=0.0, le=1.0, description="final learning rate / base learning rate")

    @model_validator(mode="after")
    def _warmup_within_total(self) -> WarmupCosineConfig:
        if self.warmup_steps > self.total_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) exceeds total_steps ({self.total_steps})")
        return self


def warmup_cosine_factor(config: WarmupCosineConfig, step: int) -> float:
    """Multiplier of the base learning rate for the update that follows `step` completed steps."""
    if step < config.warmup_steps:
        return (step + 1) / (config.warmup_steps + 1)
    decay_steps = max(1, config.total_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine


def warmup_cosine(config: WarmupCosineConfig) -> SchedulerFactory:
    """A factory for `GlobalStepLR` making a warm-up + cosine `LambdaLR`."""
    return lambda optimizer: LambdaLR(optimizer, lambda step: warmup_cosine_factor(config, step))
