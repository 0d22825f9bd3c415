"""This node's member bucket, as etcd sends it with every round: where the agent learns its place in a round.

A round's members are stored in buckets by a hash of the node id (`records.RoundRecord.split`). Near the job's
maximum size a round has as many buckets as `--nnodes` MAX gives, which every agent knows before any round forms,
so each agent watches the one bucket that holds its node and etcd sends it with the round's header: no read per
agent per round. A round with another count (far below MAX), or a bucket the watch has not brought within a
moment of its header, is read instead.
"""

from __future__ import annotations

import logging
import time

from launcher.etcd.watch import RangeMirror
from launcher.rendezvous.protocol import JobStore
from launcher.rendezvous.records import Member, MemberBucket, RoundHeader, bucket_of, watched_bucket_count

logger = logging.getLogger(__name__)

# A round's bucket is written with its header or just before, and one watch stream brings both: it follows the
# header within one batch of watch responses. Past this the watch is taken as broken and the bucket is read.
_ARRIVAL_S = 1.0


class WatchedBucket:
    """The bucket of `node` among the watched count of a job of at most `max_nodes` nodes, kept by a watch."""

    def __init__(self, store: JobStore, node: str, max_nodes: int) -> None:
        self.store = store
        self.node = node
        self.count = watched_bucket_count(max_nodes)
        self.index = bucket_of(node, self.count)
        self.mirror = RangeMirror(store.client, store.keys.bucket_prefix(self.index))

    def start(self) -> WatchedBucket:
        self.mirror.start()
        return self

    def close(self) -> None:
        self.mirror.close()

    def member(self, header: RoundHeader, incarnation: int) -> Member | None:
        """This incarnation's place in the round `header` announces (None: not a member)."""
        bucket = self._watched(header) if header.buckets == self.count else None
        if bucket is None:
            return self.store.read_member(header, self.node, incarnation)
        return bucket.member(self.node, incarnation)

    def _watched(self, header: RoundHeader) -> MemberBucket | None:
        key = self.store.keys.member_bucket(header.round, self.index).removeprefix(self.mirror.prefix)
        deadline = time.monotonic() + _ARRIVAL_S
        while True:
            entries, _, version = self.mirror.snapshot()
            if key in entries:
                bucket = MemberBucket.loads(entries[key].value)
                if bucket.formed_at == header.formed_at:
                    return bucket
            left = deadline - time.monotonic()
            if left <= 0 or not self.mirror.connected:
                logger.debug("round %d's bucket did not come with its header: reading it", header.round)
                return None
            self.mirror.wait(version, left)
