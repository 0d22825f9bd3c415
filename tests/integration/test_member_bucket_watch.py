"""An agent learns its place in each round from the member bucket etcd sends it (a watch), on a real etcd: no read
while the round has the count its --nnodes MAX gives, a read when it has another, and the same answers either way."""

from __future__ import annotations

import threading

import pytest

from launcher.etcd import client as etcd_client
from launcher.node.member_bucket import WatchedBucket
from launcher.rendezvous.protocol import ControllerStore, Holder, JobStore
from launcher.rendezvous.records import Member, RoundHeader, RoundRecord, bucket_count, new_event

pytestmark = pytest.mark.timeout(60)

MAX_NODES = 1_000  # 16 watched buckets


class CountingStore(JobStore):
    """An agent's store that counts its reads of a member bucket."""

    reads = 0

    def read_member(self, header: RoundHeader, node: str, incarnation: int) -> Member | None:
        self.reads += 1
        return super().read_member(header, node, incarnation)


def watched(client, node: str) -> WatchedBucket:
    return WatchedBucket(CountingStore(client, "watched"), node, MAX_NODES)


def reads(agent: WatchedBucket) -> int:
    assert isinstance(agent.store, CountingStore)
    return agent.store.reads


def members(nodes: list[str]) -> list[Member]:
    return [Member(node, 100 + int(node[1:]), i, 2, 2 * i, f"10.0.0.{i % 250}") for i, node in enumerate(nodes)]


@pytest.fixture
def job(etcd):
    client = etcd_client.connect(etcd.endpoint)
    store = ControllerStore(client, "watched")
    holder = Holder("n0", client.lease(30).id)
    assert store.claim_controller(holder)
    try:
        yield store, holder
    finally:
        client.close()


def form(store: ControllerStore, holder: Holder, record: RoundRecord) -> RoundHeader:
    revision = store.client.get(store.keys.round)[1]
    event = new_event("round_started", round=record.round, size=len(record.nodes))
    buckets = bucket_count(len(record.nodes), MAX_NODES)
    assert store.form_round(holder, revision.mod_revision if revision else 0, record, [event], [], buckets)
    return RoundHeader.loads(store.client.get(store.keys.round)[0])


def test_each_agent_takes_its_place_from_the_watched_bucket_and_reads_only_a_round_of_another_count(job):
    store, holder = job
    nodes = [f"n{i}" for i in range(900)]
    agents = {node: watched(store.client, node) for node in nodes[::37]}
    late = watched(store.client, "n899")  # a newcomer after round 0
    for agent in agents.values():
        agent.start()
    try:
        first = RoundRecord.of(0, members(nodes[:800]), 0, "initial")  # n814 .. n888 wait
        header = form(store, holder, first)
        assert header.buckets == 16
        for node, agent in agents.items():
            assert agent.member(header, 100 + int(node[1:])) == first.member(node)
            assert agent.member(header, 7) is None, "another incarnation of the node is no member"
        late.start()  # its watch starts past round 0, whose bucket it finds in its first read
        assert late.member(header, 999) is None and reads(late) == 0

        second = RoundRecord.of(1, members(nodes[100:]), 0, "scale_up")
        header = form(store, holder, second)
        for node, agent in [*agents.items(), ("n899", late)]:
            assert agent.member(header, 100 + int(node[1:])) == second.member(node)
            assert reads(agent) == 0, "learned from the watch, without a read"

        small = RoundRecord.of(2, members(nodes[:90]), 0, "node_lost")  # 2 buckets: far below MAX
        header = form(store, holder, small)
        assert header.buckets == 2
        for node, agent in agents.items():
            assert agent.member(header, 100 + int(node[1:])) == small.member(node)
            assert reads(agent) == 1, "a round of another count is read"
    finally:
        for agent in [*agents.values(), late]:
            agent.close()


def test_a_bucket_the_watch_does_not_bring_is_read(job):
    store, holder = job
    agent = watched(store.client, "n5").start()
    try:
        record = RoundRecord.of(0, members([f"n{i}" for i in range(800)]), 0, "initial")
        header = form(store, holder, record)
        agent.mirror.close()  # the watch is gone: nothing more arrives
        later = header.model_copy(update={"round": 1})
        store.client.put(
            store.keys.member_bucket(1, agent.index), store.client.get(store.keys.member_bucket(0, agent.index))[0]
        )
        assert agent.member(later, 105) == record.member("n5") and reads(agent) == 1
    finally:
        agent.close()


def test_a_bucket_a_rival_controller_wrote_for_the_same_round_is_not_taken_for_the_winners(job):
    store, _ = job
    agent = watched(store.client, "n5").start()
    nodes = [f"n{i}" for i in range(800)]
    winner = RoundRecord.of(0, members(nodes), 0, "initial")
    rival = RoundRecord.of(0, members(nodes[::-1]), 0, "initial").model_copy(update={"formed_at": 1.0})
    header, buckets = winner.split(16)
    key = store.keys.member_bucket(0, agent.index)
    try:
        store.client.put(key, rival.split(16)[1][agent.index].dumps())  # its race lost before its header
        while not agent.mirror.snapshot()[0]:
            agent.mirror.wait(agent.mirror.version, 1.0)
        # the winner's header is seen before its bucket reaches the watch
        writer = threading.Timer(0.2, store.client.put, (key, buckets[agent.index].dumps()))
        writer.start()
        assert agent.member(header, 105) == winner.member("n5") != rival.member("n5")
        assert reads(agent) == 0, "it waited for the winner's bucket"
        writer.join()
    finally:
        agent.close()
