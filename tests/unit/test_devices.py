"""The device and backend a rank gets from --device/--backend, as a table: no GPU needed."""

from __future__ import annotations

import pytest
import torch

from elastic.devices import PlacementError, choose_placement

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    "device, backend, local_rank, gpus, expected",
    [
        ("auto", "auto", 0, 0, ("cpu", "gloo")),
        ("auto", "auto", 3, 8, ("cuda:3", "nccl")),
        ("cpu", "auto", 1, 8, ("cpu", "gloo")),
        ("cuda", "auto", 1, 2, ("cuda:1", "nccl")),
        ("cuda", "gloo", 0, 1, ("cuda:0", "gloo")),
        ("auto", "gloo", 0, 0, ("cpu", "gloo")),
    ],
)
def test_choice(device, backend, local_rank, gpus, expected):
    placement = choose_placement(device, backend, local_rank, gpus)
    assert (str(placement.device), placement.backend) == expected


@pytest.mark.parametrize(
    "device, backend, local_rank, gpus, message",
    [
        ("cuda", "auto", 0, 0, "--device cuda: no CUDA device is visible here; pass --device cpu (or auto)"),
        ("auto", "nccl", 0, 0, "--backend nccl needs CUDA tensors: pass --backend gloo (or auto) for --device cpu"),
        ("cpu", "nccl", 0, 4, "--backend nccl needs CUDA tensors: pass --backend gloo (or auto) for --device cpu"),
        (
            "auto",
            "auto",
            2,
            2,
            "local rank 2 has no GPU of its own (2 visible): start at most 2 workers per node (--nproc-per-node gpu)",
        ),
    ],
)
def test_impossible_choices_name_the_fix(device, backend, local_rank, gpus, message):
    with pytest.raises(PlacementError) as error:
        choose_placement(device, backend, local_rank, gpus)
    assert str(error.value) == message


def test_auto_on_a_gpu_machine_is_nccl_on_the_local_device_and_selects_it(monkeypatch):
    """A machine with 2 GPUs, as torch.cuda reports it (this one has none): local rank 1 takes cuda:1."""
    from elastic.devices import placement_here

    selected = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", selected.append)
    monkeypatch.setenv("LOCAL_RANK", "1")
    placement = placement_here("auto", "auto")
    assert placement.backend == "nccl" and placement.device == torch.device("cuda", 1)
    assert selected == [torch.device("cuda", 1)]
