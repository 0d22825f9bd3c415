"""Every thread's current frame, as `sys._current_frames()` gives it, without CPython 3.11's deadlock.

On 3.11 `sys._current_frames()` holds the runtime's thread-list lock while it allocates the frame objects. An
allocation may start a garbage collection, and freeing a `threading.local` found in a cycle takes that same lock:
the calling thread then waits on itself forever, and with it every thread that starts, ends or touches a
`threading.local` (CPython gh-106883, fixed from 3.12 on by disabling the collector during the call; the 3.11
backport was not merged). The collector is off for the call here too, and back on afterwards only if it was on.
"""

from __future__ import annotations

import gc
import sys
from types import FrameType


def current_frames() -> dict[int, FrameType]:
    """Thread id -> that thread's innermost frame."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return sys._current_frames()
    finally:
        if enabled:
            gc.enable()
