"""CheckpointManager with the model on a GPU: async saves stage through pinned host memory with non-blocking copies
(elastic/checkpoint/saver.py), and what is committed is the state at the save, not what training wrote over it
since. Needs CUDA; CI has none, so these run where one is (the device machine)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elastic.checkpoint import CheckpointManager, ModelState
from elastic.checkpoint.layout import step_dir

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def make_state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).cuda()
    return {"model": ModelState(model, torch.optim.AdamW(model.parameters(), lr=1e-3))}


def train(state: dict, steps: int = 1) -> None:
    model = state["model"].model
    for _ in range(steps):
        model(torch.randn(64, 256, device="cuda")).square().mean().backward()
        state["model"].optimizers[0].step()
        state["model"].optimizers[0].zero_grad()


def snapshot(state: dict) -> dict[str, torch.Tensor]:
    model, optimizer = state["model"].model, state["model"].optimizers[0]
    tensors = {f"model.{k}": v.detach().cpu().clone() for k, v in model.state_dict().items()}
    for index, per_param in optimizer.state_dict()["state"].items():
        tensors.update({f"optim.{index}.{k}": torch.as_tensor(v).cpu().clone() for k, v in per_param.items()})
    return tensors


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_a_gpu_model_saved_while_training_goes_on_loads_as_it_was_at_the_save(tmp_path: Path, async_save: bool) -> None:
    state = make_state(seed=0)
    manager = CheckpointManager(tmp_path, keep=2, async_save=async_save)
    assert manager.load_latest(state) is None  # step 0 saved: storage works
    train(state, steps=3)
    expected = snapshot(state)
    manager.save(3, state)
    train(state, steps=5)  # overwrites the parameters while the background write may still run
    manager.save(8, state)
    manager.close()

    fresh = make_state(seed=1)
    loader = CheckpointManager(tmp_path, check_at_start=False)
    assert loader.load_latest(fresh) == 8
    loader.close()
    assert next(fresh["model"].model.parameters()).is_cuda, "loaded onto the GPU the model lives on"

    # the step-3 checkpoint, committed while training went on, is exactly the state at that save
    older = make_state(seed=2)
    step_dir(tmp_path, 8).rename(tmp_path / "moved-aside")
    loader = CheckpointManager(tmp_path, check_at_start=False)
    assert loader.load_latest(older) == 3
    loader.close()
    got = snapshot(older)
    assert got.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key
