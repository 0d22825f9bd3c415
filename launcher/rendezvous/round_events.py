"""The membership-log events written with a new round: a pure function of the decision that forms it.

Which events go with a round is policy, so it is decided here and tested as a table; the controller only writes
them, in one transaction with the round (`JobStore.form_round`).
"""

from __future__ import annotations

from launcher.rendezvous.decisions import DrainOutcome, FormRound, RoundReason, Settings
from launcher.rendezvous.membership_log import MembershipEvent
from launcher.rendezvous.records import RoundRecord

# round_started lists the members up to here (~86 bytes each: 350 KB): the event rides in the round's transaction,
# which etcd refuses past 1.5 MiB, and a 16,384-node list alone is 1.4 MB. The join and leave events still name
# every node.
MAX_LOGGED_MEMBERS = 4096


def round_events(formed: FormRound, record: RoundRecord, settings: Settings, at: float) -> list[MembershipEvent]:
    """The events of round `record`, formed by `formed`, at unix time `at`: quarantines and readmissions, how
    the drain before it went, the restart it counts, and round_started, which comes last (it marks the write)."""
    number = formed.number
    events = [
        MembershipEvent(
            event="node_quarantined",
            time=at,
            round=number,
            node=node,
            reason=f"caused the worker failure of {settings.quarantine_after} consecutive rounds",
            message=f"kept out of rounds for {settings.quarantine_cooldown:g}s",
        )
        for node in formed.newly_quarantined
    ]
    events += [
        MembershipEvent(event="node_readmitted", time=at, round=number, node=node, reason="quarantine over")
        for node in formed.readmitted
    ]
    if formed.drain is not None:
        events += _drain_events(formed.drain, settings, at)
    if formed.reason is RoundReason.WORKER_FAILED:
        events.append(
            MembershipEvent(
                event="restart",
                time=at,
                round=number,
                restart_count=formed.restart_count,
                reason=formed.reason.value,
                message=f"restart {formed.restart_count} of --max-restarts {settings.max_restarts}",
            )
        )
    events.append(
        MembershipEvent(
            event="round_started",
            time=at,
            round=number,
            world_size=record.world_size,
            size=len(record.nodes),
            members=record.member_summary() if len(record.nodes) <= MAX_LOGGED_MEMBERS else None,
            reason=formed.reason.value,
            restart_count=formed.restart_count,
            replaced=[{"node": gone, "by": newcomer} for gone, newcomer in formed.replaced] or None,
        )
    )
    return events


def _drain_events(drain: DrainOutcome, settings: Settings, at: float) -> list[MembershipEvent]:
    """How the drain of the round being replaced went; nothing when it committed without a step to name (no
    worker drains)."""
    if not drain.committed:
        return [
            MembershipEvent(
                event="drain_timed_out",
                time=at,
                round=drain.round,
                step=drain.step,
                message=f"not every member drained within --drain-timeout {settings.drain_timeout:g}s; "
                "steps since the last checkpoint are redone",
            )
        ]
    if drain.step is None:
        return []
    return [MembershipEvent(event="drain_committed", time=at, round=drain.round, step=drain.step)]
