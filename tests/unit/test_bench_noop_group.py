"""The rendezvous bench's stand-in for a node's workers (bench/rendezvous_host.NoopWorkerGroup) answers everything
the agent asks of a real WorkerGroup: an agent whose round asked for a drain once crashed on the missing method,
and every simulated agent of that round with it."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from rendezvous_host import NoopWorkerGroup  # noqa: E402 - bench/ is not a package

from launcher.rendezvous.records import DrainReport  # noqa: E402

pytestmark = pytest.mark.timeout(30)


def asked_of_a_group() -> set[str]:
    """Every attribute the agent's code reads on its worker groups (the round's, and the one kept from the last)."""
    asked = set()
    for module in ("launcher/node/round_workers.py", "launcher/node/agent.py"):
        source = (ROOT / module).read_text()
        asked |= set(re.findall(r"(?:self\.group|self\.retired|\bgroup)\.(\w+)", source))
    return asked


class SilentHost:
    def note(self, kind: str, round_: int | None, when: float) -> None:
        pass


def noop_group() -> NoopWorkerGroup:
    return NoopWorkerGroup(SilentHost(), None, SimpleNamespace(round=0), None, None)


def test_the_noop_group_answers_everything_the_agent_asks_of_a_worker_group():
    asked = asked_of_a_group()
    assert {"poll", "request_drain", "drain_answer", "started_inprocess"} <= asked  # the search finds the uses
    group = noop_group()
    missing = sorted(name for name in asked if not hasattr(group, name))
    assert not missing, f"NoopWorkerGroup lacks {missing}"


def test_no_op_workers_answer_a_drain_at_once_with_nothing_drained():
    group = noop_group()
    group.request_drain(3, in_memory=True)
    assert group.drain_answer(3) == DrainReport(number=3, step=None)
    assert group.why_no_drain() is None
    assert not group.trains_under_elastic_run()
