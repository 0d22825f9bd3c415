"""Warm workers: a pre-started interpreter becomes `python script.py args`, or is passed over for a cold start."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from launcher.workers.process_tree import child_pids
from launcher.workers.warm_interpreter import IDLE_NAME, torch_imports
from launcher.workers.warm_pool import WarmPool

pytestmark = pytest.mark.timeout(60)

SCRIPT = """\
import json, os, sys
ours = sorted(m for m in sys.modules if m.startswith("launcher"))
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "file": __file__, "name": __name__,
                  "torch": "torch" in sys.modules, "launcher": ours, "mode": os.environ["MODE"]}))
print("to stderr", file=sys.stderr)
if os.environ["MODE"] == "raise":
    raise ValueError("bad batch")
if os.environ["MODE"] == "interrupt":
    raise KeyboardInterrupt
sys.exit(int(os.environ["MODE"]))
"""


@pytest.fixture
def pool():
    warm = WarmPool(dict(os.environ, WARM_TEST="1"), nproc=1, argv=["train.py", "--lr", "0.1"])
    warm.fill()
    yield warm
    warm.close()


def launch(pool: WarmPool, tmp_path, mode: str) -> tuple[int, str, str]:
    script = tmp_path / "job" / "train.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text(SCRIPT)
    warm = pool.take(0, pool.env)
    assert warm is not None
    out, err = open(tmp_path / "out", "wb"), open(tmp_path / "err", "wb")
    with out, err:
        env = dict(pool.env, MODE=mode)
        assert warm.launch(env, [str(script), "--lr", "0.1"], out.fileno(), err.fileno())
    code = warm.process.wait(timeout=30)
    return code, (tmp_path / "out").read_text(), (tmp_path / "err").read_text()


def test_the_script_runs_as_python_would_run_it(pool, tmp_path):
    code, out, err = launch(pool, tmp_path, "0")
    seen = json.loads(out)
    script = tmp_path / "job" / "train.py"
    assert code == 0 and err == "to stderr\n"
    assert seen == {
        "argv": [str(script), "--lr", "0.1"],
        "path0": str(script.parent),
        "file": str(script),
        "name": "__main__",
        "torch": True,
        "launcher": [],
        "mode": "0",
    }


def test_exit_code_and_uncaught_exception_are_the_scripts(pool, tmp_path):
    assert launch(pool, tmp_path, "7")[0] == 7
    pool.fill()
    code, _, err = launch(pool, tmp_path, "raise")
    assert code == 1
    assert err.startswith("to stderr\nTraceback (most recent call last):\n") and "ValueError: bad batch" in err
    assert "warm_interpreter" not in err, "the traceback starts at the script, as a cold worker's does"
    pool.fill()
    code, _, err = launch(pool, tmp_path, "interrupt")
    assert code == -signal.SIGINT and "KeyboardInterrupt" in err, "Python dies by SIGINT on an uncaught Ctrl-C"


def test_a_different_environment_or_a_dead_interpreter_means_a_cold_start(pool):
    assert pool.take(0, dict(pool.env, OMP_NUM_THREADS="7")) is None, "OpenMP read the old value at import"
    assert pool.take(0, pool.env) is None, "passed over: nothing left for this rank until the next fill"
    pool.fill()
    warm = pool.take(0, pool.env)
    os.kill(warm.process.pid, signal.SIGKILL)
    warm.process.wait(timeout=10)
    pool._workers[0] = warm  # as if it had died while waiting in the pool
    assert pool.take(0, pool.env) is None


def test_waiting_interpreters_are_not_taken_for_workers_from_their_start_to_their_launch(pool, tmp_path):
    supervisor = pool._workers[0].process.pid

    def taken_for_a_worker() -> bool:  # this process may have other children: only the pool's are looked at
        return bool({supervisor, *_children(supervisor)} & set(child_pids(os.getpid())))

    assert not taken_for_a_worker(), "just started: not yet named, still a spare"
    deadline = time.monotonic() + 20
    while not any(Path(f"/proc/{p}/comm").read_text().strip() == IDLE_NAME for p in _children(supervisor)):
        assert time.monotonic() < deadline, "the interpreter names itself as waiting"
        time.sleep(0.05)
    assert not taken_for_a_worker()
    script = tmp_path / "sleeper.py"
    script.write_text("import socket, time\nkeep = [socket.socket() for _ in range(8)]\ntime.sleep(30)\n")
    warm = pool.take(0, pool.env)
    assert warm is not None and warm.launch(pool.env, [str(script)], 1, 2)
    try:
        while not taken_for_a_worker():
            assert time.monotonic() < deadline, "a launched interpreter is a worker, its control socket's number reused"
            time.sleep(0.05)
        assert _children(supervisor)[0] in child_pids(os.getpid()), "the worker itself, seen through its supervisor"
    finally:
        warm.process.kill()
        warm.process.wait(timeout=10)


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_closing_the_pool_ends_idle_interpreters():
    pool = WarmPool(dict(os.environ), nproc=2, argv=["train.py"])
    pool.fill()
    processes = [w.process for w in pool._workers.values()]
    pool.close()
    assert all(p.poll() is not None for p in processes)


def test_a_pool_is_ready_once_every_interpreter_imported_torch_or_exited():
    pool = WarmPool(dict(os.environ), nproc=2, argv=["train.py"])
    pool.fill()
    try:
        assert not pool.wait_ready(30, interrupted=lambda: True), "interrupted (a signal) before they are ready"
        assert pool._workers[0].still_importing(), "torch takes a second or more to import"
        importing = pool._workers[1].process
        started = time.monotonic()
        assert pool.wait_ready(60, interrupted=lambda: False)
        assert importing.poll() is None, "ready and waiting for its round"
        assert not any(warm.still_importing() for warm in pool._workers.values())
        print(f"\ntwo warm interpreters ready in {time.monotonic() - started:.1f}s")
    finally:
        pool.close()
    dead = WarmPool(dict(os.environ), nproc=1, argv=["train.py"])
    dead.fill()
    try:
        dead._workers[0].process.kill()
        dead._workers[0].process.wait()
        assert not dead._workers[0].still_importing(), "an interpreter that exited imports nothing more"
        started = time.monotonic()
        assert dead.wait_ready(30, interrupted=lambda: False), "an interpreter that exited is nothing to wait for"
        assert time.monotonic() - started < 2, "its socket closed: not waited for until it would have imported"
    finally:
        dead.close()


def test_a_launch_sent_before_the_interpreter_finished_importing_still_runs(tmp_path):
    """The agent hands a round over and closes its end while the interpreter still imports: its READY then
    finds nobody to read it, and the launch waiting in the socket must run all the same."""
    pool = WarmPool(dict(os.environ, WARM_TEST="1"), nproc=1, argv=["train.py"])
    pool.fill()
    try:
        code, out, _ = launch(pool, tmp_path, "0")  # at once: torch is far from imported yet
        assert code == 0 and json.loads(out)["argv"][1:] == ["--lr", "0.1"]
    finally:
        pool.close()


def test_an_interpreter_preloads_the_torch_modules_its_script_imports(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import os, torch\nimport torch.distributed as dist\nfrom torch.distributed.fsdp import fully_shard\n"
        "from . import sibling\nimport numpy\ntry:\n    import torch.distributed.checkpoint\nexcept ImportError:\n"
        "    pass\ndef main():\n    import torch.utils.data\n"
    )
    assert torch_imports(str(script)) == [
        "torch",
        "torch.distributed",
        "torch.distributed.fsdp",
        "torch.distributed.checkpoint",
        "torch._dynamo",  # what fully_shard imports on its first call
    ]
    script.write_text("import torch\ndef broken(:\n")
    assert torch_imports(str(script)) == [] and torch_imports(str(tmp_path / "missing.py")) == []
