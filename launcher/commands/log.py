"""`elastic-run log`: a job's membership log from etcd (or a membership.jsonl), as a table, JSON lines, followed
live, or drawn."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from launcher.commands import timeline
from launcher.config import add_rdzv_conf_flag, security_from_rdzv_conf
from launcher.etcd import client as etcd_client
from launcher.rendezvous import membership_log
from launcher.rendezvous.protocol import JobStore
from launcher.rendezvous.records import TERMINAL_EVENTS, MembershipEvent

_ETCD_DEADLINE_S = 30.0  # how long a read waits for etcd to answer before the command gives up


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elastic-run log", description="Show a job's membership log.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--rdzv-endpoint", "--rdzv_endpoint", help="etcd host:port of the job")
    source.add_argument("--file", type=Path, help="a membership.jsonl from an agent's --log-dir instead of etcd")
    add_rdzv_conf_flag(parser)
    parser.add_argument("--rdzv-id", "--rdzv_id", help="the job id (required with --rdzv-endpoint)")
    parser.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    parser.add_argument("--follow", "-f", action="store_true", help="keep printing events as they arrive")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between polls with --follow")
    parser.add_argument(
        "--plot",
        type=Path,
        metavar="timeline.png",
        help="draw the log instead of printing it: world size over time, rounds shaded, events "
        "marked (png, svg or pdf by the extension; needs the plot extra, matplotlib)",
    )
    return parser


def _print(events: list[MembershipEvent], as_json: bool, header: bool) -> None:
    if not events:
        return
    if as_json:
        text = "\n".join(e.dumps() for e in events)
    else:
        text = membership_log.format_table(events, header=header)
    print(text, flush=True)


def _plot(events: list[MembershipEvent], path: Path, title: str) -> int:
    try:
        timeline.draw(events, title, path)
    except ImportError as exc:
        print(f"elastic-run log: error: {exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"elastic-run log: error: cannot plot to {path}: {exc}", file=sys.stderr)
        return 1
    rounds = len(timeline.round_spans(events))
    nodes = len({e.node for e in events if e.node} | {m["node"] for e in events for m in e.members or ()})
    print(f"wrote {path}: {len(events)} events, {rounds} rounds, {nodes} nodes")
    return 0


def _from_file(path: Path, args: argparse.Namespace) -> int:
    if not path.is_file():
        print(f"elastic-run log: error: no membership log at {path}", file=sys.stderr)
        return 2
    if args.plot is not None:
        events = [MembershipEvent.model_validate_json(line) for line in path.read_text().splitlines() if line.strip()]
        return _plot(events, args.plot, f"membership log {path}")
    offset, header = 0, True
    while True:
        with open(path) as file:
            file.seek(offset)
            chunk = file.read()
            offset = file.tell()
        events = [MembershipEvent.model_validate_json(line) for line in chunk.splitlines() if line.strip()]
        _print(events, args.json, header)
        header = header and not events
        if not args.follow or any(e.event in TERMINAL_EVENTS for e in events):
            return 0
        time.sleep(args.interval)


def _from_etcd(args: argparse.Namespace) -> int:
    if not args.rdzv_id:
        print("elastic-run log: error: --rdzv-id is required with --rdzv-endpoint", file=sys.stderr)
        return 2
    try:
        client = etcd_client.connect_reachable(args.rdzv_endpoint, security_from_rdzv_conf(args.rdzv_conf, os.environ))
    except (ValueError, etcd_client.EtcdUnreachable) as exc:
        print(f"elastic-run log: error: {exc}", file=sys.stderr)
        return 1
    store, seen, header = JobStore(client, args.rdzv_id), 0, True
    try:
        events = store.read_events(deadline_s=_ETCD_DEADLINE_S)
        if not events and not args.follow:
            print(
                f"elastic-run log: error: no events for job {args.rdzv_id!r} at {args.rdzv_endpoint} (check --rdzv-id)",
                file=sys.stderr,
            )
            return 1
        if args.plot is not None:
            return _plot(events, args.plot, f"job {args.rdzv_id} ({args.rdzv_endpoint})")
        while True:
            _print(events, args.json, header)
            if events:
                header, seen = False, events[-1].revision or seen
            if not args.follow or any(e.event in TERMINAL_EVENTS for e in events):
                return 0
            time.sleep(args.interval)
            events = store.read_events(seen, deadline_s=_ETCD_DEADLINE_S)
    except KeyboardInterrupt:
        return 130
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.plot is not None and (args.follow or args.json):
        parser.error("--plot draws the log once: drop --follow and --json")
    if args.file is not None:
        return _from_file(args.file, args)
    return _from_etcd(args)
