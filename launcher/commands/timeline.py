"""A job's membership log as a timeline picture: world size over time, each round shaded, each event marked.

What `elastic-run log --plot timeline.png` draws (the file's extension picks the format: png, svg, pdf).
matplotlib is an optional extra (`pip install -e '.[plot]'`); everything but the drawing is plain data here.
"""

from __future__ import annotations

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
_ROUND_SHADES = ("#dbe9f6", "#f2f2f2")


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


def draw(events: list[MembershipEvent], title: str, path: Path) -> None:
    """Write the timeline of `events` (log order) to `path`; ImportError names the extra when matplotlib is
    missing, ValueError when there is nothing to draw."""
    if not events:
        raise ValueError("no events to draw")
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(PLOT_EXTRA_HINT) from None

    origin = events[0].time
    times, sizes = world_size_steps(events)
    figure, axes = plt.subplots(figsize=(11, 4.2), dpi=120)
    try:
        top = max(sizes + [1]) * 1.35
        for span in round_spans(events):
            axes.axvspan(span.start - origin, span.end - origin, color=_ROUND_SHADES[span.round % 2], zorder=0)
            axes.text(
                span.start - origin,
                top * 0.97,
                f" round {span.round}\n {span.reason}",
                va="top",
                fontsize=7,
                color="#333333",
            )
        axes.step([t - origin for t in times], sizes, where="post", color="#1f77b4", linewidth=2, label="world size")
        for index, mark in enumerate(marks(events)):
            marker, colour = MARKS[mark.event]
            at = _size_at(times, sizes, mark.time)
            axes.scatter([mark.time - origin], [at], marker=marker, color=colour, s=60, zorder=3)
            axes.annotate(
                mark.label,
                (mark.time - origin, at),
                xytext=(4, 8 + 10 * (index % 3)),
                textcoords="offset points",
                fontsize=7,
                color=colour,
            )
        axes.set_ylim(0, top)
        axes.set_xlim(0, max(times[-1] - origin, 1e-3))
        axes.set_xlabel("seconds since the first event")
        axes.set_ylabel("world size (workers)")
        axes.set_title(title, fontsize=10)
        figure.tight_layout()
        figure.savefig(path)
    finally:
        plt.close(figure)


def _size_at(times: list[float], sizes: list[int], when: float) -> int:
    current = 0
    for time, size in zip(times, sizes):
        if time > when:
            break
        current = size
    return current
