"""A Transformers Trainer job (a tiny GPT-2 on generated tokens) that resumes from node memory after a node loss.

Run it as a torchrun script, on each node (or --standalone on one):

    OMP_NUM_THREADS=1 elastic-run --nnodes 2:3 --nproc-per-node 1 --rdzv-endpoint etcd:2379 --rdzv-id gpt2 \
        examples/integrations/hf_trainer.py --output-dir /shared/gpt2

`ElasticCallback` snapshots the model, optimizer, LR schedule, step and data position into node memory every step
and to disk every --save-steps; a new round after a node loss resumes from the newest snapshot, at most one step
back. With --plain the Trainer runs unchanged: it resumes from its own last checkpoint-<N>.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from elastic.integrations.hf import ElasticCallback
from elastic.sample_log import append_sample_log


class TokenWindows(Dataset):
    """Windows of a token stream from a seeded bigram walk: learnable, the same on every rank, no download."""

    def __init__(self, samples: int, seq_len: int, vocab: int) -> None:
        generator = torch.Generator().manual_seed(1234)
        successors = torch.randint(vocab, (vocab, 3), generator=generator)
        tokens = [0]
        for choice in torch.randint(3, (samples * seq_len,), generator=generator).tolist():
            tokens.append(int(successors[tokens[-1], choice]))
        self.windows = torch.tensor(tokens[: samples * seq_len]).view(samples, seq_len)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[index], "labels": self.windows[index]}


class SampleLog(TrainerCallback):
    """One JSON line per rank and step (step, rank, world size, round, samples, time), after ElasticCallback's."""

    def __init__(self, path: Path, elastic: ElasticCallback | None) -> None:
        self.path = path
        self.elastic = elastic

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        record = {
            "step": state.global_step,
            "rank": int(os.environ.get("RANK", "0")),
            "world_size": int(os.environ.get("WORLD_SIZE", "1")),
            "round": int(os.environ.get("ELASTIC_ROUND", "0")),
            "samples": self.elastic.last_samples if self.elastic else [],
            "time": time.time(),
        }
        append_sample_log(self.path, record)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, required=True, help="the Trainer's output_dir, shared by all nodes")
    parser.add_argument("--steps", type=int, default=200, help="max_steps")
    parser.add_argument("--global-batch", type=int, default=12, help="samples per step over all ranks")
    parser.add_argument("--save-steps", type=int, default=20, help="the Trainer's (and the disk checkpoints') schedule")
    parser.add_argument("--plain", action="store_true", help="no ElasticCallback: the Trainer unchanged")
    parser.add_argument("--sample-log", type=Path, help="append one JSON line per rank and step")
    config = parser.parse_args()

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    dataset = TokenWindows(samples=2048, seq_len=16, vocab=64)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2))
    args = TrainingArguments(
        output_dir=str(config.output_dir),
        max_steps=config.steps,
        per_device_train_batch_size=max(1, config.global_batch // world_size),  # --plain: its own sampler's batch
        learning_rate=1e-3,
        save_steps=config.save_steps,
        save_total_limit=2,
        logging_steps=10,
        use_cpu=True,
        ddp_backend="gloo",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    elastic = None if config.plain else ElasticCallback(global_batch=config.global_batch)
    callbacks: list[TrainerCallback] = [elastic] if elastic else []
    if config.sample_log:
        callbacks.append(SampleLog(config.sample_log, elastic))
    trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=callbacks)
    resume = None
    if config.plain and config.output_dir.is_dir():
        resume = get_last_checkpoint(str(config.output_dir))  # what a job does on its own: its last checkpoint-<N>
    trainer.train(resume_from_checkpoint=resume)


if __name__ == "__main__":
    main()
