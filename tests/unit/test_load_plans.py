"""When DCP's load may take the local plan made to gather a snapshot's bytes: only for the same flat state, tensor
for tensor, and a checkpoint of exactly its keys."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.distributed.checkpoint.planner import LoadPlan

from elastic.checkpoint.load_plans import MadeLoadPlan

WEIGHT, STEP, BETAS = torch.zeros(2), torch.tensor(3), (0.9, 0.95)
KEYS = ("model.weight", "optim.step", "optim.betas")
MADE = MadeLoadPlan(LoadPlan([]), {"model.weight": WEIGHT, "optim.step": STEP, "optim.betas": BETAS})


def saved(*keys: str) -> Metadata:
    return Metadata(state_dict_metadata={key: BytesStorageMetadata() for key in keys})


@pytest.mark.parametrize(
    ("flat_state", "metadata", "serves"),
    [
        pytest.param({"model.weight": WEIGHT, "optim.step": STEP, "optim.betas": BETAS}, saved(*KEYS), True, id="same"),
        pytest.param(
            {"model.weight": WEIGHT, "optim.step": STEP, "optim.betas": [0.9, 0.95]},
            saved(*KEYS),
            True,
            id="a value flattened anew (read whole, whatever it is)",
        ),
        pytest.param(
            {"model.weight": torch.zeros(2), "optim.step": STEP, "optim.betas": BETAS},
            saved(*KEYS),
            False,
            id="another tensor under a key (DCP set up a meta tensor anew)",
        ),
        pytest.param(
            {"model.weight": WEIGHT, "optim.step": 3, "optim.betas": BETAS},
            saved(*KEYS),
            False,
            id="a value where a tensor was",
        ),
        pytest.param({"model.weight": WEIGHT}, saved("model.weight"), False, id="an entry left out (regenerated)"),
        pytest.param(
            {"model.weight": WEIGHT, "optim.step": STEP, "optim.betas": BETAS},
            saved("model.weight", "optim.step"),
            False,
            id="the checkpoint lacks a key (a strict load raises)",
        ),
        pytest.param(
            {"model.weight": WEIGHT, "optim.step": STEP, "optim.betas": BETAS},
            saved(*KEYS, "dataloader.dp_rank_3"),
            False,
            id="the checkpoint has more keys (DCP may read it as pre-2.4)",
        ),
    ],
)
def test_a_made_plan_serves_only_the_state_it_was_made_for(
    flat_state: dict[str, Any], metadata: Metadata, serves: bool
) -> None:
    assert MADE.serves(flat_state, metadata) is serves
