"""A worker that starts `sleep MARKER` three ways, then waits (or exits with --exit-code).

- a plain child, in the worker's process group;
- a child that called setsid() (it left the worker's process group and session);
- a double-forked grandchild that also called setsid(): its parent exited, so it is an orphan.

Each sleep's argument is MARKER (e.g. 600.123456, unique per test) so a test finds them in /proc. When all three
run, the worker writes `{"pid": ..., "sleeps": [...]}` to DIR/rank<RANK>.json.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time


def double_fork_setsid(argv: list[str]) -> int:
    """Start `argv` as an orphaned grandchild in a session of its own; returns its pid."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.close(read_end)
            os.setsid()
            grandchild = os.fork()
            if grandchild == 0:
                os.execvp(argv[0], argv)
            os.write(write_end, str(grandchild).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        grandchild = int(pipe.read())
    os.waitpid(child, 0)
    return grandchild


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--marker", required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--exit-code", type=int, default=None, help="exit with this code once the sleeps run")
    parser.add_argument("--ignore-sigterm-rank", type=int, default=-1, help="this rank ignores SIGTERM")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    if rank == args.ignore_sigterm_rank:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the sleeps it starts ignore it too
    sleep = ["sleep", args.marker]
    plain = subprocess.Popen(sleep)
    own_session = subprocess.Popen(sleep, start_new_session=True)
    orphan = double_fork_setsid(sleep)
    sleeps = [plain.pid, own_session.pid, orphan]
    path = os.path.join(args.dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as out:
        json.dump({"pid": os.getpid(), "sleeps": sleeps}, out)
    os.replace(path + ".tmp", path)
    if args.exit_code is not None:
        sys.exit(args.exit_code)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
