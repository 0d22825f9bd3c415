"""Exact comparison of nested checkpoint state (tensors, dicts, lists), naming the first path that differs."""

from __future__ import annotations

from typing import Any

import torch


def assert_identical(actual: Any, expected: Any, path: str = "") -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype, path
        assert torch.equal(actual, expected), f"{path} differs after the load"
    elif isinstance(expected, dict):
        assert set(actual) == set(expected), f"{path}: keys {sorted(actual)} != {sorted(expected)}"
        for key in expected:
            assert_identical(actual[key], expected[key], f"{path}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), path
        for index, (got, want) in enumerate(zip(actual, expected)):
            assert_identical(got, want, f"{path}.{index}")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"
