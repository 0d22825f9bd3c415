"""Committed, asynchronous, resharding checkpoints on torch.distributed.checkpoint (DCP).

Each checkpoint is a folder ``<directory>/step-<N>`` written by DCP into a folder of its own save
attempt and published by rank 0, once every rank's data and DCP's metadata are durable, by writing
``commit.json`` into it and renaming it to ``step-<N>``. A save of a round that is no longer current
never commits (fence.py). Tensor state is plain DCP, so any world size can load it and ``dcp.load``
reads it directly. Whether a load takes each state entry from the checkpoint or regenerates it from the step is
decided alike on every rank (entry_rules.py); a whole DCP checkpoint another tool wrote (torchtitan's) is foreign
until adopted (adopt.py)::

    mgr = CheckpointManager(directory, keep=3, async_save=True, every=50)
    state = {"model": ModelState(model, optimizer), "train": my_stateful}
    step = mgr.load_latest(state)   # None when nothing is committed yet
    if mgr.should_save(step):       # every 50 steps, or a drain elastic-run asks for (drain.py); every rank asks
        mgr.save(step, state)       # returns once staged; the write commits in the background
    mgr.wait()                      # raises if the save in flight failed
    mgr.close()
"""

from elastic.checkpoint.errors import CheckpointError, FencedError
from elastic.checkpoint.layout import CommitRecord, write_commit_record
from elastic.checkpoint.manager import CheckpointManager
from elastic.checkpoint.model_state import ModelState
from elastic.checkpoint.sync import sync_module_states

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "CommitRecord",
    "FencedError",
    "ModelState",
    "sync_module_states",
    "write_commit_record",
]
