"""A round's reports that need no answer: "all of this node's workers are stalled" (so the controller probes the
members that are not), and the training progress that `elastic-run log --plot` draws.

Reports are written from a thread of their own: a node cut off from etcd stalls too, and its agent's main thread
must go on watching its lease (to fence itself) rather than wait on a write that cannot land.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

from launcher.rendezvous.protocol import JobStore
from launcher.rendezvous.records import StallReport
from launcher.workers.watchdog_rules import Stall

logger = logging.getLogger(__name__)


class RoundReporter:
    """Keeps etcd's stall report of one round in line with the workers' state, and records progress; one per
    round."""

    def __init__(self, store: JobStore, node_id: str, round_: int, revision: int, writer: ThreadPoolExecutor) -> None:
        self.store = store
        self.node_id = node_id
        self.round = round_
        self.revision = revision
        self._writer = writer
        self._reported = False  # our report that all our workers are stalled is in etcd
        self._write: Future | None = None  # the write that reports or clears it, while etcd has not answered

    def record_progress(self, step: int) -> None:
        self._writer.submit(self._write_progress, step)

    def follow_stall(self, stall: Stall | None) -> None:
        """`stall`: the workers' stall now (None: they make progress, or none run)."""
        if self._write is not None:
            if not self._write.done():
                return
            failed = self._write.exception()
            self._write = None
            if failed is None:
                self._reported = not self._reported
            else:
                logger.debug("stall report not written (tried again at the next poll): %s", failed)
        if (stall is not None) != self._reported:
            self._write = self._writer.submit(self._write_report, stall)

    def _write_report(self, stall: Stall | None) -> None:
        if stall is None:
            self.store.clear_stalled(self.round, self.revision, self.node_id)
            logger.info("round %d: the workers make progress again", self.round)
            return
        report = StallReport(seconds_silent=stall.seconds_silent, last_step=stall.last_step)
        if self.store.report_stalled(self.round, self.revision, self.node_id, report):
            logger.warning(
                "round %d: every worker has been silent for %.1fs after step %s%s, as if a peer stopped; "
                "asked the controller to probe the other members",
                self.round,
                stall.seconds_silent,
                stall.last_step,
                f", idle inside long operation {stall.long_op!r}" if stall.long_op else "",
            )

    def _write_progress(self, step: int) -> None:
        try:
            self.store.record_progress(self.round, self.revision, self.node_id, step)
        except Exception as exc:  # progress is for the picture; the next one is 10 s away
            logger.debug("training progress not recorded: %s", exc)
