"""examples/train.py whose workers take their time to exit on SIGTERM, as a user's cleanup may (flushing a
tracker, uploading artifacts): each appends its pid and the time the signal came to $SLOW_EXIT_MARK, then waits
until the agent's grace period (--worker-stop-timeout) ends in a SIGKILL."""

import os
import runpy
import signal
import time
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[2] / "examples" / "train.py"


def exit_slowly(signum: int, frame) -> None:
    with open(os.environ["SLOW_EXIT_MARK"], "a") as mark:
        mark.write(f"{os.getpid()} {time.time()}\n")
    time.sleep(300)


signal.signal(signal.SIGTERM, exit_slowly)
runpy.run_path(str(TRAIN), run_name="__main__")
