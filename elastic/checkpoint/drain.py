"""Drains: the checkpoint elastic-run asks for before a planned change, so the next round redoes no step.

Before a node joins (scale-up) or an agent that was told to stop leaves, the agents write a drain number into
each worker's channel (`elastic.channel`), and whether a snapshot in memory answers it: where the nodes that stay
hold all of it and are enough to go on (a join; one node's leave that leaves at least MIN nodes, each node's part
having reached its next node), the drain is one snapshot, with snapshots in memory on (0.16-0.21 s sooner than
with a synchronous save to disk, at 4 ranks on 2 cores); otherwise it is saved to disk too.

The ranks must save at the same step, and each sees the request at its own moment, so `Drains.requested` is a
collective: every rank calls it at every step boundary (it is what `CheckpointManager.should_save` does) and they
agree on the largest number any of them saw (and on disk if any rank was asked for it), over a gloo group of
their own (one tiny all_reduce per step). Once that save committed, each rank reports the number
back and waits at the step boundary, inside an unlimited long operation, until the agent withdraws the request
(the change did not happen) or stops it for the next round, which loads that checkpoint (under `elastic.run`,
the next round's offer ends the wait with `RoundChanged`).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from elastic import channel
from elastic.channel import drain_channel, long_operation

logger = logging.getLogger(__name__)

_WITHDRAWN_POLL_S = 0.05


@dataclass(frozen=True)
class Drain:
    """A drain the ranks agreed on: its number (0: none), and whether its checkpoint must reach disk (the nodes
    that stay might not hold all of a snapshot, or might not go on) or a snapshot in memory answers it."""

    number: int
    to_disk: bool


class Drains:
    """One rank's side of drains; `group` is a process group of its own (None: this process alone)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self._channel = drain_channel()
        self._channel.set_drainable()
        self._done = 0

    def requested(self) -> Drain:
        """The drain every rank agrees to save for now (number 0: none). A collective: every rank calls it."""
        seen = self._channel.drain_requested()
        seen = 0 if seen == self._done else seen
        to_disk = bool(seen) and not self._channel.drain_in_memory()
        if self.group is None:
            return Drain(seen, to_disk)
        agreed = torch.tensor([seen, int(to_disk)], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)  # a rank that needs disk has its way
        number, disk = agreed.tolist()
        return Drain(int(number), bool(disk))

    def committed(self, number: int, step: int) -> None:
        """Drain `number` is saved and committed at `step`: report it, then wait at the step boundary."""
        self._done = number
        self._channel.report_drained(number, step)
        logger.info("drained at step %d: waiting for the next round", step)
        waited = time.monotonic()
        with long_operation("drained: waiting for the next round", timeout=math.inf):
            while self._channel.drain_requested() == number:
                if channel.round_check is not None:
                    channel.round_check()  # under elastic.run, the next round comes in process
                time.sleep(_WITHDRAWN_POLL_S)
        logger.info("drain withdrawn after %.1fs: training on", time.monotonic() - waited)
