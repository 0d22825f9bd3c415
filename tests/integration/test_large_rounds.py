"""Rounds of tens of thousands of nodes on a real etcd, at its default limits (1.5 MiB per request, 128 operations
per transaction) and gRPC's (4 MiB per received message): written, announced, read back by agent and controller."""

from __future__ import annotations

import math

import pytest

from launcher.etcd import client as etcd_client
from launcher.etcd.watch import RangeMirror
from launcher.rendezvous.job_view import ViewParser
from launcher.rendezvous.protocol import ControllerStore, Holder
from launcher.rendezvous.records import (
    MEMBERS_PER_BUCKET,
    Member,
    MemberBucket,
    RoundRecord,
    bucket_count,
    new_event,
)
from launcher.rendezvous.round_events import MAX_LOGGED_MEMBERS

pytestmark = pytest.mark.timeout(90)

LARGE = 16_384  # one transaction of it would be 2.3 MB: 0.9 MB of buckets, 1.4 MB of round_started's member list


def round_of(size: int, number: int = 0) -> RoundRecord:
    members = [
        Member(f"host-{i:06d}", 7_000_000 + i, i, 8, 8 * i, f"10.{i >> 16}.{i >> 8 & 255}.{i & 255}")
        for i in range(size)
    ]
    return RoundRecord.of(number, members, 0, "initial")


@pytest.fixture
def controller(etcd):
    client = etcd_client.connect(etcd.endpoint)
    store = ControllerStore(client, "big")
    lease = client.lease(30)
    holder = Holder("host-000000", lease.id)
    assert store.claim_controller(holder)
    try:
        yield store, holder
    finally:
        client.close()


def form(store: ControllerStore, holder: Holder, revision: int, record: RoundRecord) -> bool:
    """Write `record` as the controller of a job whose --nnodes MAX is its size."""
    return store.form_round(
        holder, revision, record, [started(record)], [], bucket_count(len(record.nodes), len(record.nodes))
    )


def started(record: RoundRecord):
    event = new_event("round_started", round=record.round, world_size=record.world_size, size=len(record.nodes))
    if len(record.nodes) <= MAX_LOGGED_MEMBERS:
        event.members = record.member_summary()
    return event


def test_a_round_of_16k_nodes_is_written_and_every_agent_reads_only_its_own_small_bucket(controller):
    store, holder = controller
    record = round_of(LARGE)
    assert form(store, holder, 0, record)

    mirror = RangeMirror(store.client, store.keys.state).start()  # the controller's view, paged
    try:
        entries, revision, _ = mirror.snapshot()
        view = ViewParser(store.keys.state, store.keys.state).parse(entries, revision)
    finally:
        mirror.close()
    assert view.round_header.buckets == math.ceil(LARGE / MEMBERS_PER_BUCKET)
    assert view.round == record, "the controller assembles exactly the round it wrote"

    sizes = [len(MemberBucket.loads(entry.value).nodes) for key, entry in entries.items() if key.startswith("members/")]
    assert len(sizes) == view.round_header.buckets and sum(sizes) == LARGE
    assert max(sizes) < 2 * MEMBERS_PER_BUCKET, "what an agent reads stays small whatever the job's size"
    for index in (0, 1, 4097, LARGE - 1):  # the agents' side: one bucket read each
        node = f"host-{index:06d}"
        assert store.read_member(view.round_header, node, 7_000_000 + index) == record.member(node)


def test_a_round_that_lost_its_guard_between_its_transactions_is_not_announced(controller):
    store, holder = controller
    store.client.delete(store.keys.controller)  # another agent's claim would come next: ours no longer holds
    assert not form(store, holder, 0, round_of(5_000))
    assert store.client.get(store.keys.round)[0] is None
    assert list(store.client.get_prefix(store.keys.members)) == [], "the first bucket transaction is guarded too"


def test_buckets_a_lost_race_left_behind_are_ignored_and_cleared_by_the_next_round(controller):
    store, holder = controller
    stale = MemberBucket(nodes=["ghost"], incarnations=[1], nproc=[8], addrs=["x"], group_ranks=[0], first_ranks=[0])
    store.client.put(store.keys.member_bucket(1, 120), stale.dumps())  # a rival's round 1 had 121 buckets
    first = round_of(100)
    assert form(store, holder, 0, first)
    revision = store.client.get(store.keys.round)[1].mod_revision
    second = round_of(6_000, number=1)
    assert form(store, holder, revision, second)

    mirror = RangeMirror(store.client, store.keys.state).start()
    try:
        entries, revision, _ = mirror.snapshot()
    finally:
        mirror.close()
    view = ViewParser(store.keys.state, store.keys.state).parse(entries, revision)
    assert view.round_header.buckets == 94 and view.round == second
    assert view.round.member("ghost") is None
    third = round_of(10, number=2)
    assert form(store, holder, view.round_revision, third)
    assert {m.key.decode() for _, m in store.client.get_prefix(store.keys.members)} == {
        store.keys.member_bucket(2, 0),
        store.keys.member_bucket(1, 0),  # an agent late for round 1 may still read it
    }, "each round clears the buckets past its count and those two rounds old, the rival's too"


def test_a_prefix_larger_than_a_grpc_message_is_read_in_pages(etcd):
    client = etcd_client.connect(etcd.endpoint)
    try:
        value = "v" * 4096
        for batch in range(11):  # 1,100 keys of 4 KB: 4.5 MB, past the 4 MiB a client receives in one message
            client.transaction(
                compare=[],
                success=[client.transactions.put(f"/wide/k{batch:02d}{i:03d}", value) for i in range(100)],
                failure=[],
            )
        kvs, revision = client.read_prefix("/wide/")
        assert len(kvs) == 1_100 and revision == client.get("/wide/k00000")[1].response_header.revision
        assert [kv.key for kv in kvs] == sorted(kv.key for kv in kvs)
        newer, _ = client.read_prefix("/wide/", min_mod_revision=revision)
        assert len(newer) == 100, "filters apply across pages (the last transaction's keys)"
    finally:
        client.close()
