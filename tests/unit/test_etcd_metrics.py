"""bench/etcd_metrics.py: a cluster's counters over a window, from the members scraped at both of its ends."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import etcd_metrics  # noqa: E402

pytestmark = pytest.mark.timeout(30)


def sample(time: float, puts: float, proposals: float) -> etcd_metrics.Sample:
    return etcd_metrics.Sample(time=time, unary={"Put": puts}, proposals=proposals, sent_bytes=10 * puts)


def test_a_member_missing_at_one_end_is_left_out_of_the_window():
    before = {"m0": sample(1.0, 5, 5), "m1": sample(1.0, 7, 5)}
    after = {"m0": sample(3.0, 9, 8)}  # m1 was killed meanwhile
    window = etcd_metrics.delta_members(before, after)
    assert (window.seconds, window.requests, window.proposals, window.sent_bytes) == (2.0, 4, 3, 40)


def test_a_window_no_member_answered_at_both_ends_is_an_error_not_a_crash():
    """4,096 simulated agents: etcd did not answer its metrics endpoint within 10 s after round 0, and the bench
    died with `max() arg is an empty sequence` instead of reporting the run."""
    with pytest.raises(etcd_metrics.MetricsUnavailable, match="no etcd member answered"):
        etcd_metrics.delta_members({"m0": sample(1.0, 5, 5)}, {})
