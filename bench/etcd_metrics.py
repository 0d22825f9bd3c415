"""etcd's Prometheus counters, scraped from http://<client endpoint>/metrics and turned into request counts.

What counts as one etcd *request* in these benchmarks:

- every unary RPC handled (Range, Txn, Put, DeleteRange, LeaseGrant, LeaseRevoke, Status, ...): one request;
- every message a client sent on a streaming RPC (LeaseKeepAlive, Watch): one request each. A lease refresh
  is one request (the python etcd client opens a short LeaseKeepAlive stream per refresh and sends one
  message on it); a watch create or cancel is one request; an open, idle watch stream costs nothing.

`grpc_server_handled_total` of a streaming method counts streams that *ended*, so the literal sum
"handled (all methods) + messages received on streams" counts each one-shot keep-alive stream twice; it is
reported as well, as `calls`, so that both readings of the figure are on the table.

Raft proposals: `etcd_server_proposals_committed_total` (writes: Txn, Put, Delete, LeaseGrant, LeaseRevoke;
lease refreshes are answered by the leader without a proposal). Bytes: `etcd_network_client_grpc_sent_bytes_total`
(everything etcd sent to clients: replies and watch events).
"""

from __future__ import annotations

import re
import time
import urllib.request
from dataclasses import dataclass, field

_LINE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="([^"]*)"')
KEEPALIVE = "LeaseKeepAlive"


@dataclass
class Sample:
    """One scrape: per-method counters and the totals these benchmarks report."""

    time: float
    unary: dict[str, float] = field(default_factory=dict)  # method -> unary calls handled
    stream_msgs: dict[str, float] = field(default_factory=dict)  # method -> messages received on streams
    stream_handled: dict[str, float] = field(default_factory=dict)  # method -> streams ended
    proposals: float = 0.0
    sent_bytes: float = 0.0
    watchers: float = 0.0  # watches etcd serves now (a gauge)

    def requests(self, exclude: tuple[str, ...] = ()) -> float:
        return sum(v for m, v in self.unary.items() if m not in exclude) + sum(
            v for m, v in self.stream_msgs.items() if m not in exclude
        )

    def calls(self) -> float:
        return sum(self.unary.values()) + sum(self.stream_handled.values()) + sum(self.stream_msgs.values())

    def by_method(self) -> dict[str, float]:
        return _summed([self.unary, self.stream_msgs])


def _summed(counters: list[dict[str, float]]) -> dict[str, float]:
    """Per-method counters added up."""
    total: dict[str, float] = {}
    for counter in counters:
        for method, value in counter.items():
            total[method] = total.get(method, 0.0) + value
    return total


def scrape(endpoint: str, timeout: float = 10.0) -> Sample:
    text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=timeout).read().decode()
    sample = Sample(time=time.time())
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if match is None:
            continue
        name, value = match["name"], float(match["value"])
        labels = dict(_LABEL.findall(match["labels"] or ""))
        method, kind = labels.get("grpc_method", ""), labels.get("grpc_type", "")
        if name == "grpc_server_handled_total":
            target = sample.unary if kind == "unary" else sample.stream_handled
            target[method] = target.get(method, 0.0) + value
        elif name == "grpc_server_msg_received_total" and kind != "unary":
            sample.stream_msgs[method] = sample.stream_msgs.get(method, 0.0) + value
        elif name == "etcd_server_proposals_committed_total":
            sample.proposals = value
        elif name == "etcd_network_client_grpc_sent_bytes_total":
            sample.sent_bytes = value
        elif name == "etcd_debugging_mvcc_watcher_total":
            sample.watchers = value
    return sample


@dataclass
class Delta:
    seconds: float
    requests: float  # unary calls + stream messages (every method)
    keepalives: float  # LeaseKeepAlive messages (lease refreshes)
    calls: float  # the literal "handled (all) + stream messages" sum
    proposals: float
    sent_bytes: float
    by_method: dict[str, float]

    @property
    def requests_without_keepalives(self) -> float:
        return self.requests - self.keepalives


def delta(before: Sample, after: Sample) -> Delta:
    methods_after, methods_before = after.by_method(), before.by_method()
    by_method = {m: v - methods_before.get(m, 0.0) for m, v in methods_after.items()}
    return Delta(
        seconds=after.time - before.time,
        requests=after.requests() - before.requests(),
        keepalives=after.stream_msgs.get(KEEPALIVE, 0.0) - before.stream_msgs.get(KEEPALIVE, 0.0),
        calls=after.calls() - before.calls(),
        proposals=after.proposals - before.proposals,
        sent_bytes=after.sent_bytes - before.sent_bytes,
        by_method={m: v for m, v in sorted(by_method.items()) if v},
    )


def scrape_members(endpoints: list[str], timeout: float = 10.0) -> dict[str, Sample]:
    """One scrape of each member of a cluster (each counts the requests it served); one that does not answer is
    left out."""
    samples = {}
    for endpoint in endpoints:
        try:
            samples[endpoint] = scrape(endpoint, timeout)
        except OSError:
            continue
    return samples


class MetricsUnavailable(RuntimeError):
    """No etcd member answered its metrics endpoint at both ends of a window: it cannot be measured."""


def delta_members(before: dict[str, Sample], after: dict[str, Sample]) -> Delta:
    """The cluster's delta over the members scraped at both ends (a member killed in between is left out, its
    requests uncounted); MetricsUnavailable if none was (an etcd too loaded to answer in time)."""
    common = [endpoint for endpoint in before if endpoint in after]
    if not common:
        raise MetricsUnavailable(
            f"no etcd member answered its metrics endpoint at both ends of the window (before: {sorted(before)}, "
            f"after: {sorted(after)})"
        )
    return delta(_combined([before[e] for e in common]), _combined([after[e] for e in common]))


def _combined(samples: list[Sample]) -> Sample:
    """The members' samples as one: requests and bytes add up; proposals are the most any member committed
    (each member commits every proposal)."""
    return Sample(
        time=max(sample.time for sample in samples),
        unary=_summed([sample.unary for sample in samples]),
        stream_msgs=_summed([sample.stream_msgs for sample in samples]),
        stream_handled=_summed([sample.stream_handled for sample in samples]),
        proposals=max(sample.proposals for sample in samples),
        sent_bytes=sum(sample.sent_bytes for sample in samples),
    )


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (and its reaped children), from /proc."""
    import os

    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    return sum(int(fields[i]) for i in (11, 12)) / ticks  # utime, stime (fields 14, 15 of the full line)


def process_threads(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0
