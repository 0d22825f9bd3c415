"""Drains in the library: should_save answers elastic-run's request, the save commits, then waits at the boundary."""

from __future__ import annotations

import mmap
import threading
import time
from pathlib import Path

import pytest
from test_checkpoint_manager import make_state, train

from elastic import channel
from elastic.checkpoint import CheckpointManager
from elastic.checkpoint.layout import scan

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


@pytest.fixture
def agent_channel(tmp_path: Path, monkeypatch):
    """A worker's channel as elastic-run makes it, owned by this process; yields (path, the agent's read view)."""
    path = tmp_path / "heartbeat"
    channel.create_channel(path)
    monkeypatch.setattr(channel, "_channel", channel.open_channel(str(path), install_hooks=False))
    with open(path, "rb") as file:
        view = mmap.mmap(file.fileno(), channel.SIZE, mmap.MAP_SHARED, mmap.PROT_READ)
    yield path, view
    view.close()


def test_should_save_follows_the_schedule_and_a_drain_which_commits_and_waits_until_withdrawn(tmp_path, agent_channel):
    path, view = agent_channel
    manager = CheckpointManager(tmp_path / "ckpt", keep=3, async_save=True, every=5, check_at_start=False)
    state = make_state(seed=0)
    assert channel.read_drain(view) == channel.DrainState(drainable=True, done=0, step=None)
    assert [step for step in range(1, 11) if manager.should_save(step)] == [5, 10]

    channel.request_drain(path, 9)
    train(state, 3)
    assert manager.should_save(3), "a drain is asked for: save now, off the schedule"
    saving = threading.Thread(target=manager.save, args=(3, state), daemon=True)
    saving.start()
    deadline = time.monotonic() + 20
    while channel.read_drain(view).done != 9 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert channel.read_drain(view) == channel.DrainState(drainable=True, done=9, step=3)
    assert [e.step for e in scan(tmp_path / "ckpt") if e.committed] == [3], "committed before it answers"
    time.sleep(0.3)
    assert saving.is_alive(), "a drained worker waits at the step boundary for the next round"

    channel.request_drain(path, 0)  # the change is off
    saving.join(timeout=5)
    assert not saving.is_alive()
    assert not manager.should_save(4), "a drain is answered once"
    channel.request_drain(path, 9)  # still the answered number (a late write): not again
    assert not manager.should_save(4)
    manager.close()


def test_outside_elastic_run_should_save_is_the_schedule_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(channel, "_channel", channel._DISABLED)
    manager = CheckpointManager(tmp_path / "ckpt", keep=3, async_save=False, check_at_start=False)
    assert not any(manager.should_save(step) for step in range(1, 20)), "every=0: drains only"
    manager.close()
