"""The mission's story against the real torchtitan (0.3.0, CPU, gloo).

torchtitan's own CheckpointManager saves a tiny llama3 (its debug model cut to one layer, with its fused QKV
projection and the state-dict hooks that split it), FSDP2-sharded, with its OptimizersContainer,
LRSchedulersContainer and ParallelAwareDataloader, at 2 ranks, after 10 steps. No forward pass is needed for
that: the steps are optimizer steps on random gradients. Then it is loaded at 1, 3 and 4 ranks through
``elastic.integrations.torchtitan``, where torchtitan itself dies on ``dataloader.dp_rank_<r>``.
"""

from __future__ import annotations

import copy
import itertools
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn
from equality import assert_identical
from multiproc import run_ranks
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import IterableDataset
from torchtitan.components.checkpoint import CheckpointManager, ModelWrapper
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, default_adamw
from torchtitan.config import ConfigManager
from torchtitan.models.llama3 import model_registry

from elastic.checkpoint import CheckpointError, ModelState
from elastic.checkpoint import CheckpointManager as ElasticManager
from elastic.checkpoint.cli import main as elastic_ckpt
from elastic.integrations.torchtitan import ElasticCheckpointManager, ElasticDataLoader, load

pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore::UserWarning")]

SAVED_STEP = 10
GLOBAL_BATCH = 24  # every data-parallel degree tested divides it by LOCAL_BATCH
LOCAL_BATCH = 2
SEQ_LEN = 16
VOCAB = 256


def tiny_llama(seed: int) -> nn.Module:
    """torchtitan's llama3 debug model with one layer and a small vocabulary, FSDP2-sharded, initialised by it."""
    config = model_registry("debugmodel").model
    config.layers = config.layers[:1]
    config.vocab_size = config.tok_embeddings.num_embeddings = config.lm_head.out_features = VOCAB
    with torch.device("meta"):
        model = config.build()
    for layer in model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def optimizers_for(model: nn.Module) -> OptimizersContainer:
    config = default_adamw(lr=1e-3)
    config.implementation = "foreach"  # torchtitan's default, fused, is for CUDA
    return config.build(model_parts=[model])


def lr_schedulers_for(optimizers: OptimizersContainer) -> LRSchedulersContainer:
    config = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0)
    return config.build(optimizers=optimizers, training_steps=20)


class SampleIds(IterableDataset):
    """Each data-parallel rank streams its own shard, as torchtitan's text datasets do; samples are their ids."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def __iter__(self):
        for sample in itertools.count(self.rank, self.world_size):
            yield {"input": torch.tensor([sample])}, torch.tensor([sample])


class RecordingDataloader(ParallelAwareDataloader):
    """torchtitan's own dataloader that can also rebuild itself from the step, and records which it did."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(SampleIds(rank, world_size), dp_rank=rank, dp_world_size=world_size, batch_size=LOCAL_BATCH)
        self.loaded = False
        self.regenerated_from: int | None = None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded = True
        super().load_state_dict(state_dict)

    def regenerate_state(self, step: int) -> None:
        self.regenerated_from = step


class TrainState:
    """The trainer's own entry (torchtitan saves the Trainer as ``train_state``)."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = state_dict["step"], state_dict["ntokens_seen"]


def full(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``state`` with every DTensor gathered whole (a collective: every rank calls it)."""
    return {
        key: value.full_tensor() if isinstance(value, DTensor) else copy.deepcopy(value) for key, value in state.items()
    }


def values(model: nn.Module, optimizers: OptimizersContainer, lr_schedulers: LRSchedulersContainer) -> dict:
    """What must survive a resize, in torchtitan's own keys: model (hooks applied), optimizer, learning rate."""
    return {
        "model": full(ModelWrapper(model).state_dict()),
        "optimizer": full(optimizers.state_dict()),
        "lr": lr_schedulers.schedulers[0].get_last_lr(),
    }


def train(model: nn.Module, optimizers: OptimizersContainer, lr_schedulers: LRSchedulersContainer, step: int) -> None:
    torch.manual_seed(1000 + step)
    for parameter in model.parameters():
        parameter.grad = torch.randn_like(parameter)
    optimizers.step()
    lr_schedulers.step()
    optimizers.zero_grad()


def elastic_dataloader(tokens: str, rank: int, world_size: int) -> ElasticDataLoader:
    """Built as torchtitan's trainer builds its dataloader from the job's config."""
    config = ElasticDataLoader.Config(dataset_path=tokens, global_batch_size=GLOBAL_BATCH)
    return config.build(
        dp_world_size=world_size,
        dp_rank=rank,
        tokenizer=None,
        seq_len=SEQ_LEN,
        local_batch_size=LOCAL_BATCH,
        snapshot_every_n_steps=None,
    )


def torchtitan_dataloader(rank: int, world_size: int) -> ParallelAwareDataloader:
    return ParallelAwareDataloader(
        SampleIds(rank, world_size), dp_rank=rank, dp_world_size=world_size, batch_size=LOCAL_BATCH
    )


def checkpointer_as_the_trainer_builds_it(
    manager: type[CheckpointManager],
    dump_folder: str,
    model: nn.Module,
    optimizers: OptimizersContainer,
    lr_schedulers: LRSchedulersContainer,
    dataloader: Any,
    train_state: TrainState,
) -> CheckpointManager:
    """From its config, with the components and the ``train_state`` entry torchtitan's Trainer gives it."""
    return manager.Config(enable=True, folder="checkpoint", interval=5).build(
        dataloader=dataloader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder=dump_folder,
    )


def one_step(dataloader: ElasticDataLoader, world_size: int) -> torch.Tensor:
    """This rank's inputs of the next step: its micro-batches (torchtitan's gradient accumulation), in order."""
    batches = iter(dataloader)
    micro_batches = GLOBAL_BATCH // (LOCAL_BATCH * world_size)
    return torch.cat([next(batches)[0]["input"] for _ in range(micro_batches)])


def torchtitan_saves(rank: int, world_size: int, dump_folder: str) -> dict[str, Any]:
    """torchtitan's own CheckpointManager saves steps 5 and 10; what each rank must find again is returned."""
    model = tiny_llama(seed=0)
    optimizers = optimizers_for(model)
    lr_schedulers = lr_schedulers_for(optimizers)
    dataloader = torchtitan_dataloader(rank, world_size)
    train_state = TrainState()
    checkpointer = checkpointer_as_the_trainer_builds_it(
        CheckpointManager, dump_folder, model, optimizers, lr_schedulers, dataloader, train_state
    )
    batches = iter(dataloader)
    for step in range(1, SAVED_STEP + 1):
        next(batches)
        train(model, optimizers, lr_schedulers, step)
        train_state.step, train_state.ntokens_seen = step, step * GLOBAL_BATCH * SEQ_LEN
        checkpointer.save(step)
    checkpointer.close()
    return {**values(model, optimizers, lr_schedulers), "next_ids": next(batches)[1].tolist()}


def elastic_loads(rank: int, world_size: int, checkpoint_dir: str, tokens: str, loader: str) -> dict[str, Any]:
    """A new job of ``world_size`` ranks loads the checkpoint through elastic's entry point."""
    model = tiny_llama(seed=1)  # unlike what was saved, so a load that does nothing fails the comparison
    optimizers = optimizers_for(model)
    lr_schedulers = lr_schedulers_for(optimizers)
    dataloader: Any = {
        "elastic": lambda: elastic_dataloader(tokens, rank, world_size),
        "recording": lambda: RecordingDataloader(rank, world_size),
        "torchtitan": lambda: torchtitan_dataloader(rank, world_size),
    }[loader]()
    train_state = TrainState()
    try:
        step = load(checkpoint_dir, [model], optimizers, lr_schedulers, dataloader, states={"train_state": train_state})
    except CheckpointError as error:
        return {"error": str(error)}
    result = {"step": step, "train_state": train_state.state_dict(), **values(model, optimizers, lr_schedulers)}
    if loader == "elastic":
        result["samples_consumed"] = dataloader.sampler.samples_consumed
        result["next_inputs"] = one_step(dataloader, world_size)
    if loader == "recording":
        result["loaded"], result["regenerated_from"] = dataloader.loaded, dataloader.regenerated_from
        result["next_ids"] = next(iter(dataloader))[1].tolist()
    return result


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]], str]:
    """torchtitan's checkpoint folder (steps 5 and 10 at 2 ranks), what each rank saved, and a file of tokens."""
    dump_folder = tmp_path_factory.mktemp("torchtitan")
    expected = run_ranks(2, torchtitan_saves, str(dump_folder), timeout=180)
    tokens = dump_folder / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, VOCAB, size=40_000, dtype=np.int64))
    return dump_folder / "checkpoint", expected, str(tokens)


def fresh_run_at(step: int, tokens: str) -> torch.Tensor:
    """What an uninterrupted run draws at ``step``: one rank, its whole global batch, in order."""
    dataloader = elastic_dataloader(tokens, rank=0, world_size=1)
    dataloader.sampler.samples_consumed = step * GLOBAL_BATCH
    return one_step(dataloader, world_size=1)


def test_torchtitan_wrote_foreign_checkpoints_elastic_ckpt_reads(saved, capsys, tmp_path: Path) -> None:
    checkpoint_dir, _, _ = saved
    assert elastic_ckpt(["list", str(checkpoint_dir)]) == 0
    rows = [line.split()[:3] for line in capsys.readouterr().out.splitlines()[1:]]
    assert rows == [["5", "foreign", "2"], ["10", "foreign", "2"]]
    assert elastic_ckpt(["inspect", str(checkpoint_dir), "10"]) == 0
    out = capsys.readouterr().out
    assert "step 10, foreign" in out and "  dataloader.dp_rank_1  object" in out
    assert "  layers.0.attention.qkv_linear.wq.weight  float32  256x256" in out
    assert "  optimizer.state.layers.0.attention.qkv_linear.wqkv.weight.exp_avg  float32  768x256" in out
    copy = tmp_path / "checkpoint"
    shutil.copytree(checkpoint_dir, copy)
    assert elastic_ckpt(["adopt", str(copy)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"adopted {copy / 'step-5'}", f"adopted {copy / 'step-10'}"]


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_a_torchtitan_checkpoint_resumes_at_another_world_size(saved, world_size: int) -> None:
    checkpoint_dir, expected, tokens = saved
    results = run_ranks(world_size, elastic_loads, str(checkpoint_dir), tokens, "elastic", timeout=180)
    for result in results:
        assert "error" not in result, result["error"]
        assert result["step"] == SAVED_STEP and result["train_state"]["step"] == SAVED_STEP
        assert result["samples_consumed"] == SAVED_STEP * GLOBAL_BATCH  # regenerated from the step, every rank
    assert "layers.0.attention.qkv_linear.wq.weight" in expected[0]["model"]  # split by torchtitan's hooks
    assert expected[0]["optimizer"], "AdamW state must be part of the comparison"
    for key in ("model", "optimizer", "lr"):
        assert_identical(results[0][key], expected[0][key], key)
    drawn = torch.cat([result["next_inputs"] for result in results])  # the new ranks' next step, in rank order
    assert torch.equal(drawn, fresh_run_at(SAVED_STEP, tokens))


def test_at_the_same_world_size_every_rank_loads_its_own_position(saved) -> None:
    checkpoint_dir, expected, tokens = saved
    results = run_ranks(2, elastic_loads, str(checkpoint_dir), tokens, "recording", timeout=180)
    assert [(result["loaded"], result["regenerated_from"]) for result in results] == [(True, None)] * 2
    assert [result["next_ids"] for result in results] == [rank_saved["next_ids"] for rank_saved in expected]


def test_at_another_world_size_no_rank_loads_a_position_of_the_old_world(saved) -> None:
    checkpoint_dir, _, tokens = saved
    results = run_ranks(3, elastic_loads, str(checkpoint_dir), tokens, "recording", timeout=180)
    assert [(result["loaded"], result["regenerated_from"]) for result in results] == [(False, SAVED_STEP)] * 3


def test_torchtitans_own_dataloader_at_another_world_size_is_refused_on_every_rank_alike(saved) -> None:
    checkpoint_dir, _, tokens = saved
    results = run_ranks(3, elastic_loads, str(checkpoint_dir), tokens, "torchtitan", timeout=180)
    errors = {result.get("error") for result in results}
    assert len(errors) == 1, errors
    error = errors.pop()
    assert error is not None and error.startswith(f"{checkpoint_dir / f'step-{SAVED_STEP}'} holds per-rank state")
    assert "'dataloader' (dataloader.dp_rank_{0..1}, dataloader.world_size), saved at world_size 2, now 3" in error
    assert "give that object (ParallelAwareDataloader) a regenerate_state(step) method (not on ranks 0, 1, 2)" in error


def trainer_hook_resumes(rank: int, world_size: int, dump_folder: str, tokens: str) -> dict[str, Any]:
    """The trainer's path: ElasticCheckpointManager built from its config as the trainer builds its checkpointer,
    ``load()`` at this world size, five more steps, torchtitan's own save of step 15."""
    model = tiny_llama(seed=2)
    optimizers = optimizers_for(model)
    lr_schedulers = lr_schedulers_for(optimizers)
    dataloader = elastic_dataloader(tokens, rank, world_size)
    train_state = TrainState()
    checkpointer = checkpointer_as_the_trainer_builds_it(
        ElasticCheckpointManager, dump_folder, model, optimizers, lr_schedulers, dataloader, train_state
    )
    assert checkpointer.load()
    handlers = DTensor._op_dispatcher._custom_op_handlers
    resumed = {
        "step": train_state.step,
        "clipping_on_shards": handlers.get(torch.ops.aten._foreach_norm.Scalar) is not None,
        **values(model, optimizers, lr_schedulers),
    }
    batches = iter(dataloader)
    while train_state.step < SAVED_STEP + 5:
        for _ in range(GLOBAL_BATCH // (LOCAL_BATCH * world_size)):
            next(batches)
        train_state.step += 1
        train(model, optimizers, lr_schedulers, train_state.step)
        checkpointer.save(train_state.step)
    checkpointer.close()
    return {"resumed": resumed, **values(model, optimizers, lr_schedulers)}


def test_elastic_checkpoint_manager_is_the_one_hook_in_torchtitans_trainer(saved, tmp_path: Path) -> None:
    checkpoint_dir, expected, tokens = saved
    shutil.copytree(checkpoint_dir, tmp_path / "checkpoint")
    grown = run_ranks(4, trainer_hook_resumes, str(tmp_path), tokens, timeout=180)
    assert grown[0]["resumed"]["step"] == SAVED_STEP
    assert grown[0]["resumed"]["clipping_on_shards"], "the manager has the trainer's clipping run on the shards"
    assert_identical(grown[0]["resumed"]["model"], expected[0]["model"], "model")
    assert_identical(grown[0]["resumed"]["optimizer"], expected[0]["optimizer"], "optimizer")
    # step 15, saved by torchtitan's own code at 4 ranks with the elastic dataloader's global state, resumes at 1
    shrunk = run_ranks(1, elastic_loads, str(tmp_path / "checkpoint"), tokens, "elastic", timeout=180)[0]
    assert shrunk["step"] == SAVED_STEP + 5 and shrunk["samples_consumed"] == (SAVED_STEP + 5) * GLOBAL_BATCH
    for key in ("model", "optimizer", "lr"):
        assert_identical(shrunk[key], grown[0][key], key)


def model_state_round_trip(rank: int, world_size: int, directory: str, seed: int) -> dict[str, Any]:
    """elastic's own CheckpointManager with ModelState on torchtitan's model, whose hooks split wqkv."""
    model = tiny_llama(seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": ModelState(model, optimizer)}
    manager = ElasticManager(directory, async_save=False)
    if manager.load_latest(state) is None:
        torch.manual_seed(7)
        for parameter in model.parameters():
            parameter.grad = torch.randn_like(parameter)
        optimizer.step()
        manager.save(1, state)
    manager.close()
    full_optimizer = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    return {"model": full(ModelWrapper(model).state_dict()), "optimizer": full_optimizer}


def test_model_state_saves_a_model_whose_state_dict_hooks_split_parameters(tmp_path: Path) -> None:
    saved_at_2 = run_ranks(2, model_state_round_trip, str(tmp_path), 0, timeout=180)[0]
    loaded_at_3 = run_ranks(3, model_state_round_trip, str(tmp_path), 1, timeout=180)[0]
    assert saved_at_2["optimizer"]["state"], "AdamW state must be part of the comparison"
    assert_identical(loaded_at_3, saved_at_2)


def test_the_documented_job_config_parses_in_torchtitan(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2]))  # torchtitan imports the module by name
    config = ConfigManager().parse_args(
        [
            "--module",
            "examples.integrations.torchtitan_elastic",
            "--config",
            "llama3_debug_elastic",
            "--checkpoint.interval",
            "7",
            "--dataloader.dataset-path",
            "/data/tokens.bin",
        ]
    )
    assert isinstance(config.checkpoint, ElasticCheckpointManager.Config) and config.checkpoint.interval == 7
    assert isinstance(config.dataloader, ElasticDataLoader.Config)
    assert config.dataloader.dataset_path == "/data/tokens.bin"
    assert config.dataloader.global_batch_size == config.training.global_batch_size > 0
