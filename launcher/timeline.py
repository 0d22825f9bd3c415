"""A job's membership log as a timeline picture (SVG): one lane per node, its rounds as bars, its events as marks.

What `elastic-run log --plot FILE.svg` writes. A pure function of the events: no plotting library, so the
picture can be made wherever the log can be read, and opened in any browser.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from html import escape

from launcher.membership_log import MembershipEvent

_LANE_H = 28
_TOP = 70
_LEFT = 150
_RIGHT = 30
_WIDTH = 1100
_ROUND_COLOURS = ("#9ecae1", "#c6dbef")  # alternate, so adjacent rounds stay apart
# event -> (mark, colour, what the legend says)
MARKS = {
    "node_joined": ("triangle", "#2ca02c", "joined"),
    "node_left": ("square", "#7f7f7f", "left"),
    "node_lost": ("circle", "#000000", "lost"),
    "controller_lost": ("circle", "#8c564b", "controller lost"),
    "worker_failed": ("cross", "#d62728", "worker failed"),
    "worker_hung": ("cross", "#ff7f0e", "worker hung"),
    "node_quarantined": ("square", "#9467bd", "quarantined"),
    "drain_committed": ("diamond", "#17becf", "drained (checkpoint)"),
}


@dataclass(frozen=True)
class RoundSpan:
    round: int
    start: float
    end: float
    world_size: int
    reason: str
    nodes: tuple[str, ...]


def round_spans(events: list[MembershipEvent]) -> list[RoundSpan]:
    """Each round from its round_started to the next one's, or to the job's end (or the last event)."""
    starts = [e for e in events if e.event == "round_started"]
    end_of_log = max((e.time for e in events), default=0.0)
    spans = []
    for index, event in enumerate(starts):
        end = starts[index + 1].time if index + 1 < len(starts) else end_of_log
        nodes = tuple(member["node"] for member in event.members or ())
        spans.append(RoundSpan(event.round or 0, event.time, end, event.world_size or 0, event.reason or "", nodes))
    return spans


def render_svg(events: list[MembershipEvent], title: str) -> str:
    """The timeline of `events` (log order) as a standalone SVG document."""
    if not events:
        raise ValueError("no events to draw")
    origin = events[0].time
    length = max(events[-1].time - origin, 1e-3)
    nodes = _nodes_in_order(events)
    lane = {node: index for index, node in enumerate(nodes)}
    height = _TOP + _LANE_H * len(nodes) + 90
    scale = (_WIDTH - _LEFT - _RIGHT) / length

    def x(when: float) -> float:
        return _LEFT + (when - origin) * scale

    def y(node: str) -> float:
        return _TOP + lane[node] * _LANE_H

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{height}" font-family="sans-serif" '
        f'font-size="11">',
        '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="{_LEFT}" y="20" font-size="14" font-weight="bold">{escape(title)}</text>',
        f'<text x="{_LEFT}" y="36" fill="#555">from {datetime.fromtimestamp(origin):%Y-%m-%d %H:%M:%S}, '
        f'{length:.1f} s, {len(nodes)} node(s)</text>',
    ]
    for node in nodes:
        parts.append(f'<text x="{_LEFT - 8}" y="{y(node) + _LANE_H / 2 + 4:.1f}" text-anchor="end">{escape(node)}</text>')
    for span in round_spans(events):
        colour = _ROUND_COLOURS[span.round % 2]
        width = max(x(span.end) - x(span.start), 1.0)
        for node in span.nodes:
            if node in lane:
                parts.append(f'<rect class="round" data-round="{span.round}" x="{x(span.start):.1f}" '
                             f'y="{y(node) + 4}" width="{width:.1f}" height="{_LANE_H - 8}" fill="{colour}">'
                             f'<title>round {span.round}: world {span.world_size} ({escape(span.reason)})</title></rect>')
        parts.append(f'<line x1="{x(span.start):.1f}" y1="{_TOP - 14}" x2="{x(span.start):.1f}" '
                     f'y2="{_TOP + _LANE_H * len(nodes)}" stroke="#555" stroke-dasharray="3,3"/>')
        parts.append(f'<text x="{x(span.start) + 3:.1f}" y="{_TOP - 16}" fill="#333">r{span.round} w{span.world_size} '
                     f'{escape(span.reason)}</text>')
    for event in events:
        if event.event in MARKS and event.node in lane:
            parts.append(_mark(event, x(event.time), y(event.node) + _LANE_H / 2))
    parts += _axis(length, scale, _TOP + _LANE_H * len(nodes))
    parts += _legend(height - 28)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _nodes_in_order(events: list[MembershipEvent]) -> list[str]:
    seen: dict[str, None] = {}
    for event in events:
        for node in [event.node, *(m["node"] for m in event.members or ())]:
            if node:
                seen.setdefault(node, None)
    return list(seen)


def _mark(event: MembershipEvent, cx: float, cy: float) -> str:
    shape, colour, _ = MARKS[event.event]
    details = ", ".join(f"{k}={v}" for k, v in (("rank", event.rank), ("exit_code", event.exit_code),
                        ("step", getattr(event, "step", None)), ("reason", event.reason)) if v is not None)  # fmt: skip
    tip = f"<title>{escape(event.event)} {escape(event.node or '')} {escape(details)}</title>"
    attributes = f'class="event" data-event="{event.event}"'
    r = 5
    if shape == "circle":
        return f'<circle {attributes} cx="{cx:.1f}" cy="{cy:.1f}" r="{r}" fill="{colour}">{tip}</circle>'
    if shape == "square":
        return f'<rect {attributes} x="{cx - r:.1f}" y="{cy - r:.1f}" width="{2 * r}" height="{2 * r}" fill="{colour}">{tip}</rect>'
    if shape == "triangle":
        points = f"{cx:.1f},{cy - r:.1f} {cx - r:.1f},{cy + r:.1f} {cx + r:.1f},{cy + r:.1f}"
        return f'<polygon {attributes} points="{points}" fill="{colour}">{tip}</polygon>'
    if shape == "diamond":
        points = f"{cx:.1f},{cy - r:.1f} {cx + r:.1f},{cy:.1f} {cx:.1f},{cy + r:.1f} {cx - r:.1f},{cy:.1f}"
        return f'<polygon {attributes} points="{points}" fill="{colour}">{tip}</polygon>'
    cross = f"M{cx - r:.1f},{cy - r:.1f} L{cx + r:.1f},{cy + r:.1f} M{cx - r:.1f},{cy + r:.1f} L{cx + r:.1f},{cy - r:.1f}"
    return f'<path {attributes} d="{cross}" stroke="{colour}" stroke-width="2.5">{tip}</path>'


def _axis(length: float, scale: float, top: float) -> list[str]:
    step = next(s for s in (0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 1e9) if length / s <= 12)
    parts = [f'<line x1="{_LEFT}" y1="{top + 6}" x2="{_WIDTH - _RIGHT}" y2="{top + 6}" stroke="#333"/>']
    tick = 0.0
    while tick <= length + 1e-9:
        tx = _LEFT + tick * scale
        parts.append(f'<line x1="{tx:.1f}" y1="{top + 6}" x2="{tx:.1f}" y2="{top + 10}" stroke="#333"/>')
        parts.append(f'<text x="{tx:.1f}" y="{top + 22}" text-anchor="middle">{tick:g} s</text>')
        tick += step
    return parts


def _legend(top: float) -> list[str]:
    parts, left = [], _LEFT
    for event, (_, _, label) in MARKS.items():
        parts.append(_mark(MembershipEvent(event=event, time=0.0), left, top).replace('class="event"', 'class="legend"'))
        parts.append(f'<text x="{left + 9}" y="{top + 4}">{escape(label)}</text>')
        left += 30 + 6 * len(label)
    return parts
