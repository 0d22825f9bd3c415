"""Make replicas identical: broadcast a module's parameters and buffers from one rank of a group."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from elastic.checkpoint.torch_internals import broadcast_tensors

BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024


def _local(tensor: torch.Tensor) -> torch.Tensor:
    # A DTensor's shard is the same on every replica of an HSDP replicate group, so only it travels.
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def sync_module_states(module: torch.nn.Module, process_group: dist.ProcessGroup | None, src: int = 0) -> None:
    """Overwrite, in place, every parameter and buffer of ``module`` with those of rank ``src``.

    ``src`` is a rank within ``process_group`` (the default group when None). Tensors are packed into
    large buckets, so the cost is a few broadcasts rather than one per tensor.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    assert group is not None, "sync_module_states needs an initialized default process group"
    tensors = [_local(tensor) for tensor in (*module.parameters(), *module.buffers())]
    tensors = [tensor.detach() for tensor in tensors if tensor.numel() > 0]
    if tensors:
        broadcast_tensors(group, tensors, BROADCAST_BUCKET_BYTES, src)
