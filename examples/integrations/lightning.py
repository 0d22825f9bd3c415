"""A Lightning DDP job (a tiny next-token model on generated tokens) that resumes from node memory after a node loss.

Run it as a torchrun script, on each node (or --standalone on one):

    OMP_NUM_THREADS=1 elastic-run --nnodes 2:3 --nproc-per-node 1 --rdzv-endpoint etcd:2379 --rdzv-id tiny \
        examples/integrations/lightning.py --root-dir /shared/tiny

Lightning reads torchrun's environment; `num_nodes` must be the round's node count, GROUP_WORLD_SIZE. `ElasticCallback`
snapshots the module, optimizer, LR schedule, loop progress and data position into node memory every step and to disk
every --save-steps; a new round after a node loss resumes from the newest snapshot, at most one step back. With
--plain Lightning runs unchanged: a DistributedSampler, and it resumes from its own last.ckpt.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

# Run as a script, this file's folder leads sys.path, and this file is named lightning.py: without this line,
# `import lightning` would import the example itself.
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from elastic.integrations.lightning import ElasticCallback  # noqa: E402
from elastic.sample_log import append_sample_log  # noqa: E402


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

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.windows[index]


class NextToken(pl.LightningModule):
    def __init__(self, vocab: int = 64, width: int = 32) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, vocab))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.mlp(self.embedding(batch[:, :-1]))
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        self.log("loss", loss, prog_bar=False)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class SampleLog(pl.Callback):
    """One JSON line per rank and step (step, rank, world size, round, samples, time), after ElasticCallback's."""

    def __init__(self, path: Path, elastic: ElasticCallback | None) -> None:
        self.path = path
        self.elastic = elastic

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        record = {
            "step": trainer.global_step,
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "round": int(os.environ.get("ELASTIC_ROUND", "0")),
            "samples": self.elastic.last_samples if self.elastic else [],
            "time": time.time(),
        }
        append_sample_log(self.path, record)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root-dir", type=Path, required=True, help="the Trainer's default_root_dir, on every node")
    parser.add_argument("--steps", type=int, default=200, help="max_steps")
    parser.add_argument("--global-batch", type=int, default=12, help="samples per step over all ranks")
    parser.add_argument(
        "--save-steps", type=int, default=20, help="ModelCheckpoint's (and the disk checkpoints') steps"
    )
    parser.add_argument("--plain", action="store_true", help="no ElasticCallback: Lightning unchanged")
    parser.add_argument("--sample-log", type=Path, help="append one JSON line per rank and step")
    config = parser.parse_args()

    dataset = TokenWindows(samples=2048, seq_len=16, vocab=64)
    pl.seed_everything(0, verbose=False)
    model = NextToken()
    checkpoints = ModelCheckpoint(
        dirpath=config.root_dir / "checkpoints", every_n_train_steps=config.save_steps, save_top_k=-1, save_last=True
    )
    elastic = None if config.plain else ElasticCallback(global_batch=config.global_batch)
    callbacks: list[pl.Callback] = [checkpoints, *([elastic] if elastic else [])]
    if config.sample_log:
        callbacks.append(SampleLog(config.sample_log, elastic))
    trainer = pl.Trainer(
        default_root_dir=config.root_dir,
        accelerator="cpu",
        strategy="ddp",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", "1")),  # Lightning checks it against WORLD_SIZE
        max_steps=config.steps,
        callbacks=callbacks,
        use_distributed_sampler=elastic is None,  # the ElasticSampler shares each global batch out itself
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if elastic:
        trainer.fit(model, train_dataloaders=elastic.dataloader(dataset))
        return
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    loader = DataLoader(dataset, batch_size=max(1, config.global_batch // world_size), shuffle=True)
    last = config.root_dir / "checkpoints" / "last.ckpt"
    trainer.fit(model, train_dataloaders=loader, ckpt_path=last if last.is_file() else None)  # its own last save


if __name__ == "__main__":
    main()
