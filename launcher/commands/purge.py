"""`elastic-run purge`: delete a finished job's keys from etcd; a running job is refused."""

from __future__ import annotations

import argparse
import os
import sys

from launcher.config import add_rdzv_conf_flag, security_from_rdzv_conf
from launcher.etcd import client as etcd_client
from launcher.rendezvous.protocol import JobStore


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elastic-run purge", description="Delete every etcd key of a job that has finished or failed."
    )
    parser.add_argument("--rdzv-endpoint", "--rdzv_endpoint", required=True, help="etcd host:port of the job")
    add_rdzv_conf_flag(parser)
    parser.add_argument("--rdzv-id", "--rdzv_id", required=True, help="the job id")
    parser.add_argument(
        "--force",
        action="store_true",
        help="also purge a job without a final status whose agents are all gone (a crashed job)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        client = etcd_client.connect_reachable(args.rdzv_endpoint, security_from_rdzv_conf(args.rdzv_conf, os.environ))
    except (ValueError, etcd_client.EtcdUnreachable) as exc:
        print(f"elastic-run purge: error: {exc}", file=sys.stderr)
        return 1
    store = JobStore(client, args.rdzv_id)
    try:
        if store.key_count() == 0:
            print(
                f"elastic-run purge: error: no job {args.rdzv_id!r} at {args.rdzv_endpoint} (check --rdzv-id)",
                file=sys.stderr,
            )
            return 1
        status = store.read_status()
        live = store.live_nodes()
        if status is None and (live or not args.force):
            why = f"{live} agent(s) still registered" if live else "it has no final status"
            print(
                f"elastic-run purge: error: job {args.rdzv_id!r} is running ({why}); stop it first, or pass "
                "--force once every agent is gone",
                file=sys.stderr,
            )
            return 1
        count = store.purge()
        state = status.state if status is not None else "abandoned"
        print(f"purged job {args.rdzv_id!r} ({state}): {count} key(s) deleted")
        return 0
    finally:
        client.close()
