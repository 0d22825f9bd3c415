"""RoundRecord's members and lookups as tables: each answer is what a search of its columns gives."""

from __future__ import annotations

import pytest

from launcher.rendezvous.records import Member, RoundRecord

RECORD = RoundRecord(
    round=3,
    nodes=["a", "b", "c", "d"],
    incarnations=[11, 12, 13, 14],
    nproc=[2, 1, 4, 8],
    addrs=["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"],
    reason="initial",
)


@pytest.mark.parametrize(
    ("node", "incarnation", "expected"),
    [
        ("a", None, Member("a", 11, 0, 2, 0, "10.0.0.1")),
        ("c", None, Member("c", 13, 2, 4, 3, "10.0.0.3")),
        ("d", 14, Member("d", 14, 3, 8, 7, "10.0.0.4")),
        ("d", 15, None),  # another incarnation of d: a newcomer, not the member
        ("e", None, None),
    ],
)
def test_a_member_is_found_by_node_and_incarnation(node, incarnation, expected):
    assert RECORD.member(node, incarnation) == expected


def test_members_hold_cumulative_ranks_in_group_rank_order_and_callers_cannot_change_them():
    members = RECORD.members
    assert [(m.group_rank, m.first_rank, m.last_rank) for m in members] == [(0, 0, 1), (1, 2, 2), (2, 3, 6), (3, 7, 14)]
    members.clear()
    assert len(RECORD.members) == 4


def test_lookups_survive_a_trip_through_etcd_and_every_node_of_a_large_round_is_found():
    nodes = [f"n{i:05d}" for i in range(4096)]
    record = RoundRecord.loads(
        RoundRecord(
            round=0, nodes=nodes, incarnations=list(range(4096)), nproc=[8] * 4096, addrs=nodes, reason="initial"
        ).dumps()
    )
    assert all(record.member(node, index).first_rank == 8 * index for index, node in enumerate(nodes))
    assert record.member("n04095", 1) is None
