"""A torchtitan job that survives growing from 8 to 16 GPUs, or losing a node, under elastic-run.

torchtitan's llama3 debug model and trainer, unchanged, with two components swapped in its config: elastic's
checkpoint manager (the one hook into the trainer: it resumes a checkpoint at any world size) and elastic's
dataloader (its position is a function of the step, so a new data-parallel degree regenerates every rank's share
instead of dying on ``dataloader.dp_rank_<r>``). On each node, from the repository root (torchtitan imports this
module by name)::

    elastic-run --nnodes 1:2 --nproc-per-node 8 --rdzv-endpoint etcd:2379 --rdzv-id llama3 \\
        -m torchtitan.train --module examples.integrations.torchtitan_elastic --config llama3_debug_elastic \\
        --dataloader.dataset-path /data/tokens.bin

The dataset is a file of token ids of the model's vocabulary (2048 for the debug model): nanoGPT's raw uint16
``.bin``, or a ``.npy`` array. torchtitan's trainer needs a GPU (see docs/library.md).
"""

from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

from elastic.integrations.torchtitan import ElasticCheckpointManager, ElasticDataLoader

GLOBAL_BATCH = 128  # fixed whatever the world: local batch 8 x 8 ranks x 2 accumulation steps, or x 16 ranks x 1


def llama3_debug_elastic() -> Trainer.Config:
    config = llama3_debugmodel()
    config.training.global_batch_size = GLOBAL_BATCH
    config.training.steps = 1000
    config.checkpoint = ElasticCheckpointManager.Config(enable=True, interval=50, last_save_model_only=False)
    config.dataloader = ElasticDataLoader.Config(global_batch_size=GLOBAL_BATCH)
    config.validator.enable = False  # its dataset is torchtitan's c4 test set, which the wheel does not ship
    return config
