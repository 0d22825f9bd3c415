"""Refuses per-rank values on save: DCP keeps one copy of a replicated key, so per-rank state would be lost silently.

Every non-tensor value, and every small plain tensor (RNG states, counters), must be the same on every
rank. Large plain tensors are not compared: hashing them would cost a pass over the model, and they
are replicated parameters in practice. DTensors are sharded by design and skipped.
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from elastic.checkpoint.ranks import Ranks
from elastic.checkpoint.torch_internals import flat_keys

SMALL_TENSOR_BYTES = 64 * 1024


class PerRankStateError(ValueError):
    """A value that differs across ranks, which a checkpoint cannot keep for every rank."""


def _digest(value: Any) -> str | None:
    if isinstance(value, DTensor):
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() * value.element_size() > SMALL_TENSOR_BYTES:
            return None
        raw = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return hashlib.blake2b(f"{value.dtype}{tuple(value.shape)}".encode() + raw, digest_size=16).hexdigest()
    return hashlib.blake2b(pickle.dumps(value), digest_size=16).hexdigest()


def fingerprint(state_dict: dict[str, Any]) -> dict[str, str]:
    """Digest of every flattened key whose value must be identical on all ranks."""
    flat = flat_keys(state_dict)
    digests = {key: _digest(value) for key, value in flat.items()}
    return {key: digest for key, digest in digests.items() if digest is not None}


def reject_per_rank_values(state_dict: dict[str, Any], ranks: Ranks) -> None:
    """Raise PerRankStateError on every rank when a key exists on some ranks only or its value differs."""
    if ranks.world_size == 1:
        return
    fingerprints = ranks.gather(fingerprint(state_dict))
    reference = fingerprints[0]
    for rank, theirs in enumerate(fingerprints[1:], start=1):
        differing = sorted(set(reference.items()) ^ set(theirs.items()))
        if differing:
            key = differing[0][0]
            present = "differs between" if key in reference and key in theirs else "exists on only one of"
            raise PerRankStateError(
                f"checkpoint key {key!r} {present} rank 0 and rank {rank}: a checkpoint keeps one copy of such a "
                "value, so per-rank state would be lost or break on resize; keep this state global (derive it "
                "from the global step or the samples consumed) instead of per rank"
            )
