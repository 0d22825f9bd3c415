"""The launcher's pure pieces: parsing, rank assignment, root cause; and the log mirror on a real etcd."""

from __future__ import annotations

import json

import pytest

from launcher.config import RendezvousSettings, Std, parse_nnodes, parse_rdzv_conf, parse_std_spec
from launcher.etcd import client as etcd_client
from launcher.rendezvous import membership_log
from launcher.rendezvous.decisions import assign_ranks, failure_summary, root_cause
from launcher.rendezvous.protocol import JobKeys, JobStore
from launcher.rendezvous.records import (
    DrainReport,
    MembershipEvent,
    NodeRecord,
    RoundRecord,
    WorkerFailure,
    new_event,
)

pytestmark = pytest.mark.timeout(60)


def node(name: str, nproc: int = 2, joined_at: float = 0.0, lease: int = 7) -> NodeRecord:
    return NodeRecord(node=name, addr="10.0.0.1", nproc=nproc, joined_at=joined_at, pid=1, lease=lease)


@pytest.mark.parametrize("spec, expected", [("1", (1, 1)), ("3", (3, 3)), ("2:4", (2, 4)), ("1:1", (1, 1))])
def test_nnodes_accepts_torchrun_forms(spec, expected):
    assert parse_nnodes(spec) == expected


@pytest.mark.parametrize("spec", ["0", "4:2", "a", "1:2:3", "", "-1"])
def test_nnodes_rejects_nonsense(spec):
    with pytest.raises(ValueError, match="--nnodes"):
        parse_nnodes(spec)


def test_rdzv_conf_parses_and_rejects_items_without_value():
    assert parse_rdzv_conf("a=1, b = x,") == {"a": "1", "b": "x"}
    with pytest.raises(ValueError, match="malformed"):
        parse_rdzv_conf("a=1,b")


def test_std_spec_global_and_per_rank():
    assert parse_std_spec("3", "tee") is Std.ALL
    assert parse_std_spec("0:1,1:2", "tee") == {0: Std.OUT, 1: Std.ERR}
    with pytest.raises(ValueError, match="--tee"):
        parse_std_spec("7", "tee")


def test_lease_ttl_is_never_shorter_than_the_configured_expiry():
    assert RendezvousSettings().lease_ttl == 3
    assert RendezvousSettings(keep_alive_interval=0.5, keep_alive_max_attempt=3).lease_ttl == 2
    assert RendezvousSettings(keep_alive_interval=0.1, keep_alive_max_attempt=1).lease_ttl == 1


def test_assign_ranks_is_deterministic_and_cumulative():
    nodes = {"b": node("b", 2, 1.0), "a": node("a", 3, 1.0), "c": node("c", 1, 0.5)}
    members = assign_ranks(None, nodes, max_nodes=8)
    assert [(m.node, m.group_rank, m.first_rank, m.last_rank) for m in members] == [
        ("c", 0, 0, 0),
        ("a", 1, 1, 3),
        ("b", 2, 4, 5),
    ]
    assert assign_ranks(None, dict(reversed(list(nodes.items()))), 8) == members


def test_survivors_keep_their_order_and_newcomers_fill_up_to_max():
    first = RoundRecord.of(
        0,
        assign_ranks(None, {"x": node("x", joined_at=2), "y": node("y", joined_at=1), "z": node("z", joined_at=3)}, 3),
        0,
        "initial",
    )
    assert [m.node for m in first.members] == ["y", "x", "z"]
    alive = {
        "x": node("x", joined_at=2),
        "z": node("z", joined_at=3),
        "new1": node("new1", joined_at=0),
        "new2": node("new2", joined_at=9),
    }
    second = assign_ranks(first, alive, max_nodes=3)
    assert [m.node for m in second] == ["x", "z", "new1"]  # new2 waits as a spare
    assert [m.first_rank for m in second] == [0, 2, 4]


def test_a_node_that_registered_again_is_a_newcomer_not_a_survivor():
    first = RoundRecord.of(
        0, assign_ranks(None, {"x": node("x", joined_at=1), "y": node("y", joined_at=2)}, 2), 0, "initial"
    )
    again = {"x": node("x", joined_at=5, lease=8), "y": node("y", joined_at=2)}
    second = assign_ranks(first, again, max_nodes=2)
    assert [(m.node, m.incarnation) for m in second] == [("y", 7), ("x", 8)]
    assert first.member("x", 8) is None and first.member("x", 7).group_rank == 0


def test_round_records_stay_small_for_thousands_of_nodes():
    nodes = {f"host{i:05d}_123456": node(f"host{i:05d}_123456", nproc=8, joined_at=i, lease=i) for i in range(4096)}
    record = RoundRecord.of(3, assign_ranks(None, nodes, 4096), 0, "initial")
    assert len(record.dumps()) < 100 * 4096  # bytes per member, so every agent can afford to receive it
    member = record.member("host04095_123456")
    assert (member.group_rank, member.first_rank, record.world_size) == (4095, 4095 * 8, 4096 * 8)


@pytest.mark.parametrize("report", [DrainReport(number=7, step=41), DrainReport(number=7, step=None)])
def test_drain_answers_survive_the_round_trip_through_etcd_values(report):
    assert DrainReport.loads(report.dumps()) == report  # None ("nothing to drain") is left out of the JSON


def test_root_cause_is_the_earliest_failure():
    late = WorkerFailure(node="b", round=0, local_rank=0, rank=2, exit_code=1, time=10.5)
    first = WorkerFailure(
        node="a", round=0, local_rank=1, rank=1, exit_code=-9, time=10.1, traceback="Traceback ...\nRuntimeError: boom"
    )
    assert root_cause([late, first]) is first
    summary = failure_summary("job", 3, first)
    assert "root cause node a, rank 1 (local_rank 1), killed by signal 9" in summary
    assert summary.endswith("RuntimeError: boom")


def test_endpoints_parse_lists_and_default_port():
    assert etcd_client.parse_endpoints("h1:1,h2, http://h3:3") == [("h1", 1), ("h2", 2379), ("h3", 3)]
    with pytest.raises(ValueError, match="bad etcd endpoint"):
        etcd_client.parse_endpoints("h:99999")


def test_agents_sharing_a_log_dir_write_each_event_once(etcd, tmp_path):
    client = etcd_client.connect(etcd.endpoint)
    keys = JobKeys("mirror")

    def append(*events: MembershipEvent) -> None:
        # one transaction, one revision: events land together, in key order
        puts = [client.transactions.put(keys.new_event_key("t"), e.dumps()) for e in events]
        client.transaction(compare=[], success=puts, failure=[])

    try:
        mirrors = [membership_log.LogMirror(tmp_path), membership_log.LogMirror(tmp_path)]
        append(new_event("node_joined", node="a"))
        mirrors[0].sync(JobStore(client, keys.rdzv_id).read_events)
        append(new_event("node_joined", node="b"))
        append(new_event("round_started", round=0), new_event("restart", round=0))
        client.put(keys.new_event_key("foreign"), "not an event")  # named in a warning, never fatal
        for mirror in reversed(mirrors):
            mirror.sync(JobStore(client, keys.rdzv_id).read_events)
        mirrors[0].sync(JobStore(client, keys.rdzv_id).read_events)
        lines = [json.loads(line) for line in (tmp_path / "membership.jsonl").read_text().splitlines()]
        assert [e["event"] for e in lines] == ["node_joined", "node_joined", "round_started", "restart"]
        assert [e["event"] for e in lines] == [e.event for e in JobStore(client, keys.rdzv_id).read_events()]
        assert membership_log.LogMirror.for_dir(tmp_path) is membership_log.LogMirror.for_dir(tmp_path / ".")
    finally:
        client.close()
