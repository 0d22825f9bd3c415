"""The controller thread on a real etcd, with agents played by hand through the protocol's own operations."""

from __future__ import annotations

import threading
import time

import pytest

from launcher.config import LaunchConfig, RendezvousSettings
from launcher.etcd import client as etcd_client
from launcher.etcd.watch import RangeMirror
from launcher.rendezvous.controller import Controller
from launcher.rendezvous.job_view import ViewParser
from launcher.rendezvous.membership_log import LogMirror
from launcher.rendezvous.protocol import ControllerStore, Holder
from launcher.rendezvous.records import NodeFailure, NodeRecord, WorkerFailure

pytestmark = pytest.mark.timeout(90)


class HandPlayedJob:
    """Agents `a` and `b` registered under leases this test refreshes (or not); `a` holds the controller key."""

    def __init__(self, endpoint: str, log_dir, max_restarts: int = 0) -> None:
        self.client = etcd_client.connect(endpoint)
        self.store = ControllerStore(self.client, "ctl")
        self.config = LaunchConfig(
            min_nodes=1,
            max_nodes=2,
            nproc_per_node=1,
            rdzv_endpoint=endpoint,
            rdzv_id="ctl",
            node_id="a",
            entrypoint="train.py",
            max_restarts=max_restarts,
            log_dir=log_dir,
            rdzv=RendezvousSettings(
                keep_alive_interval=0.5, keep_alive_max_attempt=3, last_call_timeout=0, close_timeout=60
            ),
        )
        self.leases = {}
        self.refreshing: set[str] = set()
        self._stop = threading.Event()
        for index, name in enumerate(("a", "b")):
            lease = self.client.lease(self.config.rdzv.lease_ttl)
            self.leases[name] = lease
            self.refreshing.add(name)
            self.store.register(
                NodeRecord(node=name, addr="127.0.0.1", nproc=1, lease=lease.id, pid=1, joined_at=index)
            )
        threading.Thread(target=self._keep_alive, daemon=True).start()
        holder = Holder("a", self.leases["a"].id)
        assert self.store.claim_controller(holder)
        controller = Controller(self.store, holder, self.config, LogMirror(log_dir))
        self.thread = threading.Thread(target=controller.run, args=(self._stop,), daemon=True)
        self.thread.start()
        self.mirror = RangeMirror(self.client, self.store.keys.state).start()
        self.parser = ViewParser(self.store.keys.state, self.store.keys.state)

    def _keep_alive(self) -> None:
        while not self._stop.wait(0.5):
            for name in list(self.refreshing):
                self.leases[name].refresh()

    def wait_for(self, predicate, timeout: float, what: str):
        """The first view that satisfies `predicate`, woken by each change the watch brings."""
        deadline = time.monotonic() + timeout
        while True:
            entries, revision, version = self.mirror.snapshot()
            view = self.parser.parse(entries, revision)
            if predicate(view):
                return view
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out waiting for {what}: {view}")
            self.mirror.wait(version, left)

    def start_round(self):
        view = self.wait_for(lambda v: v.round is not None, 10, "round 0")
        for name in ("a", "b"):
            self.store.acknowledge(view.round.round, view.round_revision, name, 1)
        return view

    def fail(self, name: str, view) -> None:
        worker = WorkerFailure(node=name, round=view.round.round, local_rank=0, rank=0, exit_code=1, time=time.time())
        self.store.report_failed(view.round_revision, NodeFailure(node=name, round=view.round.round, failures=[worker]))

    def events(self) -> list[str]:
        return [e.event for e in self.store.read_events()]

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=10)
        self.mirror.close()
        self.client.close()


@pytest.fixture
def job(etcd, tmp_path):
    jobs = []

    def make(max_restarts: int = 0) -> HandPlayedJob:
        jobs.append(HandPlayedJob(etcd.endpoint, tmp_path, max_restarts))
        return jobs[-1]

    yield make
    for each in jobs:
        each.close()


def test_a_silent_member_whose_lease_ends_during_the_roll_call_is_a_loss_not_a_failure(job):
    # that nothing happens however long etcd keeps a dead member's lease is a row of the decision table
    # (test_failures_while_a_member_is_silent_call_the_roll_and_wait_without_a_timer_guess)
    played = job(max_restarts=0)
    round0 = played.start_round()
    played.fail("a", round0)  # b's death broke a's all_reduce; b itself never reports
    played.wait_for(lambda v: 0 in v.rollcalls, 5, "the roll call")
    played.refreshing.discard("b")  # etcd expires b's lease
    view = played.wait_for(lambda v: v.round.round == 1, 10, "a round without b")
    assert (view.round.reason, view.round.restart_count, view.round.nodes) == ("node_lost", 0, ["a"])
    assert view.status is None
    assert played.events()[-3:] == ["worker_failed", "node_lost", "round_started"]


def test_a_silent_member_that_answers_the_roll_call_makes_the_failure_count(job):
    played = job(max_restarts=0)
    round0 = played.start_round()
    played.fail("a", round0)
    view = played.wait_for(lambda v: 0 in v.rollcalls, 5, "the roll call")
    started = time.monotonic()
    played.store.answer_rollcall(0, view.round_revision, "b", view.rollcalls[0].nonce)  # b's workers hang; b lives
    view = played.wait_for(lambda v: v.status is not None, 5, "the job to end")
    assert time.monotonic() - started < 2, "an answer decides at once, not after a lease period"
    assert view.status.state == "failed"
    assert "root cause node a, rank 0 (local_rank 0), exit code 1, in round 0" in view.status.summary
    assert played.events()[-1] == "job_failed"


def test_a_worker_failure_within_max_restarts_forms_a_new_round_with_one_more_restart(job):
    played = job(max_restarts=1)
    round0 = played.start_round()
    played.fail("a", round0)
    played.fail("b", round0)  # everyone reported: no roll call needed
    view = played.wait_for(lambda v: v.round.round == 1, 5, "round 1")
    assert (view.round.reason, view.round.restart_count) == ("worker_failed", 1)
    assert 0 not in view.rollcalls and not view.reports.get(0), "round 0's reports go with it"
    assert played.events()[-2:] == ["restart", "round_started"]
