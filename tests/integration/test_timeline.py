"""`elastic-run log --plot`: world size over time, rounds shaded, events marked; the data behind it as tables."""

from __future__ import annotations

import subprocess
import sys

import pytest
from launcher_harness import elastic_run_command

from launcher.commands.timeline import (
    Mark,
    Pause,
    assign_lanes,
    marks,
    pauses,
    progress,
    round_spans,
    timeline_figure,
    world_size_steps,
)
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


def events_at(*rows: tuple[str, float, dict]) -> list[MembershipEvent]:
    return [MembershipEvent(event=name, time=AT + offset, **fields) for name, offset, fields in rows]


def step(at: float, number: int, round_: int = 0) -> tuple[str, float, dict]:
    return ("training_progress", at, dict(round=round_, node="a", step=number))


def start(at: float, round_: int) -> tuple[str, float, dict]:
    return ("round_started", at, dict(round=round_, world_size=4, reason="node_lost"))


@pytest.mark.parametrize(
    "case, rows, expected",
    [
        ("the first round is the start, not a pause", [start(1, 0), step(3, 1)], []),
        (
            "a failure pauses training until the next round's first step",
            [start(1, 0), step(3, 1), step(13, 90), ("worker_failed", 15, dict(round=0)), start(15.1, 1), step(16, 91)],
            [Pause(AT + 15, AT + 16, (1,))],
        ),
        (
            "a loss and the replacement's scale-up before any step: one pause, two rounds",
            [start(1, 0), step(3, 1), ("node_lost", 10, {}), start(10.1, 1), start(12, 2), step(14, 50)],
            [Pause(AT + 10, AT + 14, (1, 2))],
        ),
        (
            "a joiner alone does not stop training; its round does",
            [start(1, 0), step(3, 1), ("node_joined", 5, dict(node="d")), start(8, 1), step(9.5, 20)],
            [Pause(AT + 8, AT + 9.5, (1,))],
        ),
        (
            "no step after the last change: open-ended",
            [start(1, 0), step(3, 1), ("drain_requested", 6, {}), start(7, 1)],
            [Pause(AT + 6, None, (1,))],
        ),
        (
            "a stall that ends without a new round is not a change's pause",
            [start(1, 0), step(3, 1), ("workers_stalled", 5, {}), step(9, 5)],
            [],
        ),
    ],
)
def test_each_change_pauses_from_its_first_report_to_the_next_step(case, rows, expected):
    assert pauses(events_at(*rows)) == expected, case


def test_progress_is_read_from_training_progress_events():
    times, steps = progress(events_at(start(1, 0), step(3, 1), ("node_lost", 4, {}), step(5, 7, 1)))
    assert ([t - AT for t in times], steps) == ([3, 5], [1, 7])


@pytest.mark.parametrize(
    "case, spans, lanes, expected",
    [
        ("apart: all in the first lane", [(0, 10), (20, 30)], 2, [0, 0]),
        ("overlapping: the next lane", [(0, 10), (5, 15), (16, 20)], 2, [0, 1, 0]),
        ("closer than the gap counts as overlapping", [(0, 10), (12, 20)], 1, [0, None]),
        ("every lane taken: left out", [(0, 10), (1, 11), (2, 12)], 2, [0, 1, None]),
    ],
)
def test_labels_take_the_first_free_lane_or_are_left_out(case, spans, lanes, expected):
    assert assign_lanes(spans, lanes, gap=4) == expected, case


def test_twenty_rounds_in_a_minute_draw_labels_that_never_overlap(tmp_path):
    import matplotlib.pyplot as pyplot

    rows = [start(0, 0), step(1, 1)]
    for index in range(1, 21):  # a fault every 3 s: a failure, its round, its first step
        at = index * 3.0
        rows += [
            ("worker_failed", at, dict(round=index - 1, node=f"node{index % 3}", rank=index % 6, exit_code=1)),
            ("node_lost", at + 0.2, dict(round=index - 1, node=f"node{(index + 1) % 3}")),
            start(at + 0.3, index),
            step(at + 1.1, 10 * index, index),
        ]
    rows.append(("job_finished", 64.0, dict(round=20, world_size=4)))
    figure = timeline_figure(events_at(*rows), "twenty rounds")
    figure.savefig(tmp_path / "t.png")  # the labels as a reader sees them
    renderer = figure.canvas.get_renderer()
    labels = [text for axes in figure.axes for text in axes.texts if text.get_visible() and text.get_text()]
    boxes = [text.get_window_extent(renderer) for text in labels]
    assert len(labels) >= 20, "most labels still fit"
    overlapping = [
        (labels[i].get_text(), labels[j].get_text())
        for i in range(len(boxes))
        for j in range(i + 1, len(boxes))
        if boxes[i].overlaps(boxes[j])
    ]
    assert not overlapping
    assert "labels left out" in figure.axes[0].get_title()
    pyplot.close(figure)


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
