"""A module and its optimizers as one Stateful, through torch's distributed state-dict API.

``get_state_dict``/``set_state_dict`` give DTensor shards for FSDP2, plain tensors for DDP and plain
modules, and fully-qualified optimizer keys, which is what lets DCP reshard on load.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

MODEL_KEY = "model"
OPTIMIZER_KEY = "optimizer"


class ModelState(Stateful):
    """Checkpoint entry for ``model`` and its ``optimizers`` (one, several, or none)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] = (),
        options: StateDictOptions | None = None,
    ) -> None:
        self.model = model
        self.optimizers = (optimizers,) if isinstance(optimizers, torch.optim.Optimizer) else tuple(optimizers)
        self.options = options

    def state_dict(self) -> dict[str, Any]:
        if not self.optimizers:
            return {MODEL_KEY: get_model_state_dict(self.model, options=self.options)}
        model_state, optimizer_state = get_state_dict(self.model, self.optimizers, options=self.options)
        return {MODEL_KEY: model_state, OPTIMIZER_KEY: optimizer_state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self.optimizers:
            set_model_state_dict(self.model, state_dict[MODEL_KEY], options=self.options)
            return
        set_state_dict(
            self.model,
            self.optimizers,
            model_state_dict=state_dict[MODEL_KEY],
            optim_state_dict=state_dict[OPTIMIZER_KEY],
            options=self.options,
        )
