"""The private torch APIs behind elastic.checkpoint.torch_internals: present in this torch, and each public
fallback gives what the private path gives. A torch upgrade that removes one fails here, loudly."""

from __future__ import annotations

import io

import pytest
import torch

from elastic.checkpoint import torch_internals
from elastic.checkpoint.torch_internals import RecordView, flat_keys, flatten_like_dcp, storage_record_offset

pytestmark = pytest.mark.timeout(60)


def test_this_torch_offers_every_private_path():
    missing = [name for name, present in torch_internals.PRIVATE_APIS.items() if not present]
    assert not missing, (
        f"torch {torch.__version__} lacks {missing} (checked with {torch_internals.CHECKED_WITH_TORCH}): the public "
        "fallbacks run, slower; update elastic/checkpoint/torch_internals.py for this torch"
    )


def nested_state() -> dict:
    return {
        "model": {"layer.weight": torch.ones(2, 2), "layer.bias": torch.zeros(2)},
        "optim": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}},
            "param_groups": [{"lr": 0.1, "params": [0, 1], "betas": (0.9, 0.95)}],
        },
        "dataloader": {"samples_consumed": 96, "seed": 7},
        "tensors": [torch.ones(1), torch.zeros(1)],
        "plain": [1, 2, 3],
        "pair": (torch.ones(1), 2),
    }


def test_the_flattening_fallback_gives_dcp_s_keys():
    private = flat_keys(nested_state())
    fallback = flatten_like_dcp(nested_state())
    assert list(private) == list(fallback)
    assert "optim.state.0.exp_avg" in fallback and "tensors.1" in fallback and "plain" in fallback
    assert "optim.param_groups.0.lr" in fallback, "a list of mappings is walked by index"


def test_a_record_view_is_a_file_of_its_own_that_torch_load_reads():
    buffer = io.BytesIO()
    torch.save(torch.arange(6.0).reshape(2, 3), buffer)
    record = buffer.getvalue()
    file = io.BytesIO(b"x" * 100 + record + b"y" * 50)
    view = RecordView(file, 100, len(record))
    assert view.read(4) == record[:4] and view.tell() == 4
    view.seek(0)
    assert torch.equal(torch.load(view, weights_only=True), torch.arange(6.0).reshape(2, 3))
    view.seek(-3, io.SEEK_END)
    assert view.read() == record[-3:]


def test_the_storage_offset_points_at_the_tensor_bytes():
    values = torch.arange(8, dtype=torch.float32)
    buffer = io.BytesIO()
    torch.save(values, buffer)
    record = buffer.getvalue()
    found = storage_record_offset(io.BytesIO(record), 0, len(record))
    assert found is not None
    offset, name = found
    assert name.startswith("data/")
    assert record[offset : offset + 32] == values.numpy().tobytes()
