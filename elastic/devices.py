"""Where a rank computes and how it talks: the device and process-group backend from `auto|cpu|cuda` and
`auto|gloo|nccl`, decided as torchrun users expect (NCCL on `cuda:LOCAL_RANK` where CUDA is present)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch

DeviceChoice = Literal["auto", "cpu", "cuda"]
BackendChoice = Literal["auto", "gloo", "nccl"]


class PlacementError(ValueError):
    """A device/backend combination that cannot work here, named with its fix."""


@dataclass(frozen=True)
class Placement:
    device: torch.device
    backend: str


def choose_placement(device: DeviceChoice, backend: BackendChoice, local_rank: int, cuda_devices: int) -> Placement:
    """The device and backend of the rank with `local_rank` on a node with `cuda_devices` visible devices."""
    if device == "cuda" and cuda_devices == 0:
        raise PlacementError("--device cuda: no CUDA device is visible here; pass --device cpu (or auto)")
    on_cuda = device == "cuda" or (device == "auto" and cuda_devices > 0)
    if on_cuda and local_rank >= cuda_devices:
        raise PlacementError(
            f"local rank {local_rank} has no GPU of its own ({cuda_devices} visible): start at most "
            f"{cuda_devices} workers per node (--nproc-per-node gpu)"
        )
    if backend == "nccl" and not on_cuda:
        raise PlacementError("--backend nccl needs CUDA tensors: pass --backend gloo (or auto) for --device cpu")
    chosen = backend if backend != "auto" else ("nccl" if on_cuda else "gloo")
    return Placement(torch.device("cuda", local_rank) if on_cuda else torch.device("cpu"), chosen)


def placement_here(device: DeviceChoice, backend: BackendChoice) -> Placement:
    """`choose_placement` for this process (LOCAL_RANK from the launcher); selects its CUDA device."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    placement = choose_placement(device, backend, local_rank, torch.cuda.device_count())
    if placement.device.type == "cuda":
        torch.cuda.set_device(placement.device)
    return placement
