"""A deadline on the agent's exit: once its loop has decided how it ends, the rest (stopping workers and the
zygote, ending its threads, closing the etcd client, the atexit functions) must be over within
`stop_s + EXIT_MARGIN_S`. Past that the agent writes every thread's stack to its stderr, the evidence of what held
it, and exits with the status it had decided: a job that is over never waits on its agents.

The interpreter's own teardown, after the atexit functions, is skipped: the process ends with the decided status
as soon as its logs are flushed. That teardown stops the daemon threads wherever they are, the etcd client's grpc
threads among them, then finalises what is left; in one CI run an agent whose job had finished hung there for good,
a grpc call's finaliser waiting on a lock that a stopped thread held."""

from __future__ import annotations

import atexit
import faulthandler
import logging
import os
import sys
import threading
import time

EXIT_MARGIN_S = 30.0  # beyond the workers' own stop grace: ample for everything else the exit does


def arm(status: int, stop_s: float, margin_s: float = EXIT_MARGIN_S) -> None:
    """From now on this process exits with `status` within `stop_s + margin_s`, however it is held, and without
    the interpreter's teardown."""
    limit = stop_s + margin_s

    def expire() -> None:
        time.sleep(limit)
        print(
            f"elastic-run: the agent's exit took over {limit:g}s; the stacks of its threads follow, then it exits "
            f"with status {status}",
            file=sys.stderr,
            flush=True,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os._exit(status)

    threading.Thread(target=expire, name="exit-deadline", daemon=True).start()
    # atexit runs its functions last registered first: the ones registered before this (logging's) are done here
    atexit.register(_exit_before_teardown, status)


def _exit_before_teardown(status: int) -> None:
    try:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:  # a console gone (a closed pipe) must not leave the exit to the teardown
        os._exit(status)
