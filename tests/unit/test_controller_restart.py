"""launcher.rendezvous.controller: an etcd that does not answer for long makes the controller start over, never
stop while its agent holds the controller key."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from launcher.config import LaunchConfig
from launcher.etcd.errors import EtcdUnavailable
from launcher.rendezvous import controller as controller_module
from launcher.rendezvous.protocol import Holder, JobKeys


class _Mirror:
    """RangeMirror's start fails (a whole retry deadline without an answer) `failures` times, then works."""

    failures = 2
    started = 0

    def __init__(self, client, prefix) -> None:
        pass

    def start(self):
        if _Mirror.failures:
            _Mirror.failures -= 1
            raise EtcdUnavailable("DEADLINE_EXCEEDED: Deadline Exceeded")
        _Mirror.started += 1
        return self

    def close(self) -> None:
        pass


@pytest.mark.timeout(20)
def test_the_controller_starts_over_when_etcd_did_not_answer(monkeypatch):
    """Issue #18: at 4,096 simulated agents the controller's first read timed out and its thread ended, holding
    the key: the job had no controller and nobody could take over."""
    monkeypatch.setattr(controller_module, "RangeMirror", _Mirror)
    monkeypatch.setattr(controller_module, "_RESTART_AFTER_S", 0.01)
    led = threading.Event()
    config = LaunchConfig(
        min_nodes=1, max_nodes=2, nproc_per_node=1, rdzv_endpoint="127.0.0.1:2379", rdzv_id="job", entrypoint="x"
    )
    store = SimpleNamespace(client=None, keys=JobKeys("job"))
    controller = controller_module.Controller(store, Holder("n0", 1), config, log=None)
    monkeypatch.setattr(controller, "_lead", lambda mirror, stop: led.set())
    controller.run(threading.Event())
    assert led.is_set() and _Mirror.started == 1 and _Mirror.failures == 0
