"""Reference trainer: a small character-level GPT that survives failures and resizes.

Run it under elastic-run or torchrun, e.g.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 examples/train.py --ckpt-dir /tmp/ckpt

Stop it with --stop-at STEP, then start it again at another world size: it
continues with the same samples in the same order, the same learning rate at
every step and, up to float rounding, the same losses. Everything it carries
across a restart is global (the model and optimizer shards, the samples
consumed, the global step); what each rank does is derived from that at the
current world size.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import time
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import ErrorDetails
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset

try:
    import elastic
    from elastic import heartbeat, long_operation
    from elastic.checkpoint import CheckpointManager, ModelState
    from elastic.devices import BackendChoice, DeviceChoice, Placement, PlacementError, placement_here
    from elastic.rng import derive_seed, per_sample_dropout, sample_generator, seed_all
    from elastic.sample_log import append_sample_log
    from elastic.sampling import ElasticSampler, MicroBatch, SamplingConfig
    from elastic.schedule import GlobalStepLR, WarmupCosineConfig, warmup_cosine
except ImportError as exc:
    # Run from a checkout that was never installed: one line that says what to do, not a traceback per worker.
    # Anything else (a missing dependency of the library, a bug in it) keeps its full traceback.
    if exc.name != "elastic" and not (exc.name or "").startswith("elastic."):
        raise
    sys.exit(
        f"train.py: cannot import the elastic library ({exc}); install the project: pip install -e . "
        "(in the repository root)"
    )

logger = logging.getLogger("train")

# A failure injected with --crash-at exits with this code, so a test can tell it from a real error.
CRASH_EXIT_CODE = 17


class TrainConfig(BaseModel):
    """Every command-line flag is a field here (--global-batch sets global_batch)."""

    model_config = ConfigDict(frozen=True)

    steps: int = Field(300, gt=0, description="total optimizer steps; the LR schedule spans them")
    global_batch: int = Field(32, gt=0, description="sequences per step over all ranks, whatever the world size")
    micro_batch: int | None = Field(
        None,
        gt=0,
        description="most sequences per forward pass; more become gradient "
        "accumulation (default: a rank's whole share in one pass)",
    )
    lr: float = Field(3e-3, gt=0, description="peak learning rate of AdamW")
    grad_clip: float = Field(
        1.0, ge=0, description="clip the gradients' global norm to this before each step (0: no clipping)"
    )
    warmup_steps: int | None = Field(
        None, ge=0, description="linear warm-up before the cosine decay (default: a tenth of --steps)"
    )
    seed: int = Field(0, ge=0, description="seed of the model init, the data order and per-sample dropout")
    ckpt_dir: Path | None = Field(None, description="checkpoint directory shared by all ranks; none: no checkpoints")
    ckpt_every: int = Field(50, gt=0, description="save a checkpoint every this many steps")
    memory_every: int = Field(
        1, ge=0, description="between checkpoints, snapshot into the nodes' memory every this many steps (0: never)"
    )
    stop_at: int | None = Field(None, gt=0, description="exit 0 once the checkpoint of this step is committed")
    crash_at: int | None = Field(
        None, gt=0, description="simulate a failure: rank 0 dies after this step, in round 0 only"
    )
    sample_log: Path | None = Field(None, description="append one JSON line per rank and step: samples, loss, lr")
    num_workers: int = Field(0, ge=0, description="DataLoader worker processes per rank")
    seq_len: int = Field(64, gt=1, description="characters per training sequence")
    n_layer: int = Field(2, gt=0, description="transformer blocks")
    n_head: int = Field(4, gt=0, description="attention heads")
    d_model: int = Field(64, gt=0, description="width of the residual stream")
    dropout: float = Field(0.1, ge=0.0, lt=1.0, description="per-sample dropout on embeddings and residual branches")
    corpus_chars: int = Field(200_000, gt=0, description="size of the generated text corpus")
    device: DeviceChoice = Field(
        "auto", description="auto (cuda:LOCAL_RANK where CUDA is present, else cpu), cpu or cuda"
    )
    backend: BackendChoice = Field(
        "auto", description="process-group backend: auto (nccl on CUDA, gloo on cpu), gloo or nccl"
    )

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        problems = []
        if self.d_model % self.n_head:
            problems.append(f"--d-model ({self.d_model}) must be a multiple of --n-head ({self.n_head})")
        if self.stop_at is not None and self.ckpt_dir is None:
            problems.append("--stop-at needs --ckpt-dir: a later run resumes from the checkpoint of that step")
        if self.stop_at is not None and self.stop_at > self.steps:
            problems.append(f"--stop-at ({self.stop_at}) is past the last step (--steps {self.steps})")
        if self.warmup_steps is not None and self.warmup_steps > self.steps:
            problems.append(f"--warmup-steps ({self.warmup_steps}) exceeds --steps ({self.steps})")
        if self.micro_batch is not None and self.micro_batch > self.global_batch:
            problems.append(
                f"--micro-batch ({self.micro_batch}) is larger than --global-batch ({self.global_batch}); "
                "drop it to take a rank's share in one pass"
            )
        if self.corpus_chars <= self.seq_len:
            problems.append(
                f"--corpus-chars ({self.corpus_chars}) must exceed --seq-len ({self.seq_len}): not one "
                "training sequence fits"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, field in TrainConfig.model_fields.items():
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=_flag_type(field.annotation),
            default=field.default,
            help=field.description,
        )
    try:
        return TrainConfig(**vars(parser.parse_args(argv)))
    except ValidationError as error:  # one line, before any process group exists
        print(f"{parser.prog}: error: " + "; ".join(_flag_error(detail) for detail in error.errors()), file=sys.stderr)
        raise SystemExit(2) from None


def _flag_error(detail: ErrorDetails) -> str:
    flag = "--" + str(detail["loc"][0]).replace("_", "-") if detail["loc"] else None
    message = detail["msg"].removeprefix("Value error, ")
    return f"{flag}: {message}" if flag else message


def _flag_type(annotation: object) -> type:
    """int for `int | None`: argparse converts to the non-None member of an optional field; str for a choice."""
    if typing.get_origin(annotation) is typing.Literal:
        return str
    if isinstance(annotation, types.UnionType):
        return next(member for member in typing.get_args(annotation) if member is not type(None))
    assert isinstance(annotation, type)  # the other fields are plain classes (int, float, Path): their own converter
    return annotation


# --- data: a generated corpus, so the example needs no download -------------------------------

SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the robot", "a small bird", "the teacher", "our neighbour"]
VERBS = ["sees", "likes", "chases", "builds", "finds", "paints", "carries", "forgets"]
OBJECTS = ["a red ball", "the green door", "an apple", "the long road", "a paper boat", "the blue house", "two stones"]
ENDINGS = ["", " today", " at night", " in the park", " after lunch", " again"]


def generate_corpus(chars: int) -> str:
    """Sentences from a tiny grammar: varied enough to learn for a while, the same on every rank and run."""
    rng = random.Random(1234)
    sentences = []
    length = 0
    while length < chars:
        words = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}{rng.choice(ENDINGS)}."
        sentence = words[0].upper() + words[1:] + ("\n" if rng.random() < 0.2 else " ")
        sentences.append(sentence)
        length += len(sentence)
    return "".join(sentences)[:chars]


class CharWindows(Dataset):
    """Non-overlapping windows of a character-encoded text; sample i is (input, next-character target)."""

    def __init__(self, text: str, seq_len: int) -> None:
        self.vocab = sorted(set(text))
        lookup = {char: code for code, char in enumerate(self.vocab)}
        self.tokens = torch.tensor([lookup[char] for char in text], dtype=torch.long)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.tokens[index * self.seq_len : (index + 1) * self.seq_len + 1]
        return window[:-1], window[1:]


# --- model: nanoGPT-style, with dropout drawn per sample -------------------------------------
# Dropout masks come from generators keyed by (seed, step, sample index), so a sample is dropped
# out the same way whichever rank, micro-batch or world size processes it.


class CausalSelfAttention(nn.Module):
    def __init__(self, config: TrainConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class Block(nn.Module):
    def __init__(self, config: TrainConfig) -> None:
        super().__init__()
        self.dropout = config.dropout
        self.attn_norm = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, 4 * config.d_model), nn.GELU(), nn.Linear(4 * config.d_model, config.d_model)
        )

    def forward(self, x: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
        x = x + per_sample_dropout(self.attn(self.attn_norm(x)), self.dropout, generators)
        return x + per_sample_dropout(self.mlp(self.mlp_norm(x)), self.dropout, generators)


class GPT(nn.Module):
    def __init__(self, config: TrainConfig, vocab_size: int) -> None:
        super().__init__()
        self.dropout = config.dropout
        self.token_embedding = nn.Embedding(vocab_size, config.d_model)
        self.position_embedding = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.final_norm = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = per_sample_dropout(
            self.token_embedding(tokens) + self.position_embedding(positions), self.dropout, generators
        )
        for block in self.blocks:
            x = block(x, generators)
        return self.head(self.final_norm(x))


def shard(model: GPT, mesh: DeviceMesh) -> None:
    """FSDP2: one unit per block, the root holds the embeddings and the head."""
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


# --- one training step ------------------------------------------------------------------------


def train_step(
    model: GPT,
    plan: list[MicroBatch],
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    seed: int,
    step: int,
    device: torch.device,
) -> tuple[float, list[int]]:
    """Forward/backward every pass of this rank's share; returns the share's summed loss and its samples.

    Each pass weights its mean loss by `loss_weight`, so the gradient FSDP averages over ranks is the
    mean over the global batch however the batch was shared.
    """
    loss_sum = 0.0
    samples: list[int] = []
    for micro_batch in plan:
        tokens, targets = (t.to(device, non_blocking=True) for t in next(batches))
        generators = [sample_generator(seed, step, index) for index in micro_batch.indices]
        logits = model(tokens, generators)
        token_losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        sample_losses = token_losses.view(len(micro_batch.indices), -1).mean(dim=1)
        (sample_losses.mean() * micro_batch.loss_weight).backward()
        if not micro_batch.padding:
            loss_sum += sample_losses.sum().item()
            samples.extend(micro_batch.indices)
    return loss_sum, samples


@record  # an uncaught exception lands in TORCHELASTIC_ERROR_FILE: the launcher's failure summary shows it
def main(config: TrainConfig, placement: Placement, dataset: CharWindows) -> None:
    began = time.perf_counter()
    device = placement.device
    dist.init_process_group(placement.backend, device_id=device if device.type == "cuda" else None)
    grouped = time.perf_counter()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    round_number = int(os.environ.get("ELASTIC_ROUND", "0"))
    # force: under elastic.run a later round re-enters main in the same process, at another rank
    logging.basicConfig(level=logging.INFO, format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s", force=True)

    torch.manual_seed(config.seed)  # the same initial weights on every rank, before sharding
    model = GPT(config, vocab_size=len(dataset.vocab)).to(device)
    shard(model, init_device_mesh(device.type, (world_size,)))
    # fused: one optimizer op per step instead of one per parameter and operation, on CPU as on CUDA; a DTensor
    # op costs milliseconds of sharding propagation the first time in each round (its caches go with the meshes)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=device.type in ("cpu", "cuda")
    )
    warmup = config.warmup_steps if config.warmup_steps is not None else config.steps // 10
    schedule = GlobalStepLR(optimizer, warmup_cosine(WarmupCosineConfig(total_steps=config.steps, warmup_steps=warmup)))
    sampling = SamplingConfig(
        dataset_size=len(dataset), global_batch=config.global_batch, micro_batch=config.micro_batch, seed=config.seed
    )
    sampler = ElasticSampler(sampling, rank, world_size)

    # The keys match torchtitan's entries, so a torchtitan checkpoint's per-rank "dataloader"
    # and its "lr_scheduler" are recognised as foreign layouts and regenerated from the step.
    state = {"model": ModelState(model, optimizer), "dataloader": sampler, "lr_scheduler": schedule}
    manager = None
    if config.ckpt_dir:
        manager = CheckpointManager(
            config.ckpt_dir, keep=3, async_save=True, every=config.ckpt_every, memory_every=config.memory_every
        )
    built = time.perf_counter()
    with long_operation("checkpoint load"):  # may take long: elastic-run's watchdog allows it more time
        start = (manager.load_latest(state) if manager else None) or 0
    loaded = time.perf_counter()
    if config.stop_at is not None and start >= config.stop_at:
        finish(manager, start, state)
        logger.info("checkpoint of step %d is committed, at or past --stop-at %d: nothing to do", start, config.stop_at)
        return
    if rank == 0:
        logger.info(
            "round %d: %d ranks, %d sequences of %d characters, global batch %d, forward passes per step: %d, "
            "from step %d; started in %.2fs (process group %.2fs, model %.2fs, checkpoint load %.2fs)",
            round_number,
            world_size,
            len(dataset),
            config.seq_len,
            config.global_batch,
            len(sampler.step_plan()),
            start,
            loaded - began,
            grouped - began,
            built - grouped,
            loaded - built,
        )

    seed = sampler.config.seed  # a resumed run keeps the checkpointed seed, whatever --seed says
    batches = iter(
        DataLoader(dataset, batch_sampler=sampler, num_workers=config.num_workers, pin_memory=device.type == "cuda")
    )
    for step in range(start + 1, config.steps + 1):
        started = time.perf_counter()
        seed_all(derive_seed(seed, step))  # global RNG state is a function of the step, never checkpointed
        lr = schedule.current_lrs()[0]
        loss_sum, samples = train_step(model, sampler.step_plan(), batches, seed, step, device)
        if config.grad_clip:  # as nanoGPT and torchtitan (max_norm 1.0): one norm over every rank's shards
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        schedule.advance()
        sampler.complete_step()

        total = torch.tensor([loss_sum], dtype=torch.float64, device=device)
        dist.all_reduce(total)
        loss = total.item() / config.global_batch
        if config.sample_log:
            record = {
                "step": step,
                "rank": rank,
                "world_size": world_size,
                "round": round_number,
                "pid": os.getpid(),  # the same process across rounds it re-entered in process (elastic.run)
                "samples": samples,
                "loss": loss,
                "lr": lr,
                "time": time.time(),
            }
            append_sample_log(config.sample_log, record)
        if rank == 0:
            rate = config.global_batch / (time.perf_counter() - started)
            print(
                f"step {step:5d} | loss {loss:.4f} | lr {lr:.3e} | world {world_size} | {rate:7.1f} samples/s",
                flush=True,
            )

        if config.crash_at == step and round_number == 0 and rank == 0:
            logger.error("simulated failure after step %d (--crash-at)", step)
            os._exit(CRASH_EXIT_CODE)
        # to disk every --ckpt-every steps, or when elastic-run drains before a node joins or leaves; else into
        # memory every --memory-every steps (every rank asks); the manager marks a save to disk as a long operation
        if manager and manager.should_save(step):
            manager.save(step, state)
        if config.stop_at == step:
            finish(manager, step, state)
            logger.info("checkpoint of step %d committed; stopping (--stop-at)", step)
            return
        heartbeat(step)  # progress, for elastic-run's watchdog: a hung rank is found, its stacks dumped
    finish(manager, max(start, config.steps), state)  # the step the model is at


def finish(manager: CheckpointManager | None, step: int, state: dict[str, Any]) -> None:
    """The last step to disk (unless committed already: a resumed run may have loaded it from memory), and shut
    down."""
    with long_operation("finish: last checkpoint, shutdown"):
        if manager:
            manager.finish(step, state)
        dist.destroy_process_group()


if __name__ == "__main__":
    config = parse_config(sys.argv[1:])
    # What does not depend on the world is built once per process, before elastic.run: a worker started in
    # standby has its device and its data before its round comes, and a re-entered one keeps them
    try:
        placement = placement_here(config.device, config.backend)
    except PlacementError as error:
        sys.exit(f"train.py: {error}")
    if placement.device.type == "cuda":
        torch.ones(1, device=placement.device)  # CUDA builds the device's context at its first tensor: here
    dataset = CharWindows(generate_corpus(config.corpus_chars), config.seq_len)
    # under elastic-run, a new round that keeps this worker's node calls main again in this process
    elastic.run(main, config, placement, dataset)
