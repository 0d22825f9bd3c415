"""RoundRecord's members and lookups as tables: each answer is what a search of its columns gives."""

from __future__ import annotations

import pytest

from launcher.rendezvous.records import Member, RoundRecord, bucket_count, watched_bucket_count

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


@pytest.mark.parametrize(
    ("size", "max_nodes", "expected"),
    [
        (1, 1, 1),
        (64, 64, 1),
        (65, 65, 2),
        (4_096, 4_096, 64),  # at its maximum: the count every agent watches
        (4_000, 4_096, 64),  # a few nodes short: still watched
        (1_024, 4_096, 64),  # a quarter of the maximum: buckets of ~16, still watched
        (1_000, 4_096, 64),  # 16 buckets' worth, a quarter of 64: still watched
        (960, 4_096, 15),  # below that: as many as its size needs, read by the agents
        (10, 100_000, 1),  # a job far below a generous --nnodes MAX writes one bucket, not 1,563
    ],
)
def test_a_round_has_the_bucket_count_its_maximum_gives_unless_its_buckets_would_be_mostly_empty(
    size, max_nodes, expected
):
    assert bucket_count(size, max_nodes) == expected
    assert watched_bucket_count(max_nodes) == -(-max_nodes // 64)
