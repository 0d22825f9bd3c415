"""torchtitan jobs that resume at any world size.

- ``load(checkpoint_dir, model_parts, optimizers, lr_schedulers, dataloader, step=None)`` loads a torchtitan
  checkpoint at this world size: model and optimizer resharded, the data position and learning rate taken from
  the step where the saved ones do not fit the new world.
- ``ElasticCheckpointManager``: torchtitan's checkpoint manager with that load; selecting it in the job's config
  (``checkpoint=ElasticCheckpointManager.Config(...)``) is the one hook into torchtitan's trainer.
- ``ElasticDataLoader``: a torchtitan dataloader whose position is a function of the step
  (``dataloader=ElasticDataLoader.Config(dataset_path=..., global_batch_size=...)``), so every rank of any
  data-parallel degree regenerates its share.
"""

from elastic.integrations.torchtitan.checkpoint import ElasticCheckpointManager, LRSchedulerState, load
from elastic.integrations.torchtitan.dataloader import ElasticDataLoader, TokenWindows

__all__ = ["ElasticCheckpointManager", "ElasticDataLoader", "LRSchedulerState", "TokenWindows", "load"]
