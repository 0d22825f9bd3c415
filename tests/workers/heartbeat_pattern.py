"""A worker without torch for the watchdog's tests: heartbeats in a pattern, then pauses one way or another.

    --beats N --interval S     N heartbeats (steps 0..N-1), S seconds apart
    --then sleep|long-op|stop  afterwards: sleep --pause seconds silently, inside elastic.long_operation, or
                               SIGSTOP itself (a hung process)
    --then stop-then-raise     SIGSTOP itself; once continued, write its error file as torch's @record does for
                               an uncaught exception and sleep --pause seconds (a teardown that hangs)
    --no-heartbeat             sleep --interval between --beats steps and never call heartbeat
    --fork                     fork a child first that calls heartbeat in a loop (a DataLoader worker must not count)

It prints `step N` to stdout per step and `done` before it exits 0.
"""

import argparse
import json
import os
import signal
import sys
import time

import elastic


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--beats", type=int, default=3)
    parser.add_argument("--interval", type=float, default=0.05)
    parser.add_argument("--then", choices=["sleep", "long-op", "stop", "stop-then-raise", "exit"], default="exit")
    parser.add_argument("--pause", type=float, default=3.0)
    parser.add_argument("--op-timeout", type=float, default=None)
    parser.add_argument("--no-heartbeat", action="store_true")
    parser.add_argument("--fork", action="store_true")
    args = parser.parse_args()
    parent = os.getpid()
    if args.fork and os.fork() == 0:
        while os.getppid() == parent:  # a forked child heartbeating while the worker lives: its calls are no-ops
            elastic.heartbeat(10**6)
            time.sleep(0.01)
        os._exit(0)
    for step in range(args.beats):
        if not args.no_heartbeat:
            elastic.heartbeat(step)
        print(f"step {step}", flush=True)
        time.sleep(args.interval)
    if args.then == "sleep":
        time.sleep(args.pause)
    elif args.then == "long-op":
        with elastic.long_operation("checkpoint load", timeout=args.op_timeout):
            time.sleep(args.pause)
        elastic.heartbeat(args.beats)
    elif args.then == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif args.then == "stop-then-raise":
        os.kill(os.getpid(), signal.SIGSTOP)
        with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as error_file:
            json.dump({"message": "RuntimeError: Connection closed by peer"}, error_file)
        time.sleep(args.pause)
    print("done", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
