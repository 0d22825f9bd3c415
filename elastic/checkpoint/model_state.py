"""A module and its optimizers as one Stateful, through torch's distributed state-dict API.

``get_state_dict``/``set_state_dict`` give DTensor shards for FSDP2, plain tensors for DDP and plain
modules, and fully-qualified optimizer keys, which is what lets DCP reshard on load.

That API maps every key of ``module.state_dict()`` back to a parameter or buffer by name. A module whose
state-dict hooks rename or split parameters (torchtitan's fused QKV projection saves ``wqkv`` as ``wq``, ``wk``
and ``wv``) has keys that name none, so for such a module the model part goes through the module's own
``state_dict``/``load_state_dict``, hooks and all, as torchtitan itself saves it: with FSDP2 its values are
DTensors, which DCP reshards the same way. The optimizers still go through torch's API, keyed by parameter name.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor

from elastic.shard_local_ops import copies_between_shards

MODEL_KEY = "model"
OPTIMIZER_KEY = "optimizer"
_EXTRA_STATE = "_extra_state"


def renamed_keys(model: torch.nn.Module) -> list[str]:
    """Keys of ``model.state_dict()`` that name no parameter or buffer of it: its state-dict hooks made them."""
    if any(isinstance(module, FullyShardedDataParallel) for module in model.modules()):
        return []  # FSDP1 renames its flat parameters by design, and torch's API knows how
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    names.update(name for name, _ in model.named_buffers(remove_duplicate=False))
    return [
        key for key in model.state_dict(keep_vars=True) if key not in names and key.rsplit(".", 1)[-1] != _EXTRA_STATE
    ]


def init_state_on_shards(optimizer: torch.optim.Optimizer) -> None:
    """Give an optimizer that holds no state yet the state torch's state-dict API gives it before a load (one step
    with zero gradients and lr 0), computed on each DTensor parameter's local shard. On FSDP2's DTensors that step
    goes through DTensor's sharding propagation, op by op, which a new round's mesh finds uncached: 0.34-0.45 s of a
    0.8 s load from memory at 6 ranks on 2 cores, at every round change. An optimizer this cannot mirror (no
    DTensor, a gradient already there, a 0-dim parameter, one not rebuilt from its param groups) is left to torch."""
    if optimizer.state:
        return
    params = [param for group in optimizer.param_groups for param in group["params"]]
    if not any(isinstance(p, DTensor) for p in params) or any(p.grad is not None or p.dim() == 0 for p in params):
        return
    shards: dict[torch.Tensor, torch.Tensor] = {}
    groups = []
    for group in optimizer.param_groups:
        local = []
        for param in group["params"]:
            # the local values themselves, as torch's step uses them: with lr 0 and zero gradients it changes none
            shard = (
                (param.to_local() if isinstance(param, DTensor) else param).detach().requires_grad_(param.requires_grad)
            )
            shard.grad = torch.zeros_like(shard) if param.requires_grad else None
            shards[param] = shard
            local.append(shard)
        zero = torch.tensor(0.0) if isinstance(group.get("lr"), torch.Tensor) else 0.0
        groups.append({**group, "params": local, **({"lr": zero} if "lr" in group else {})})
    try:
        rebuild: Any = type(optimizer)  # the built-in optimizers take their param groups whole
        mirror = rebuild(groups)
        mirror.step()
    except (TypeError, ValueError, RuntimeError):  # an optimizer built otherwise: torch's own step will do
        return
    for param, shard in shards.items():
        state = mirror.state.get(shard)
        if state:
            optimizer.state[param] = {
                key: _as_param(value, param, shard) if isinstance(value, torch.Tensor) else value
                for key, value in state.items()
            }


def _as_param(value: torch.Tensor, param: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """A state tensor shaped as ``param``'s local ``shard``, as a DTensor laid out as ``param``; others as they are."""
    if not isinstance(param, DTensor) or value.dim() == 0 or value.shape != shard.shape:
        return value
    return DTensor.from_local(
        value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


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
        self._own_keys: bool | None = None  # whether the model's state-dict hooks rename keys; known at first use

    def state_dict(self) -> dict[str, Any]:
        for optimizer in self.optimizers:
            init_state_on_shards(optimizer)
        if self._keys_are_the_models_own():
            model_state = self.model.state_dict()
            if not self.optimizers:
                return {MODEL_KEY: model_state}
            return {MODEL_KEY: model_state, OPTIMIZER_KEY: get_optimizer_state_dict(self.model, self.optimizers)}
        if not self.optimizers:
            return {MODEL_KEY: get_model_state_dict(self.model, options=self.options)}
        model_state, optimizer_state = get_state_dict(self.model, self.optimizers, options=self.options)
        return {MODEL_KEY: model_state, OPTIMIZER_KEY: optimizer_state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        with copies_between_shards():
            self._load(state_dict)

    def _load(self, state_dict: dict[str, Any]) -> None:
        if self._keys_are_the_models_own():
            self.model.load_state_dict(state_dict[MODEL_KEY])
            if self.optimizers:
                set_optimizer_state_dict(self.model, self.optimizers, state_dict[OPTIMIZER_KEY])
            return
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

    def _keys_are_the_models_own(self) -> bool:
        """True when the model's state-dict hooks rename keys, so its own state_dict must be used."""
        if self._own_keys is None:
            renamed = renamed_keys(self.model)
            if renamed and self.options is not None:
                raise ValueError(
                    f"ModelState(options=...) cannot be honoured for {type(self.model).__name__}: its state-dict "
                    f"hooks rename parameters (e.g. {renamed[0]!r}), which torch's distributed state-dict API "
                    "cannot map back; drop options to save the module's own state_dict"
                )
            self._own_keys = bool(renamed)
        return self._own_keys
