"""elastic.thread_frames.current_frames: other threads' frames without CPython 3.11's deadlock (gh-106883), which a
collection during `sys._current_frames()` that frees a `threading.local` in a cycle runs into."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading

import pytest

from elastic.thread_frames import current_frames

pytestmark = pytest.mark.timeout(60)

# threads to list, and cyclic threading.local garbage waiting for the collector each time the frames are read
PROGRAM = textwrap.dedent(
    """
    import gc, sys, threading, time
    from elastic.thread_frames import current_frames



    def read():  # a frame of its own, whose frame object the read allocates, as any caller's
        return current_frames() if sys.argv[1] == "current_frames" else sys._current_frames()

    stop = threading.Event()

    def busy():  # new Python frames all the time: reading them allocates frame objects
        while not stop.is_set():
            time.sleep(0.01)

    threads = [threading.Thread(target=busy, daemon=True) for _ in range(8)]
    for thread in threads:
        thread.start()
    gc.set_threshold(1, 1, 1)  # a collection at almost every allocation
    for _ in range(20):
        gc.disable()
        for _ in range(5):
            local = threading.local()
            local.cycle = [local]  # freed only by the collector, and freeing it takes the runtime's thread lock
            del local
        gc.enable()
        frames = read()
        assert threading.main_thread().ident in frames
    stop.set()
    print("read them all")
    """
)


def _read_frames_in_a_child(reader: str, timeout_s: float) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(
            [sys.executable, "-c", PROGRAM, reader], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return None  # the child hung; subprocess.run killed it


def test_frames_are_read_while_the_collector_frees_thread_locals():
    done = _read_frames_in_a_child("current_frames", timeout_s=20)
    assert done is not None, "current_frames hung"
    assert done.returncode == 0 and "read them all" in done.stdout, done.stderr


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="CPython 3.12 disables the collector in the call itself")
def test_the_same_reads_through_sys_current_frames_hang_on_3_11():
    # why current_frames exists: if this starts passing, CPython fixed it and the wrapper can go
    assert _read_frames_in_a_child("sys", timeout_s=4) is None  # it hangs at the first reads: 0.1 s when it does not


def test_the_collector_is_left_as_it_was():
    assert gc.isenabled()
    frames = current_frames()
    assert threading.get_ident() in frames and gc.isenabled()
    gc.disable()
    try:
        current_frames()
        assert not gc.isenabled()
    finally:
        gc.enable()
