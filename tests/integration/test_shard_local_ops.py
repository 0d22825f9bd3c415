"""Fused optimizer steps and gradient clipping over FSDP2's DTensors, run on the local shards: the same values as
DTensor's own way."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from multiproc import run_ranks
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torchtitan.distributed.utils import clip_grad_norm_ as torchtitans_clip_grad_norm_

from elastic import shard_local_ops

OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.1, weight_decay=0.1, fused=True),
    "adam-amsgrad-tensor-lr": lambda params: torch.optim.Adam(params, lr=torch.tensor(0.05), amsgrad=True, fused=True),
    "adam-maximize": lambda params: torch.optim.Adam(params, lr=0.1, maximize=True, fused=True),
}


def sharded_model() -> torch.nn.Module:
    """A tiny FSDP2 model: uneven shards at 3 ranks, and an empty one."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.ReLU(), torch.nn.Linear(7, 2))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def trained(name: str, rank: int) -> tuple[list[torch.Tensor], list[Any]]:
    """Four steps of `sharded_model`: local parameters and optimizer state."""
    model = sharded_model()
    optimizer = OPTIMIZERS[name](model.parameters())
    for step in range(4):
        torch.manual_seed(100 * step + rank)
        model(torch.randn(4, 6)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    params = [param.to_local().clone() for param in model.parameters()]
    states = [
        {key: value.to_local() if isinstance(value, DTensor) else value for key, value in state.items()}
        for state in optimizer.state.values()
    ]
    return params, states


def steps_both_ways(rank: int, world_size: int, name: str) -> dict[str, Any]:
    torchs = trained(name, rank)
    taken: list[bool] = []
    local_operands = shard_local_ops._local_operands

    def counted(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        local = local_operands(args, kwargs)
        taken.append(local is not None)
        return local

    shard_local_ops._local_operands = counted
    shard_local_ops.take_over_step_ops()
    shard_local_ops.take_over_step_ops()  # idempotent
    ours = trained(name, rank)
    return {"torchs": torchs, "ours": ours, "taken": taken}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.timeout(120)
def test_fused_steps_on_the_shards_give_dtensors_values(name: str) -> None:
    """Each round's first fused AdamW step over FSDP2's DTensors cost 0.28 s of sharding propagation at 6 ranks
    on 2 cores. Run on the local shards instead (every operand laid out as its parameter), four steps at 3 ranks
    give the same parameters and optimizer state, bit for bit, as DTensor's own dispatch."""
    for result in run_ranks(3, steps_both_ways, name):
        assert result["taken"] == [True] * 4, "every step ran on the shards"
        torch_params, torch_states = result["torchs"]
        our_params, our_states = result["ours"]
        assert all(torch.equal(a, b) for a, b in zip(torch_params, our_params, strict=True))
        for theirs, mine in zip(torch_states, our_states, strict=True):
            assert theirs.keys() == mine.keys()
            assert all(torch.equal(theirs[key], mine[key]) for key in theirs)


CLIPPINGS = {  # the clipping, its norm, and whether a replicated parameter joins the sharded ones
    "torch-2": (torch.nn.utils.clip_grad_norm_, 2.0, False),
    "torch-2-replicated-too": (torch.nn.utils.clip_grad_norm_, 2.0, True),
    "torch-inf": (torch.nn.utils.clip_grad_norm_, float("inf"), False),
    "torch-1": (torch.nn.utils.clip_grad_norm_, 1.0, False),
    "torchtitan-2": (torchtitans_clip_grad_norm_, 2.0, False),
}


def take_over_counting_what_is_left() -> list[str]:
    """Take the step ops over; the list names each call that a handler then leaves to DTensor, as they come."""
    left: list[str] = []
    dtensors_way = shard_local_ops._dtensors_way

    def counted(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], handler: Any) -> Any:
        left.append(str(op))
        return dtensors_way(op, args, kwargs, handler)

    shard_local_ops._dtensors_way = counted
    shard_local_ops.take_over_step_ops()
    return left


def clipped(rank: int, world_size: int) -> dict[str, Any]:
    """Each clipping of `sharded_model`'s gradients by DTensor's way and then on the shards: total norms and local
    gradients, and the clipping ops that went to DTensor all the same."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))

    def clip(name: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model = sharded_model()
        replicated = torch.nn.Parameter(distribute_tensor(torch.arange(5.0), mesh, [Replicate()]))
        torch.manual_seed(rank)
        (model(torch.randn(4, 6)).square().mean() + replicated.to_local().square().sum()).backward()
        clip_grad_norm, norm_type, replicated_too = CLIPPINGS[name]
        # DTensor's own inf-norm fails on the last layer's empty shard ("does not have an identity")
        params = [*(model if norm_type != float("inf") else model[0]).parameters()]
        params += [replicated] if replicated_too else []
        total = clip_grad_norm(params, 0.01, norm_type=norm_type)
        total = total.full_tensor() if isinstance(total, DTensor) else total
        return total, [param.grad.to_local().clone() for param in params]

    torchs = {name: clip(name) for name in CLIPPINGS}
    left_to_dtensor = take_over_counting_what_is_left()
    ours = {name: clip(name) for name in CLIPPINGS}
    handlers = DTensor._op_dispatcher._custom_op_handlers
    taken_over = sorted(str(op) for op in handlers if handlers[op].__module__ == shard_local_ops.__name__)
    return {"torchs": torchs, "ours": ours, "left_to_dtensor": left_to_dtensor, "taken_over": taken_over}


@pytest.mark.timeout(120)
def test_gradient_clipping_on_the_shards_gives_dtensors_values() -> None:
    """The first clipping on a new mesh cost 0.9-1.2 s of sharding propagation at 300 parameters on 2 ranks, and
    torchtitan clips at every step. On the shards (2-norm, inf-norm, 1-norm; torch's and torchtitan's clipping;
    sharded and replicated gradients, uneven and empty shards at 3 ranks), the total norm and every clipped
    gradient equal DTensor's own bit for bit. Only the stack of sharded and replicated gradients' norms goes to
    DTensor, which redistributes the replicated one to stack them, and the inf-norm's pending total. torch's clip
    coefficient from a replicated total, (max / (total + eps)).clamp(max=1), is computed on the local tensors."""
    for result in run_ranks(3, clipped):
        assert {"aten._foreach_norm.Scalar", "aten._foreach_mul_.Tensor", "aten.stack.default"} <= set(
            result["taken_over"]
        )
        assert {"aten.add.Tensor", "aten.reciprocal.default", "aten.mul.Tensor", "aten.clamp.default"} <= set(
            result["taken_over"]
        )
        # and the inf-norm's total plus eps: its max is still pending (Partial(max)), so DTensor reduces it first
        assert result["left_to_dtensor"] == ["aten.stack.default", "aten.add.Tensor"]
        for name, (torch_total, torch_grads) in result["torchs"].items():
            our_total, our_grads = result["ours"][name]
            assert torch.equal(torch_total, our_total), name
            assert all(torch.equal(a, b) for a, b in zip(torch_grads, our_grads, strict=True)), name


def elementwise_both_ways(rank: int, world_size: int) -> dict[str, Any]:
    """Elementwise ops of replicated DTensors by DTensor's way and on the local tensors: whether spec and values
    agree; and which calls of other layouts were left to DTensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial

    mesh = init_device_mesh("cpu", (world_size,))
    matrix = distribute_tensor(torch.arange(6.0).reshape(3, 2), mesh, [Replicate()])
    row = distribute_tensor(torch.tensor([0.5, -2.0]), mesh, [Replicate()])
    total = distribute_tensor(torch.tensor(4.0), mesh, [Replicate()])
    calls = {
        "0-dim plus a number": lambda: total + 1e-6,
        "a number over a 0-dim": lambda: 0.01 / total,
        "clamped from above": lambda: total.clamp(max=1.0),
        "clamped both sides": lambda: matrix.clamp(1.0, 4.0),
        "broadcast product": lambda: matrix * row,
        "sum with alpha": lambda: torch.add(matrix, row, alpha=2),
    }
    torchs = {name: call() for name, call in calls.items()}
    left = take_over_counting_what_is_left()
    ours = {name: call() for name, call in calls.items()}
    same = {
        name: torchs[name]._spec == ours[name]._spec and torch.equal(torchs[name].to_local(), ours[name].to_local())
        for name in calls
    }
    local_calls = len(left)
    sharded = distribute_tensor(torch.arange(6.0).reshape(3, 2), mesh, [Shard(0)])
    pending = DTensor.from_local(torch.tensor(float(rank)), mesh, [Partial()])
    others = {
        "sharded": lambda: (sharded * 2.0).full_tensor(),
        "pending": lambda: (pending + 1.0).full_tensor(),
        "beside a plain tensor": lambda: (total + torch.tensor(1.0)).full_tensor(),
    }
    values = {name: call() for name, call in others.items()}
    return {"same": same, "local_calls": local_calls, "left": left, "values": values}


@pytest.mark.timeout(120)
def test_elementwise_ops_of_replicas_run_on_the_local_tensors() -> None:
    """Each of clipping's last four ops cost a sharding propagation in every new round. Of replicated DTensors they
    give DTensor's spec and values on the local tensors; a sharded or pending operand, or a plain tensor beside a
    DTensor, is left to DTensor."""
    for rank, result in enumerate(run_ranks(3, elementwise_both_ways)):
        assert all(result["same"].values()), result["same"]
        assert result["local_calls"] == 0
        assert result["left"] == ["aten.mul.Tensor", "aten.add.Tensor", "aten.add.Tensor"]
        assert torch.equal(result["values"]["sharded"], torch.arange(6.0).reshape(3, 2) * 2), rank
        assert result["values"]["pending"].item() == 0 + 1 + 2 + 1.0
        assert result["values"]["beside a plain tensor"].item() == 5.0


def mixed_layouts(rank: int, world_size: int) -> dict[str, Any]:
    """A fused step whose moment is replicated while its parameter is sharded: DTensor redistributes, so it is
    left to DTensor; and a copy into a sharded tensor from a replicated one, within copies_between_shards."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(12.0).reshape(6, 2)

    def step() -> torch.Tensor:
        param = distribute_tensor(full.clone(), mesh, [Shard(0)])
        grad = distribute_tensor(torch.ones(6, 2), mesh, [Shard(0)])
        moment = distribute_tensor(torch.full((6, 2), 0.5), mesh, [Replicate()])
        second = distribute_tensor(torch.ones(6, 2), mesh, [Shard(0)])
        steps = [torch.tensor(1.0)]
        kwargs = {"lr": 0.1, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.0, "eps": 1e-8}
        torch._fused_adamw_([param], [grad], [moment], [second], [], steps, amsgrad=False, maximize=False, **kwargs)
        return param.full_tensor()

    torchs = step()
    shard_local_ops.take_over_step_ops()
    ours = step()
    target = distribute_tensor(torch.zeros(6, 2), mesh, [Shard(0)])
    with shard_local_ops.copies_between_shards():
        target.copy_(distribute_tensor(full, mesh, [Replicate()]))
    return {
        "same_step": torch.equal(torchs, ours),
        "copied": torch.equal(target.full_tensor(), full),
        "copy_left": torch.ops.aten.copy_.default in DTensor._op_dispatcher._custom_op_handlers,
    }


@pytest.mark.timeout(120)
def test_operands_laid_out_otherwise_go_to_dtensor() -> None:
    for result in run_ranks(2, mixed_layouts):
        assert result == {"same_step": True, "copied": True, "copy_left": False}


def detached(rank: int, world_size: int) -> dict[str, Any]:
    """Each layout's detach by DTensor's way and then on the shards, compared here (specs hold the mesh); and the
    ops FSDP's build of a model on a mesh nothing is cached for asked DTensor's sharding propagation, either way."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    from elastic.process_groups import forget_device_meshes

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(14.0).reshape(7, 2)  # uneven shards at 3 ranks
    layouts = {
        "sharded": lambda: distribute_tensor(full, mesh, [Shard(0)]),
        "replicated": lambda: distribute_tensor(full, mesh, [Replicate()]),
        "pending sum": lambda: DTensor.from_local(full * (rank + 1), mesh, [Partial()]),
    }
    asked: list[str] = []
    propagate = ShardingPropagator.propagate_op_sharding_non_cached

    def counted(self: ShardingPropagator, op_schema: Any) -> Any:
        asked.append(str(op_schema.op))
        return propagate(self, op_schema)

    def detach_each() -> dict[str, tuple[Any, ...]]:
        results = {}
        for name, make in layouts.items():
            tensor = make().requires_grad_()
            detached = tensor.detach()
            shares = detached.to_local().data_ptr() == tensor.to_local().data_ptr()
            results[name] = (detached._spec, detached.to_local().clone(), shares, detached.requires_grad)
        return results

    def build_asks() -> list[str]:
        forget_device_meshes()
        asked.clear()
        sharded_model()
        return [op for op in asked if op == "aten.detach.default"]

    ShardingPropagator.propagate_op_sharding_non_cached = counted  # type: ignore[method-assign]
    torchs, torch_asks = detach_each(), build_asks()
    shard_local_ops.take_over_step_ops()
    ours, our_asks = detach_each(), build_asks()
    same = {
        name: (torchs[name][0] == ours[name][0], torch.equal(torchs[name][1], ours[name][1]), *ours[name][2:])
        for name in layouts
    }
    return {"same": same, "torch_asks": len(torch_asks), "our_asks": len(our_asks)}


@pytest.mark.timeout(120)
def test_detach_on_the_shards_keeps_dtensors_layout() -> None:
    """fully_shard detaches every sharded parameter: on a new round's mesh each shape cost DTensor a sharding
    propagation (30-130 ms of a re-entry at 6 ranks on 2 cores). On the shards, a detach of a sharded, replicated or
    pending DTensor has DTensor's spec and values, is a view of the same shard and needs no gradient, and FSDP's
    build asks DTensor for none."""
    for result in run_ranks(3, detached):
        assert result["same"] == {name: (True, True, True, False) for name in ("sharded", "replicated", "pending sum")}
        assert result["torch_asks"] > 0 and result["our_asks"] == 0, result
