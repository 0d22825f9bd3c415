"""Randomness derived from (seed, step, sample index) instead of per-rank RNG state.

A checkpoint cannot hold per-rank RNG state (it would not survive a resize),
so every random draw that touches a sample is re-derived from global
coordinates: the same sample at the same step sees the same random numbers on
whichever rank, at whatever world size, processes it.
"""

from __future__ import annotations

import hashlib
import random
import struct
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager

import numpy as np
import torch

# numpy's legacy global seed must fit in 32 bits; torch and python take 64.
_NUMPY_SEED_MODULUS = 2**32


def derive_seed(seed: int, *keys: int) -> int:
    """A 63-bit seed that depends only on `seed` and `keys`, stable across processes.

    Python's `hash()` is salted per process, so a cryptographic hash is used instead.
    """
    packed = struct.pack(f"<{1 + len(keys)}q", seed, *keys)
    digest = hashlib.blake2b(packed, digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def sample_generator(seed: int, step: int, index: int) -> torch.Generator:
    """A torch generator private to one sample at one step."""
    generator = torch.Generator()
    generator.manual_seed(derive_seed(seed, step, index))
    return generator


def seed_all(seed: int) -> None:
    """Seed python, numpy and torch global RNGs.

    A trainer calls it with `derive_seed(seed, step)` at the start of every step: global RNG state
    then never needs a checkpoint, since a resumed run re-creates it at any world size.
    """
    random.seed(seed)
    np.random.seed(seed % _NUMPY_SEED_MODULUS)
    torch.manual_seed(seed)


@contextmanager
def seeded_rng(seed: int) -> Iterator[None]:
    """Seed python, numpy and torch global RNGs; restore their previous states on exit.

    Code that draws from the global RNGs (augmentations written against
    `random` or `np.random`) becomes deterministic inside the block without
    disturbing the caller's streams.
    """
    python_state = random.getstate()
    numpy_state = np.random.get_state()
    torch_state = torch.random.get_rng_state()
    seed_all(seed)
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        torch.random.set_rng_state(torch_state)


def sample_rng(seed: int, step: int, index: int) -> AbstractContextManager[None]:
    """`seeded_rng` for one sample at one step: use around a per-sample augmentation."""
    return seeded_rng(derive_seed(seed, step, index))


def per_sample_dropout(x: torch.Tensor, p: float, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """Dropout whose mask for row b is drawn from `generators[b]` alone.

    With ordinary dropout the mask of a sample depends on its position in the
    local batch, hence on the world size; here it depends only on the sample.
    Each call advances the generators, so successive layers get fresh masks.
    """
    if p == 0.0:
        return x
    if len(generators) != x.shape[0]:
        raise ValueError(f"per_sample_dropout needs one generator per row: {len(generators)} for {x.shape[0]} rows")
    keep = torch.stack([torch.rand(x.shape[1:], generator=g, device="cpu") >= p for g in generators]).to(x.device)
    return x * keep / (1.0 - p)
