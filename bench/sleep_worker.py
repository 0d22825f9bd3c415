"""A worker that does nothing: says it started (a file in --ready-dir), then sleeps. For bench/idle_cost.py."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=600.0, help="how long to sleep (default 600)")
    parser.add_argument("--ready-dir", default=None, help="write <rank>.<pid> here once started")
    args = parser.parse_args()
    if args.ready_dir:
        Path(args.ready_dir).mkdir(parents=True, exist_ok=True)
        Path(args.ready_dir, f"{os.environ.get('RANK', '?')}.{os.getpid()}").write_text(
            f"round={os.environ.get('ELASTIC_ROUND', '?')} world_size={os.environ.get('WORLD_SIZE', '?')}\n"
        )
    time.sleep(args.seconds)


if __name__ == "__main__":
    main()
