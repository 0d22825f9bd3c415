"""`elastic-run log --plot`: the membership log as an SVG timeline, checked element by element."""

from __future__ import annotations

import subprocess
import xml.etree.ElementTree as ET

import pytest

from launcher.membership_log import MembershipEvent
from launcher.timeline import render_svg, round_spans
from launcher_harness import elastic_run_command

pytestmark = pytest.mark.timeout(30)
SVG = "{http://www.w3.org/2000/svg}"


def member(node: str, rank: int) -> dict:
    return {"node": node, "group_rank": rank, "first_rank": 2 * rank, "last_rank": 2 * rank + 1}


def a_job() -> list[MembershipEvent]:
    at = 1_700_000_000.0
    events = [
        ("node_joined", 0.0, dict(node="a")), ("node_joined", 0.1, dict(node="b")), ("node_joined", 0.2, dict(node="c")),
        ("round_started", 1.0, dict(round=0, world_size=6, reason="initial",
                                    members=[member("a", 0), member("b", 1), member("c", 2)])),
        ("worker_failed", 9.0, dict(round=0, node="b", rank=3, exit_code=1)),
        ("node_lost", 9.4, dict(round=0, node="c", reason="liveness probe refused: the agent is gone")),
        ("round_started", 9.5, dict(round=1, world_size=4, reason="node_lost", members=[member("a", 0), member("b", 1)])),
        ("job_finished", 20.0, dict(round=1, world_size=4)),
    ]  # fmt: skip
    return [MembershipEvent(event=name, time=at + offset, **fields) for name, offset, fields in events]


def test_rounds_span_from_their_start_to_the_next_or_the_end():
    spans = round_spans(a_job())
    assert [(s.round, s.end - s.start, s.world_size, s.nodes) for s in spans] == [
        (0, pytest.approx(8.5), 6, ("a", "b", "c")), (1, pytest.approx(10.5), 4, ("a", "b"))]


def test_the_picture_has_a_lane_per_node_a_bar_per_member_round_and_a_mark_per_event():
    root = ET.fromstring(render_svg(a_job(), "job demo"))
    bars = [e for e in root.iter(f"{SVG}rect") if e.get("class") == "round"]
    assert sorted(b.get("data-round") for b in bars) == ["0", "0", "0", "1", "1"]
    marks = [e.get("data-event") for e in root.iter() if e.get("class") == "event"]
    assert sorted(marks) == ["node_joined"] * 3 + ["node_lost", "worker_failed"]
    labels = [t.text for t in root.iter(f"{SVG}text")]
    assert {"a", "b", "c", "job demo"} <= set(labels)
    assert any(text and text.startswith("r1 w4 node_lost") for text in labels)
    failed = next(e for e in root.iter() if e.get("data-event") == "worker_failed")
    assert "rank=3" in failed.find(f"{SVG}title").text and "exit_code=1" in failed.find(f"{SVG}title").text
    round1 = next(b for b in bars if b.get("data-round") == "1")
    assert float(round1.get("x")) > float(next(b for b in bars if b.get("data-round") == "0").get("x"))


def test_nothing_to_draw_is_an_error():
    with pytest.raises(ValueError, match="no events"):
        render_svg([], "empty")


def test_log_plot_writes_the_svg_from_a_membership_file(tmp_path):
    log = tmp_path / "membership.jsonl"
    log.write_text("".join(e.dumps() + "\n" for e in a_job()))
    out = tmp_path / "timeline.svg"
    result = subprocess.run([*elastic_run_command(), "log", "--file", str(log), "--plot", str(out)],
                            capture_output=True, text=True, timeout=30)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"wrote {out}: 8 events, 2 rounds, 3 nodes"
    assert ET.parse(out).getroot().tag == f"{SVG}svg"
