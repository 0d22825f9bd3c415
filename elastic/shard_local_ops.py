"""DTensor ops run on the local shards where DTensor itself would run them there, without its sharding propagation.

DTensor works out the layout of each op's output once per op, mesh and input layouts, through fake tensors, and
caches it. A new round's mesh finds nothing cached (and a new process nothing at all), so every distinct op pays
again at each round change: on 2 cores at 6 ranks, loading a model's state dict spent 0.2 s of a 0.55 s load
copying each parameter, and the first fused AdamW step 0.28 s of a 0.44 s first step.

These ops are taken over where DTensor would redistribute nothing and run the op on the local shards, which is
what is done here; the first two while each operand is laid out as the parameter it goes with (the same mesh,
placements, shape, stride and dtype, and this process at the same coordinates of both meshes):
- ``copy_``, within `copies_between_shards` (ModelState's load);
- the fused Adam and AdamW steps (``_fused_adam_``, ``_fused_adamw_``: torchtitan's default), which are elementwise
  within each parameter's tensors;
- gradient clipping's ops (`torch.nn.utils.clip_grad_norm_`, torchtitan's ``clip_grad_norm_``) over sharded or
  replicated gradients: ``_foreach_norm``, whose per-shard norms DTensor marks as pending the same reduction
  across the sharded mesh dimensions; ``stack`` of those 0-dim norms, laid out alike; and ``_foreach_mul_`` by a
  number or a 0-dim tensor every rank holds. At 300 parameters on 2 ranks their first call on a new mesh cost
  0.9 s, and torchtitan clips at every step. Then torch's clip coefficient from the replicated total norm,
  ``(max_norm / (total + eps)).clamp(max=1)``: ``add``, ``reciprocal``, ``mul`` and ``clamp`` of DTensors all
  replicated on one mesh run on the local tensors (5-50 ms of a re-entry's first step at 6 ranks on 2 cores);
- ``detach``, which keeps any layout (DTensor's strategy is its input's): FSDP2's ``fully_shard`` detaches each
  sharded parameter, and at 6 ranks on 2 cores the 8 shapes of examples/train.py cost 30-130 ms of every
  re-entered round's model build.
The last three kinds once `take_over_step_ops` ran (`elastic.run` does). Any other call of these ops goes to
DTensor unchanged.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._ops._math_ops import _get_norm_reduction_op, get_placement_from_reduction_op
from torch.distributed.tensor.placement_types import Placement, _is_shard_like

Handler = Callable[[Any, tuple[object, ...], dict[str, object]], Any]

_lock = threading.RLock()  # guards DTensor's table of op handlers while one is taken out of it or put in
_FUSED_STEPS = ("_fused_adam_", "_fused_adamw_")  # the fused steps DTensor runs (2.13: not SGD's, Adagrad's)
# torch.nn.utils.clip_grad_norm_'s clip coefficient from the replicated total norm: (max / (norm + eps)).clamp(max=1)
_CLIPPING_ON_REPLICAS = (
    torch.ops.aten.add.Tensor,
    torch.ops.aten.reciprocal.default,
    torch.ops.aten.mul.Tensor,
    torch.ops.aten.clamp.default,
)


def laid_out_alike(target: Any, source: Any) -> bool:
    """Whether both are DTensors of one layout of which this process holds the same part (meshes of one shape
    compare equal whatever this process's place in them, hence the coordinates)."""
    return (
        isinstance(target, DTensor)
        and isinstance(source, DTensor)
        and target._spec == source._spec
        and target.device_mesh.get_coordinate() == source.device_mesh.get_coordinate()
        and target._local_tensor.shape == source._local_tensor.shape
    )


@contextlib.contextmanager
def copies_between_shards() -> Iterator[None]:
    """Within it, a DTensor ``copy_`` from a DTensor laid out alike copies the local shards."""
    copy = torch.ops.aten.copy_.default
    installed = _install(copy, _copy_between_shards)
    try:
        yield
    finally:
        if installed:
            with _lock:
                _handlers().pop(copy, None)


def take_over_step_ops() -> None:
    """From now on, run fused optimizer steps, gradient clipping and detaches of DTensors on their local shards
    wherever DTensor would run them there (idempotent)."""
    for name in _FUSED_STEPS:
        packet = getattr(torch.ops.aten, name, None)
        for overload in packet.overloads() if packet is not None else ():
            _install(getattr(packet, overload), _fused_step_on_shards)
    _install(torch.ops.aten._foreach_norm.Scalar, _norms_on_shards)
    _install(torch.ops.aten.stack.default, _stack_of_scalars)
    _install(torch.ops.aten._foreach_mul_.Scalar, _scaling_on_shards)
    _install(torch.ops.aten._foreach_mul_.Tensor, _scaling_on_shards)
    _install(torch.ops.aten.detach.default, _detach_on_shards)
    for op in _CLIPPING_ON_REPLICAS:
        _install(op, _elementwise_on_replicas)


def _handlers() -> dict[Any, Any]:
    return DTensor._op_dispatcher._custom_op_handlers


def _install(op: Any, handler: Handler) -> bool:
    """Put `handler` in DTensor's table for `op`, unless torch (or an earlier call) handles it already."""
    with _lock:
        if op in _handlers():
            return False
        _handlers()[op] = handler
        return True


def _dtensors_way(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], handler: Handler) -> Any:
    """`op` through DTensor's own dispatch, with `handler` out of its table meanwhile."""
    with _lock:
        _handlers().pop(op)
        try:
            return op(*args, **kwargs)
        finally:
            _handlers()[op] = handler


def _copy_between_shards(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    target, source = args[0], args[1]
    if len(args) == 2 and not kwargs and laid_out_alike(target, source):
        target._local_tensor.copy_(source._local_tensor)
        return target
    return _dtensors_way(op, args, kwargs, _copy_between_shards)


def _fused_step_on_shards(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    local = _local_operands(args, kwargs)
    if local is None:
        return _dtensors_way(op, args, kwargs, _fused_step_on_shards)
    return op(*local[0], **local[1])


def _detach_on_shards(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    tensor = args[0]
    if len(args) != 1 or kwargs or not isinstance(tensor, DTensor):
        return _dtensors_way(op, args, kwargs, _detach_on_shards)
    # a view of the same shard, in the same layout, pending reductions and all, as DTensor's strategy gives it
    return DTensor(op(tensor._local_tensor), tensor._spec, requires_grad=False)


def _norms_on_shards(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    tensors, order = args[0], args[1] if len(args) > 1 else 2
    if not tensors or not isinstance(order, (int, float)) or not all(isinstance(t, DTensor) for t in tensors):
        return _dtensors_way(op, args, kwargs, _norms_on_shards)
    # a few layouts for many tensors: each layout's placements, and its spec, made once
    keys = [(id(tensor._spec.mesh), tensor._spec.placements) for tensor in tensors]
    if not all(_no_reduction_pending(placements) for _, placements in set(keys)):
        return _dtensors_way(op, args, kwargs, _norms_on_shards)
    pending = get_placement_from_reduction_op(_get_norm_reduction_op(order))
    norms = op([tensor._local_tensor for tensor in tensors], *args[1:], **kwargs)
    specs: dict[tuple[int, tuple[Placement, ...]], DTensorSpec] = {}
    wrapped = []
    for tensor, key, norm in zip(tensors, keys, norms, strict=True):
        if key not in specs:
            # where DTensor leaves a norm: its reduction pending on each mesh dimension that shards the tensor
            placements = tuple(pending if _is_shard_like(p) else p for p in key[1])
            specs[key] = _scalar_spec(norm, tensor._spec.mesh, placements)
        wrapped.append(DTensor(norm, specs[key], requires_grad=norm.requires_grad))
    return wrapped


def _scalar_spec(local: torch.Tensor, mesh: Any, placements: tuple[Placement, ...]) -> DTensorSpec:
    """The spec of a DTensor no dimension of which is sharded, of which this rank holds `local`."""
    return DTensorSpec(mesh, placements, TensorMeta(local.shape, local.stride(), local.dtype))


def _stack_of_scalars(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    tensors, first = args[0], args[0][0] if args[0] else None
    if (
        kwargs
        or not isinstance(first, DTensor)
        or first.dim() != 0
        or not all(
            isinstance(tensor, DTensor) and tensor.dim() == 0 and tensor._spec == first._spec for tensor in tensors
        )
    ):
        return _dtensors_way(op, args, kwargs, _stack_of_scalars)
    stacked = op([tensor._local_tensor for tensor in tensors], *args[1:])
    return DTensor(
        stacked, _scalar_spec(stacked, first.device_mesh, first.placements), requires_grad=stacked.requires_grad
    )


def _scaling_on_shards(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    tensors, factor = args
    if (
        kwargs
        or not tensors
        or not all(isinstance(t, DTensor) and _no_reduction_pending(t.placements) for t in tensors)
    ):
        return _dtensors_way(op, args, kwargs, _scaling_on_shards)
    if isinstance(factor, torch.Tensor):
        if not _scalar(factor):
            return _dtensors_way(op, args, kwargs, _scaling_on_shards)
        factor = factor._local_tensor if isinstance(factor, DTensor) else factor
    return op([tensor._local_tensor for tensor in tensors], factor)


def _elementwise_on_replicas(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """An elementwise op of DTensors replicated on one mesh (and numbers): every rank holds every operand whole,
    so DTensor runs it on the local tensors and replicates the result."""
    operands = [*args, *kwargs.values()]
    tensors = [operand for operand in operands if isinstance(operand, torch.Tensor)]
    first = tensors[0] if tensors else None
    if not isinstance(first, DTensor) or not all(
        isinstance(tensor, DTensor) and tensor.device_mesh == first.device_mesh and _replicated(tensor)
        for tensor in tensors
    ):
        return _dtensors_way(op, args, kwargs, _elementwise_on_replicas)
    local = op(
        *(arg._local_tensor if isinstance(arg, DTensor) else arg for arg in args),
        **{key: value._local_tensor if isinstance(value, DTensor) else value for key, value in kwargs.items()},
    )
    return DTensor(local, _scalar_spec(local, first.device_mesh, first.placements), requires_grad=local.requires_grad)


def _no_reduction_pending(placements: tuple[Placement, ...]) -> bool:
    """Each rank's part of a DTensor so placed is a part of its value (sharded or replicated; DTensor would
    redistribute a pending reduction first)."""
    return all(_is_shard_like(p) or isinstance(p, Replicate) for p in placements)


def _local_operands(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]] | None:
    """The arguments of a fused step with each DTensor replaced by its local shard, or None where DTensor might
    lay them out otherwise: every tensor of a list laid out as the parameter at its place, or a scalar."""
    params = args[0]
    if not params or not all(isinstance(param, DTensor) for param in params):
        return None
    local_args: list[Any] = [[param._local_tensor for param in params]]
    for arg in args[1:]:
        if not isinstance(arg, (list, tuple)):
            return None
        if arg and len(arg) != len(params):
            return None
        local_list = []
        for param, tensor in zip(params, arg, strict=False):
            if laid_out_alike(param, tensor) or _scalar(tensor):
                local_list.append(tensor._local_tensor if isinstance(tensor, DTensor) else tensor)
            else:
                return None
        local_args.append(local_list)
    local_kwargs = {}
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            if not _scalar(value):
                return None
            value = value._local_tensor if isinstance(value, DTensor) else value
        local_kwargs[key] = value
    return local_args, local_kwargs


def _scalar(tensor: Any) -> bool:
    """A 0-dim tensor whose whole value every rank holds: a plain one, or a replicated DTensor."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 0:
        return False
    return not isinstance(tensor, DTensor) or _replicated(tensor)


def _replicated(tensor: DTensor) -> bool:
    """Every rank holds the whole value."""
    return all(placement.is_replicate() for placement in tensor.placements)
