"""A deadline on the agent's exit: once its loop has decided how it ends, the rest (stopping workers and the
zygote, ending its threads, closing the etcd client, the interpreter's own shutdown) must be over within
`stop_s + EXIT_MARGIN_S`. Past that the agent writes every thread's stack to its stderr, the evidence of what held
it, and exits with the status it had decided: a job that is over never waits on its agents. An exit held in the
interpreter's own teardown, where no Python thread runs any more, ends BACKSTOP_S later, with status 1."""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time

EXIT_MARGIN_S = 30.0  # beyond the workers' own stop grace: ample for everything else the exit does
# Once its atexit functions ran, the interpreter stops running daemon threads, this deadline's among them, and what
# it tears down then (a C library's state, an object's finaliser) can hold the exit too: faulthandler's watchdog,
# a C thread, still writes the stacks and ends the process this much later, with status 1 (it can give no other).
BACKSTOP_S = 5.0


def arm(status: int, stop_s: float, margin_s: float = EXIT_MARGIN_S) -> None:
    """From now on this process exits with `status` within `stop_s + margin_s`, however it is held."""
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
    faulthandler.dump_traceback_later(limit + BACKSTOP_S, exit=True, file=sys.stderr)
