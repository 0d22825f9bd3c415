"""The scripts under examples/ as modules, for tests that call their functions without starting a process."""

from __future__ import annotations

import functools
import importlib.util
import sys
import types
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@functools.cache
def load_example(name: str) -> types.ModuleType:
    """examples/<name>.py, imported once per test process."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None, name
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic resolves a config's annotations through it
    spec.loader.exec_module(module)
    return module
