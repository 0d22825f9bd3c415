"""`elastic-run log --plot`: world size over time, rounds shaded, events marked; the data behind it as tables."""

from __future__ import annotations

import subprocess
import sys

import pytest
from launcher_harness import elastic_run_command

from launcher.commands.timeline import Mark, marks, round_spans, world_size_steps
from launcher.rendezvous.membership_log import MembershipEvent

pytestmark = pytest.mark.timeout(60)
AT = 1_700_000_000.0


def member(node: str, rank: int) -> dict:
    return {"node": node, "group_rank": rank, "first_rank": 2 * rank, "last_rank": 2 * rank + 1}


def a_job() -> list[MembershipEvent]:
    events = [
        ("node_joined", 0.0, dict(node="a")),
        ("node_joined", 0.1, dict(node="b")),
        ("node_joined", 0.2, dict(node="c")),
        (
            "round_started",
            1.0,
            dict(round=0, world_size=6, reason="initial", members=[member("a", 0), member("b", 1), member("c", 2)]),
        ),
        ("worker_failed", 9.0, dict(round=0, node="b", rank=3, exit_code=1)),
        ("node_lost", 9.4, dict(round=0, node="c", reason="liveness probe refused: the agent is gone")),
        (
            "round_started",
            9.5,
            dict(round=1, world_size=4, reason="node_lost", members=[member("a", 0), member("b", 1)]),
        ),
        ("drain_committed", 15.0, dict(round=1, step=40)),
        ("job_finished", 20.0, dict(round=1, world_size=4)),
    ]
    return [MembershipEvent(event=name, time=AT + offset, **fields) for name, offset, fields in events]


def test_rounds_span_from_their_start_to_the_next_or_the_end():
    spans = round_spans(a_job())
    assert [(s.round, s.end - s.start, s.world_size, s.reason) for s in spans] == [
        (0, pytest.approx(8.5), 6, "initial"),
        (1, pytest.approx(10.5), 4, "node_lost"),
    ]


def test_world_size_is_a_step_function_of_the_rounds():
    times, sizes = world_size_steps(a_job())
    assert [t - AT for t in times] == pytest.approx([0.0, 1.0, 9.5, 20.0, 20.0])
    assert sizes == [0, 6, 4, 0, 0]


def test_each_loss_failure_and_drain_is_marked_and_labelled():
    assert [(m.time - AT, m.event, m.label) for m in marks(a_job())] == [
        (pytest.approx(9.0), "worker_failed", "b rank 3 failed (1)"),
        (pytest.approx(9.4), "node_lost", "c lost"),
        (pytest.approx(15.0), "drain_committed", "drained at step 40"),
    ]
    assert isinstance(marks(a_job())[0], Mark)


@pytest.mark.parametrize("suffix, magic", [(".png", b"\x89PNG"), (".svg", b"<?xml")])
def test_log_plot_writes_the_picture_from_a_membership_file(tmp_path, suffix, magic):
    log = tmp_path / "membership.jsonl"
    log.write_text("".join(e.dumps() + "\n" for e in a_job()))
    out = tmp_path / f"timeline{suffix}"
    result = subprocess.run(
        [*elastic_run_command(), "log", "--file", str(log), "--plot", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"wrote {out}: 9 events, 2 rounds, 3 nodes"
    assert out.read_bytes().startswith(magic) and out.stat().st_size > 5000


def test_without_matplotlib_the_plot_names_the_extra(tmp_path):
    log = tmp_path / "membership.jsonl"
    log.write_text("".join(e.dumps() + "\n" for e in a_job()))
    hide = "import sys; sys.modules['matplotlib'] = None; from launcher.commands.cli import main; sys.exit(main())"
    result = subprocess.run(
        [sys.executable, "-c", hide, "log", "--file", str(log), "--plot", str(tmp_path / "t.png")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "elastic-run log: error: --plot needs matplotlib: pip install -e '.[plot]' (or pip install matplotlib)"
    )
