"""Committed, asynchronous, resharding checkpoints on torch.distributed.checkpoint (DCP).

Each checkpoint is a folder ``<directory>/step-<N>`` written by DCP and made loadable by a
``commit.json`` that rank 0 writes once every rank's data and DCP's metadata are durable.
Tensor state is plain DCP, so any world size can load it and ``dcp.load`` reads it directly::

    mgr = CheckpointManager(directory, keep=3, async_save=True)
    state = {"model": ModelState(model, optimizer), "train": my_stateful}
    step = mgr.load_latest(state)   # None when nothing is committed yet
    mgr.save(step, state)           # returns once staged; the write commits in the background
    mgr.wait()                      # raises if the save in flight failed
    mgr.close()
"""

from elastic.checkpoint.layout import CheckpointError, CommitRecord, write_commit_record
from elastic.checkpoint.manager import CheckpointManager
from elastic.checkpoint.model_state import ModelState
from elastic.checkpoint.sync import sync_module_states

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "CommitRecord",
    "ModelState",
    "sync_module_states",
    "write_commit_record",
]
