"""The protocol's keys: every key JobKeys builds parses back to what built it, the docstring's table names every
kind of key, a key of no builder is refused; and the pure rules import no etcd client."""

from __future__ import annotations

import subprocess
import sys

import pytest

from launcher.rendezvous import protocol
from launcher.rendezvous.protocol import (
    AccessCheckKey,
    ControllerKey,
    DrainKey,
    EventKey,
    JobKeys,
    LeftKey,
    MasterKey,
    MemberBucketKey,
    NodeKey,
    ReportKey,
    ReportKind,
    RollCallKey,
    RoundHeaderKey,
    StatusKey,
)

pytestmark = pytest.mark.timeout(60)

KEYS = JobKeys("job-1.a_b")

BUILT = [
    (KEYS.node("host-1_23:4"), NodeKey("host-1_23:4")),
    (KEYS.left("n"), LeftKey("n")),
    (KEYS.controller, ControllerKey()),
    (KEYS.round, RoundHeaderKey()),
    (KEYS.status, StatusKey()),
    (KEYS.master(0), MasterKey(0)),
    (KEYS.rollcall(12), RollCallKey(12)),
    (KEYS.drain(9_999_999_999), DrainKey(9_999_999_999)),
    (KEYS.member_bucket(3, 47), MemberBucketKey(3, 47)),
    *((KEYS.report(5, kind, "n-1"), ReportKey(5, kind, "n-1")) for kind in ReportKind),
]


@pytest.mark.parametrize("key, parsed", BUILT, ids=[key for key, _ in BUILT])
def test_every_built_key_parses_back_to_what_built_it(key, parsed):
    assert JobKeys.parse(key) == parsed


def test_generated_keys_parse_back_to_their_parts():
    event = JobKeys.parse(KEYS.new_event_key("node-a-1"))
    assert isinstance(event, EventKey) and event.author == "node-a-1" and event.time_ns > 0
    later = JobKeys.parse(KEYS.new_event_key("node-a-1"))
    assert isinstance(later, EventKey) and later.sequence == event.sequence + 1
    probe = JobKeys.parse(KEYS.new_access_check_key())
    assert isinstance(probe, AccessCheckKey) and len(probe.probe) == 32


def test_a_report_key_is_written_with_its_kind_s_value():
    assert KEYS.report(5, ReportKind.FAILED, "n") == "/elastic/job-1.a_b/state/rounds/0000000005/failed/n"
    assert {kind.value for kind in ReportKind} == {"ack", "done", "failed", "alive", "drained", "stalled", "lost"}


def test_prefixes_cover_the_keys_they_delete():
    assert KEYS.member_bucket(3, 0).startswith(KEYS.bucket_prefix(0)) and KEYS.bucket_prefix(0).startswith(KEYS.members)
    assert KEYS.member_bucket(2, 5) < KEYS.member_bucket(3, 5) < KEYS.member_bucket(10, 5), "a bucket's rounds in order"
    assert KEYS.report(3, ReportKind.ACK, "n").startswith(KEYS.round_prefix(3))
    assert all(key.startswith(KEYS.prefix) for key, _ in BUILT)


@pytest.mark.parametrize(
    "key",
    [
        "/elastic/job/state/nodes/",
        "/elastic/job/state/nodes/a/b",
        "/elastic/job/state/ctl/master/x1",
        "/elastic/job/state/ctl/master/-1",
        "/elastic/job/state/ctl/other",
        "/elastic/job/state/rounds/0000000001/bogus/n",
        "/elastic/job/state/rounds/0000000001/ack/",
        "/elastic/job/state/members/0000000001",
        "/elastic/job/events/12-x",
        "/elastic/job/events/abc-x-000001",
        "/elastic/job/foreign",
        "/elastic/job",
        "/other/job/state/ctl/round",
    ],
)
def test_a_key_no_builder_makes_is_refused(key):
    with pytest.raises(ValueError):
        JobKeys.parse(key)


def test_the_key_table_has_a_row_for_every_kind_of_key():
    table = [line.split("|")[1].strip() for line in (protocol.__doc__ or "").splitlines() if line.startswith("| ")]
    below_job = {key.removeprefix(KEYS.prefix) for key, _ in BUILT}
    below_job |= {KEYS.new_event_key("a").removeprefix(KEYS.prefix), KEYS.new_access_check_key()[len(KEYS.prefix) :]}
    for key in below_job:
        rows = [row for row in table if _row_matches(row, key)]
        assert rows, f"no row of protocol.py's key table for {key}"


def _row_matches(row: str, key: str) -> bool:
    """Whether the table's `row` (`state/rounds/<round>/ack/<node>`) spells `key` (a placeholder: one segment)."""
    row_parts, key_parts = row.split("/"), key.split("/")
    if len(row_parts) != len(key_parts):
        return False
    return all(
        written == actual or (written.startswith("<") and written.endswith(">")) or "<" in written
        for written, actual in zip(row_parts, key_parts)
    )


def test_the_rules_import_no_etcd_client():
    found = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, launcher.rendezvous.decisions; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'grpc', 'pyetcd', 'etcd3'}))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert found.stdout.strip() == "[]", f"launcher.rendezvous.decisions imports {found.stdout.strip()}"
