"""Warm workers: a fork of the node's zygote becomes `python script.py args`, or is passed over for a cold start."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from launcher.workers.process_tree import child_pids
from launcher.workers.warm_interpreter import torch_imports
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
    code, _, err = launch(pool, tmp_path, "raise")
    assert code == 1
    assert err.startswith("to stderr\nTraceback (most recent call last):\n") and "ValueError: bad batch" in err
    assert "warm_interpreter" not in err, "the traceback starts at the script, as a cold worker's does"
    code, _, err = launch(pool, tmp_path, "interrupt")
    assert code == -signal.SIGINT and "KeyboardInterrupt" in err, "Python dies by SIGINT on an uncaught Ctrl-C"


def test_a_different_environment_means_a_cold_start_and_a_dead_worker_a_new_fork(pool):
    assert pool.take(0, dict(pool.env, OMP_NUM_THREADS="7")) is None, "OpenMP read the old value at import"
    warm = pool.take(0, pool.env)
    assert warm is not None, "forked on demand: the pool had none left for this rank"
    os.kill(warm.process.pid, signal.SIGKILL)
    assert warm.process.wait(timeout=10) == -signal.SIGKILL, "its exit code, as the zygote reaped it"
    pool._workers[0] = warm  # as if it had died while waiting in the pool
    fresh = pool.take(0, pool.env)
    assert fresh is not None and fresh.process.pid != warm.process.pid
    fresh.close()


def test_warm_workers_are_forks_of_one_zygote_and_start_with_fresh_seeds(tmp_path):
    """Two ranks' warm workers come from the one interpreter that imported torch; each has its own random
    state, as two fresh interpreters would (numpy's global generator is not reseeded by fork itself); the
    objects of torch's import are frozen (gc.freeze), out of the collector's way."""
    pool = WarmPool(dict(os.environ), nproc=2, argv=["train.py"])
    try:
        assert pool.wait_ready(60, interrupted=lambda: False) and pool.fill()
        zygote = pool._zygote.process.pid
        supervisors = [pool._workers[r].process.pid for r in range(2)]
        assert set(supervisors) <= set(_children(zygote)), "forked by the zygote, not started by the agent"
        script = tmp_path / "seeds.py"
        script.write_text(
            "import gc, random, numpy\nprint(random.random(), numpy.random.rand(), gc.get_freeze_count())\n"
        )
        seen = []
        for local_rank in range(2):
            out = tmp_path / f"out{local_rank}"
            with open(out, "wb") as file:
                assert pool.take(local_rank, pool.env).launch(dict(os.environ), [str(script)], file.fileno(), 2)
            seen.append(out)
        for supervisor in supervisors:
            assert _wait_gone(supervisor, zygote)
        first, second = (out.read_text().split() for out in seen)
        assert first[0] != second[0] and first[1] != second[1], (first, second)
        assert int(first[2]) > 10_000, "what the zygote imported is frozen: a collection in the worker skips it"
    finally:
        pool.close()


def _wait_gone(pid: int, parent: int) -> bool:
    deadline = time.monotonic() + 30
    while pid in _children(parent):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_waiting_workers_are_not_taken_for_workers_from_their_fork_to_their_launch(pool, tmp_path):
    assert pool.wait_ready(60, interrupted=lambda: False) and pool.fill()
    supervisor = pool._workers[0].process.pid

    def taken_for_a_worker() -> bool:  # this process may have other children: only the pool's are looked at
        return bool({supervisor, *_children(supervisor)} & set(child_pids(os.getpid())))

    assert not taken_for_a_worker(), "forked and waiting: a spare"
    assert pool._zygote.process.pid not in child_pids(os.getpid()), "the zygote is never a worker"
    script = tmp_path / "sleeper.py"
    script.write_text("import socket, time\nkeep = [socket.socket() for _ in range(8)]\ntime.sleep(30)\n")
    warm = pool.take(0, pool.env)
    assert warm is not None and warm.launch(pool.env, [str(script)], 1, 2)
    deadline = time.monotonic() + 20
    try:
        while not taken_for_a_worker():
            assert time.monotonic() < deadline, "a launched worker is a worker"
            time.sleep(0.05)
        assert _children(supervisor)[0] in child_pids(os.getpid()), "the worker itself, seen through its supervisor"
    finally:
        os.killpg(supervisor, signal.SIGKILL)
        warm.process.wait(timeout=10)


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def test_closing_the_pool_ends_the_zygote_and_its_waiting_workers():
    pool = WarmPool(dict(os.environ), nproc=2, argv=["train.py"])
    assert pool.wait_ready(60, interrupted=lambda: False) and pool.fill()
    processes = [w.process for w in pool._workers.values()]
    zygote = pool._zygote.process
    pool.close()
    assert zygote.poll() is not None
    assert all(p.wait(timeout=10) is not None for p in processes)


def test_a_pool_is_ready_once_the_zygote_imported_torch_and_a_zygote_that_died_is_replaced():
    pool = WarmPool(dict(os.environ), nproc=2, argv=["train.py"])
    try:
        assert not pool.fill(), "the zygote is still importing: nothing to fork yet"
        assert not pool.wait_ready(30, interrupted=lambda: True), "interrupted (a signal) before it is ready"
        started = time.monotonic()
        assert pool.wait_ready(60, interrupted=lambda: False)
        print(f"\nzygote ready in {time.monotonic() - started:.1f}s")
        assert pool.fill()
        waiting = pool._workers[0].process
        pool._zygote.process.kill()
        pool._zygote.process.wait()
        assert waiting.wait(timeout=10) == -signal.SIGKILL, "its workers die with it"
        assert pool.wait_ready(60, interrupted=lambda: False), "a zygote that was ready and died is started again"
        assert pool.fill()
    finally:
        pool.close()
    broken = WarmPool(dict(os.environ, PYTHONPATH="/nonexistent", PYTHONHOME="/nonexistent"), 1, ["train.py"])
    try:
        started = time.monotonic()
        assert not broken.wait_ready(30, interrupted=lambda: False), "a zygote that cannot start is not waited for"
        assert time.monotonic() - started < 10
        assert broken.take(0, broken.env) is None, "its ranks start cold"
    finally:
        broken.close()


def test_a_rank_taken_while_the_zygote_imports_waits_for_it_and_runs(tmp_path):
    """The round starts while the zygote still imports torch: the rank waits for it rather than importing
    torch a second time in a cold interpreter."""
    pool = WarmPool(dict(os.environ, WARM_TEST="1"), nproc=1, argv=["train.py"])
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


def test_a_round_store_forked_from_the_zygote_serves_until_the_round_closes_it():
    """Group rank 0's agent serves the round's TCPStore from a fork of its zygote, listening before any worker
    starts (a worker connecting before rank 0 listened waited out torch's half-second back-off)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    pool = WarmPool(dict(os.environ), nproc=1, argv=["train.py"])
    try:
        assert pool.serve_store("127.0.0.1", 2) is None, "the zygote still imports: rank 0 serves the store"
        assert pool.wait_ready(60, interrupted=lambda: False)
        store = pool.serve_store("127.0.0.1", 2)
        assert store is not None and store.process.pid in _children(pool._zygote.process.pid)
        assert store.process.pid not in child_pids(os.getpid()), "the store is no worker"
        client = TCPStore("127.0.0.1", store.port, 2, False, timedelta(seconds=10))
        client.set("round", "1")
        assert TCPStore("127.0.0.1", store.port, 2, False, timedelta(seconds=10)).get("round") == b"1"
        store.close()
        assert store.process.wait(timeout=10) == 0
    finally:
        pool.close()
