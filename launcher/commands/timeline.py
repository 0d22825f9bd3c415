"""A job's membership log as a timeline picture: world size and training steps over time, each round shaded, each
change's pause shaded, each event marked.

What `elastic-run log --plot timeline.png` draws (the file's extension picks the format: png, svg, pdf). Steps come
from the training_progress events that the agent of group rank 0 records (launcher.node.rules.progress_to_record):
the first step of every round, then one every 10 s at most. A change's pause runs from the first event that reports
it (a failure, a loss, a drain, a new round) to the first step recorded after its round started.
matplotlib is an optional extra (`pip install -e '.[plot]'`); everything but the drawing is plain data here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from launcher.rendezvous.membership_log import MembershipEvent

PLOT_EXTRA_HINT = "--plot needs matplotlib: pip install -e '.[plot]' (or pip install matplotlib)"
# event -> (marker, colour) of its mark; the label says what happened to whom
MARKS = {
    "node_lost": ("X", "black"),
    "controller_lost": ("X", "saddlebrown"),
    "node_left": ("v", "grey"),
    "worker_failed": ("x", "red"),
    "worker_hung": ("P", "darkorange"),
    "node_quarantined": ("s", "purple"),
    "drain_committed": ("D", "teal"),
}
# events that say training stopped for a change: a pause starts at the first of them after the last step
STOPS_TRAINING = {
    "node_lost",
    "node_left",
    "worker_failed",
    "worker_hung",
    "workers_stalled",
    "drain_requested",
    "round_started",
}
_ROUND_SHADES = ("#dbe9f6", "#f2f2f2")
_ROUND_LABEL_LANES = (0.97, 0.91, 0.85)  # axes fractions, above the curves
_MARK_LABEL_LANES = (0.78, 0.72, 0.66, 0.60)
_LABEL_GAP_PX = 4.0


@dataclass(frozen=True)
class RoundSpan:
    round: int
    start: float
    end: float
    world_size: int
    reason: str


@dataclass(frozen=True)
class Mark:
    time: float
    event: str
    label: str


@dataclass(frozen=True)
class Pause:
    """Training stood still from `start` to `end` (None: no step was recorded after it) for rounds `rounds`."""

    start: float
    end: float | None
    rounds: tuple[int, ...]


def round_spans(events: list[MembershipEvent]) -> list[RoundSpan]:
    """Each round from its round_started to the next one's, or to the job's end (or the last event)."""
    starts = [e for e in events if e.event == "round_started"]
    end_of_log = max((e.time for e in events), default=0.0)
    return [
        RoundSpan(
            e.round or 0,
            e.time,
            starts[i + 1].time if i + 1 < len(starts) else end_of_log,
            e.world_size or 0,
            e.reason or "",
        )
        for i, e in enumerate(starts)
    ]


def marks(events: list[MembershipEvent]) -> list[Mark]:
    """The events worth a mark, each with a short label: what happened, to which node, and the one detail."""
    found = []
    for event in events:
        if event.event not in MARKS:
            continue
        who = event.node or ""
        if event.event == "worker_failed":
            label = f"{who} rank {event.rank} failed ({event.exit_code})"
        elif event.event == "worker_hung":
            label = f"{who} rank {event.rank} hung"
        elif event.event == "drain_committed":
            label = f"drained at step {getattr(event, 'step', '?')}"
        else:
            label = f"{who} {event.event.removeprefix('node_').replace('_', ' ')}"
        found.append(Mark(event.time, event.event, label.strip()))
    return found


def world_size_steps(events: list[MembershipEvent]) -> tuple[list[float], list[int]]:
    """(times, world sizes) of a step plot: 0 before the first round and after the job ended."""
    times, sizes = [events[0].time], [0]
    for span in round_spans(events):
        times.append(span.start)
        sizes.append(span.world_size)
    end = next((e.time for e in events if e.event in ("job_finished", "job_failed")), None)
    if end is not None:
        times.append(end)
        sizes.append(0)
    times.append(events[-1].time)
    sizes.append(sizes[-1])
    return times, sizes


def progress(events: list[MembershipEvent]) -> tuple[list[float], list[int]]:
    """(times, steps) of the training_progress events."""
    found = [(e.time, e.step) for e in events if e.event == "training_progress" and e.step is not None]
    return [time for time, _ in found], [step for _, step in found]


def pauses(events: list[MembershipEvent]) -> list[Pause]:
    """Each stretch without training around a change of round, once the job has trained: from the first event
    after the last recorded step that says training stopped, to the next recorded step. Rounds formed before any
    step was recorded again share one pause."""
    found: list[Pause] = []
    stopped_at: float | None = None  # the pause open now began then
    rounds: list[int] = []
    trained = False
    for event in events:
        if event.event == "training_progress":
            if stopped_at is not None and rounds:
                found.append(Pause(stopped_at, event.time, tuple(rounds)))
            stopped_at, rounds, trained = None, [], True
        elif trained and event.event in STOPS_TRAINING:
            stopped_at = event.time if stopped_at is None else stopped_at
            if event.event == "round_started":
                rounds.append(event.round or 0)
    if stopped_at is not None and rounds:
        found.append(Pause(stopped_at, None, tuple(rounds)))
    return found


def assign_lanes(spans: list[tuple[float, float]], lanes: int, gap: float) -> list[int | None]:
    """A lane for each label, given as (left, right) in display units and sorted by left edge: the first lane
    whose last label ends `gap` before it starts, or None (left out) when every lane is taken there."""
    ends = [-math.inf] * lanes
    placed: list[int | None] = []
    for left, right in spans:
        lane = next((index for index, end in enumerate(ends) if left >= end + gap), None)
        if lane is not None:
            ends[lane] = right
        placed.append(lane)
    return placed


def draw(events: list[MembershipEvent], title: str, path: Path) -> None:
    """Write the timeline of `events` (log order) to `path`; ImportError names the extra when matplotlib is
    missing, ValueError when there is nothing to draw."""
    figure = timeline_figure(events, title)
    try:
        figure.savefig(path)
    finally:
        _pyplot().close(figure)


def timeline_figure(events: list[MembershipEvent], title: str):
    """The timeline of `events` as a matplotlib Figure, its labels placed; the caller closes it."""
    if not events:
        raise ValueError("no events to draw")
    plt = _pyplot()
    origin = events[0].time
    times, sizes = world_size_steps(events)
    end = max(times[-1] - origin, 1e-3)
    figure, axes = plt.subplots(figsize=(11, 4.6), dpi=120)
    try:
        axes.set_xlim(0, end)
        axes.set_ylim(0, max(sizes + [1]) / 0.55)  # the curves in the lower 55 %, labels above them
        for span in round_spans(events):
            axes.axvspan(span.start - origin, span.end - origin, color=_ROUND_SHADES[span.round % 2], zorder=0)
        for pause in pauses(events):
            stop = (pause.end if pause.end is not None else times[-1]) - origin
            axes.axvspan(pause.start - origin, stop, color="#f4b6b6", alpha=0.6, zorder=1, lw=0)
        axes.step([t - origin for t in times], sizes, where="post", color="#1f77b4", linewidth=2, label="world size")
        mark_list = marks(events)
        for mark in mark_list:
            marker, colour = MARKS[mark.event]
            axes.scatter([mark.time - origin], [_size_at(times, sizes, mark.time)], marker=marker, color=colour, s=60)
        _draw_steps(axes, events, origin)
        axes.set_xlabel("seconds since the first event (red: training paused for a change)")
        axes.set_ylabel("world size (workers)")
        axes.set_title(title, fontsize=10)
        figure.tight_layout()  # before placing labels: they are measured where they will be drawn
        left_out = _draw_labels(figure, axes, events, mark_list, origin)
        if left_out:
            axes.set_title(f"{title} ({left_out} labels left out: `elastic-run log` lists every event)", fontsize=10)
    except BaseException:
        plt.close(figure)
        raise
    return figure


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(PLOT_EXTRA_HINT) from None
    return plt


def _draw_steps(axes, events: list[MembershipEvent], origin: float) -> None:
    """Steps completed on a second axis, the line broken across each pause: nothing trained there."""
    times, steps = progress(events)
    if not times:
        return
    breaks = [pause.start for pause in pauses(events)]
    xs: list[float] = []
    ys: list[float] = []
    for time, step in zip(times, steps):
        if xs and any(xs[-1] + origin < moment < time for moment in breaks):
            xs.append(math.nan)
            ys.append(math.nan)
        xs.append(time - origin)
        ys.append(step)
    steps_axes = axes.twinx()
    steps_axes.plot(xs, ys, color="#2ca02c", marker=".", markersize=4, linewidth=1.2)
    steps_axes.set_ylim(0, max(steps) / 0.55)
    steps_axes.set_ylabel("steps completed", color="#2ca02c")


def _draw_labels(figure, axes, events: list[MembershipEvent], mark_list: list[Mark], origin: float) -> int:
    """Round and event labels in lanes above the curves, never overlapping; returns how many did not fit."""
    renderer = figure.canvas.get_renderer()
    labels = [
        (span.start - origin, f"round {span.round}: {span.reason}", "#333333", _ROUND_LABEL_LANES, None)
        for span in round_spans(events)
    ] + [(mark.time - origin, mark.label, MARKS[mark.event][1], _MARK_LABEL_LANES, mark) for mark in mark_list]
    left_out = 0
    for lanes in (_ROUND_LABEL_LANES, _MARK_LABEL_LANES):
        group = sorted((label for label in labels if label[3] is lanes), key=lambda label: label[0])
        texts = [
            axes.text(x, lanes[0], text, fontsize=7, color=colour, va="top", transform=axes.get_xaxis_transform())
            for x, text, colour, _, _ in group
        ]
        right_edge = axes.get_window_extent(renderer).x1
        for text in texts:  # a label that would run off the right edge ends at its time instead
            if text.get_window_extent(renderer).x1 > right_edge:
                text.set_horizontalalignment("right")
        extents = [text.get_window_extent(renderer) for text in texts]
        order = sorted(range(len(texts)), key=lambda index: extents[index].x0)
        lanes_in_order = assign_lanes([(extents[i].x0, extents[i].x1) for i in order], len(lanes), _LABEL_GAP_PX)
        placed = [lane for _, lane in sorted(zip(order, lanes_in_order))]
        for text, lane, (x, _, colour, _, mark) in zip(texts, placed, group):
            if lane is None:
                text.remove()
                left_out += 1
                continue
            text.set_y(lanes[lane])
            if mark is not None:  # a thin line from the label down to its mark
                axes.axvline(x, ymax=lanes[lane] - 0.04, color=colour, linewidth=0.5, alpha=0.5, zorder=2)
    return left_out


def _size_at(times: list[float], sizes: list[int], when: float) -> int:
    current = 0
    for time, size in zip(times, sizes):
        if time > when:
            break
        current = size
    return current
