"""A torchtitan dataloader whose position is a function of the global step, so any data-parallel degree resumes it.

torchtitan's own text dataloader streams each data-parallel rank's shard of a dataset and checkpoints how far that
rank got (``dataloader.dp_rank_<r>``); at another degree the shards differ and no position carries over.
``ElasticDataLoader`` reads fixed windows of a file of token ids (``dataset_path``: nanoGPT's ``.bin`` or a
``.npy`` array) in the order of ``elastic.sampling.ElasticSampler``: global batch k is a fixed slice of a seeded
permutation of the windows, each rank takes its part at the current degree, and the only progress is global
(seed, epoch, samples consumed). Its checkpoint loads at any degree, and it regenerates itself from the step when
the checkpoint holds torchtitan's per-rank positions instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torchtitan.components.dataloader import BaseDataLoader

from elastic.sampling import ElasticSampler, SamplingConfig


class TokenWindows:
    """Samples of ``seq_len + 1`` tokens from a file of token ids, window i starting at token ``i * seq_len``.

    A ``.npy`` file holds its own dtype; any other file is raw token ids of ``dtype`` (nanoGPT's ``.bin``:
    uint16). The file is mapped, not read.
    """

    def __init__(self, path: str | Path, seq_len: int, dtype: str = "uint16") -> None:
        source = Path(path)
        if not source.is_file():
            raise FileNotFoundError(f"dataset_path {source} is not a file of token ids (.bin of {dtype}, or .npy)")
        tokens = np.load(source, mmap_mode="r") if source.suffix == ".npy" else np.memmap(source, dtype, mode="r")
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(
                f"{source} holds {tokens.dtype} of shape {tokens.shape}; it must be a flat array of token ids"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        if len(self) == 0:
            raise ValueError(f"{source} has {len(tokens)} tokens: fewer than one sample of seq_len {seq_len} + 1")

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> torch.Tensor:
        start = index * self.seq_len
        return torch.from_numpy(np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64))


class ElasticDataLoader(BaseDataLoader):
    """torchtitan's dataloader interface over ``TokenWindows``, in ``ElasticSampler``'s order: select it with
    ``dataloader=ElasticDataLoader.Config(dataset_path=..., global_batch_size=...)``.

    Each ``next`` gives one micro-batch of ``local_batch_size`` samples as torchtitan expects, ``({"input": ...,
    "positions": ...}, labels)``; a step takes ``global_batch_size / (local_batch_size * dp_world_size)`` of
    them (torchtitan's gradient accumulation). The step counts as consumed when its last micro-batch is handed
    out, so a checkpoint saved after the step records it.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        global_batch_size: int = -1
        """Samples per optimizer step over all data-parallel ranks: fixed for the whole run, whatever the degree
        (torchtitan's training.global_batch_size; required)."""

        token_dtype: str = "uint16"
        """dtype of the token ids in a raw (non-.npy) dataset file."""

        seed: int = 0
        """Seed of the per-epoch permutations of the windows."""

        shuffle: bool = True
        """False: every epoch in file order."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        seq_len: int,
        local_batch_size: int,
        **_: Any,  # the tokenizer and snapshot interval torchtitan passes every dataloader: the windows need neither
    ) -> None:
        if not config.dataset_path:
            raise ValueError("ElasticDataLoader needs dataloader.dataset_path: a file of token ids (.bin or .npy)")
        if config.global_batch_size <= 0:
            raise ValueError(
                "ElasticDataLoader needs dataloader.global_batch_size (the same as training.global_batch_size): "
                "a global batch fixed across resizes is what lets the data order survive them"
            )
        per_pass = local_batch_size * dp_world_size
        if config.global_batch_size % per_pass:
            raise ValueError(
                f"global_batch_size {config.global_batch_size} is not a multiple of local_batch_size "
                f"{local_batch_size} x data-parallel degree {dp_world_size}; pick one that every degree the job "
                "may run at divides"
            )
        self.dataset = TokenWindows(config.dataset_path, seq_len, config.token_dtype)
        sampling = SamplingConfig(
            dataset_size=len(self.dataset),
            global_batch=config.global_batch_size,
            micro_batch=local_batch_size,
            seed=config.seed,
            shuffle=config.shuffle,
        )
        self.sampler = ElasticSampler(sampling, rank=dp_rank, world_size=dp_world_size)
        self.positions = torch.arange(seq_len)

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            plan = self.sampler.step_plan()
            for index, micro_batch in enumerate(plan):
                samples = torch.stack([self.dataset[sample] for sample in micro_batch.indices])
                if index == len(plan) - 1:
                    self.sampler.complete_step()
                positions = self.positions.repeat(len(micro_batch.indices), 1)
                yield {"input": samples[:, :-1], "positions": positions}, samples[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state_dict)

    def regenerate_state(self, step: int) -> None:
        self.sampler.regenerate_state(step)
