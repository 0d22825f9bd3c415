"""The launch configuration as validated data: what elastic-run was asked to do, checked before anything starts."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from collections.abc import Mapping
from enum import IntEnum
from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    FilePath,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)


class Std(IntEnum):
    """Which of a worker's streams go to a file (torchrun's --redirects/--tee values)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3

    def includes_out(self) -> bool:
        return self in (Std.OUT, Std.ALL)

    def includes_err(self) -> bool:
        return self in (Std.ERR, Std.ALL)


class RendezvousSettings(BaseModel):
    """Timings of the etcd rendezvous; keys and defaults follow torch's dynamic rendezvous (--rdzv-conf)."""

    model_config = ConfigDict(extra="forbid")

    keep_alive_interval: float = Field(1.0, gt=0, description="seconds between lease refreshes")
    keep_alive_max_attempt: int = Field(3, ge=1, description="missed refreshes after which a node is lost")
    join_timeout: float = Field(600.0, gt=0, description="how long to wait for MIN nodes before the job fails")
    last_call_timeout: float = Field(30.0, ge=0, description="extra wait for more nodes once MIN are present")
    close_timeout: float = Field(30.0, gt=0, description="how long members of a new round have to start it")
    max_events: int = Field(
        10000, ge=1, description="membership events etcd keeps per job (membership.jsonl keeps all)"
    )
    quarantine_after: int = Field(
        3, ge=0, description="consecutive failing rounds after which a node sits out (0: never)"
    )
    quarantine_cooldown: float = Field(300.0, ge=0, description="seconds a quarantined node is kept out of rounds")
    probe_timeout: float = Field(
        0.5,
        ge=0,
        description="the most seconds a silent member's agent has to answer a liveness probe when its peers' "
        "workers failed or stalled, less once its peers answered theirs (0: no probes, the lease decides)",
    )

    @property
    def lease_ttl(self) -> int:
        # etcd leases are whole seconds; never shorter than the configured expiry
        return max(1, int(-(-self.keep_alive_interval * self.keep_alive_max_attempt // 1)))


# Idle etcd load is one lease refresh per node per keep-alive interval, all on the leader, and a round's burst of
# acknowledgements must fit in the lease (docs/scaling.md): past this many nodes (--nnodes MAX) the interval an
# --rdzv-conf does not set is torchrun's 5 s, the lease 15 s.
LARGE_JOB_NODES = 1024
LARGE_JOB_KEEP_ALIVE_S = 5.0


def default_keep_alive_interval(max_nodes: int) -> float:
    """The lease refresh interval of a job of at most `max_nodes` nodes, where --rdzv-conf does not choose one."""
    default = RendezvousSettings.model_fields["keep_alive_interval"].default
    return LARGE_JOB_KEEP_ALIVE_S if max_nodes > LARGE_JOB_NODES else default


PASSWORD_ENV = "ELASTIC_ETCD_PASSWORD"


class EtcdSecurity(BaseModel):
    """How to reach an etcd that wants TLS or a login (--rdzv-conf cacert, cert, key, user; the password only
    from ELASTIC_ETCD_PASSWORD, never on a command line, where `ps` shows it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cacert: FilePath | None = Field(None, description="CA bundle that signed etcd's server certificate (TLS)")
    cert: FilePath | None = Field(None, description="client certificate, for etcd --client-cert-auth")
    key: FilePath | None = Field(None, description="the client certificate's private key")
    user: str | None = Field(None, min_length=1, description=f"etcd user (auth enabled); password from {PASSWORD_ENV}")
    password: SecretStr | None = None

    @model_validator(mode="after")
    def _complete(self) -> EtcdSecurity:
        if (self.cert is None) != (self.key is None):
            raise ValueError("cert and key go together: pass both (cert=PATH,key=PATH) or neither")
        if self.user is not None and self.password is None:
            raise ValueError(f"user={self.user} needs its password in the environment variable {PASSWORD_ENV}")
        if self.user is None and self.password is not None:
            raise ValueError(f"{PASSWORD_ENV} is set but no user: add user=NAME to --rdzv-conf, or unset it")
        return self

    @property
    def tls(self) -> bool:
        return self.cacert is not None or self.cert is not None

    @classmethod
    def from_conf(cls, conf: dict[str, str], environ: Mapping[str, str]) -> EtcdSecurity:
        """The security keys of a parsed --rdzv-conf, with the password from `environ`."""
        fields = {key: conf[key] for key in SECURITY_RDZV_CONF_KEYS if key in conf}
        if environ.get(PASSWORD_ENV):
            fields["password"] = environ[PASSWORD_ENV]
        return cls(**fields)


SECURITY_RDZV_CONF_KEYS = ("cacert", "cert", "key", "user")
# rdzv-conf keys torchrun accepts that mean nothing for an etcd v3 rendezvous; accepted so torchrun command lines run.
IGNORED_RDZV_CONF_KEYS = {"is_host", "timeout", "read_timeout", "use_libuv", "store_type"}


def parse_rdzv_conf(spec: str) -> dict[str, str]:
    """`k=v,k2=v2` -> {k: v}; raises ValueError with the offending item."""
    conf: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(f"malformed --rdzv-conf item {item!r}: expected key=value[,key=value...]")
        conf[key.strip()] = value.strip()
    return conf


def one_line(exc: ValidationError, prefix: str = "") -> str:
    """The first problem pydantic found, as `<prefix><field>: <message>`."""
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"])
    message = error["msg"].removeprefix("Value error, ")
    flag = f"{prefix}{where}" if where else prefix.strip()
    return f"{flag}: {message}" if flag else message


def add_rdzv_conf_flag(parser: argparse.ArgumentParser) -> None:
    """The --rdzv-conf of `elastic-run log` and `purge`: the job's own, read for its etcd security keys."""
    parser.add_argument(
        "--rdzv-conf",
        "--rdzv_conf",
        default="",
        help="the job's --rdzv-conf: its cacert, cert, key and user reach a secured etcd (password "
        "from ELASTIC_ETCD_PASSWORD); other keys are ignored",
    )


def security_from_rdzv_conf(spec: str, environ: Mapping[str, str]) -> EtcdSecurity:
    """The etcd security keys of an --rdzv-conf (for `elastic-run log` and `purge`: timings do not matter
    there); raises ValueError in one line."""
    try:
        return EtcdSecurity.from_conf(parse_rdzv_conf(spec), environ)
    except ValidationError as exc:
        raise ValueError(one_line(exc, prefix="--rdzv-conf ")) from None


def parse_endpoints(spec: str) -> list[tuple[str, int]]:
    """`host:port[,host:port...]` -> [(host, port)]; the port defaults to etcd's 2379."""
    endpoints = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        item = item.removeprefix("http://")
        host, sep, port = item.rpartition(":")
        if not sep:
            host, port = item, "2379"
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"bad etcd endpoint {item!r}: expected host:port, e.g. 127.0.0.1:2379")
        endpoints.append((host.strip("[]"), int(port)))
    if not endpoints:
        raise ValueError("empty etcd endpoint: pass --rdzv-endpoint host:port or use --standalone")
    return endpoints


def parse_nnodes(spec: str) -> tuple[int, int]:
    """`N` or `MIN:MAX` -> (min, max)."""
    parts = spec.split(":")
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--nnodes {spec}: expected N or MIN:MAX, e.g. 2 or 1:4")
    low, high = int(parts[0]), int(parts[-1])
    if low < 1:
        raise ValueError(f"--nnodes {spec}: need at least 1 node")
    if low > high:
        raise ValueError(f"--nnodes {spec}: MIN exceeds MAX; did you mean --nnodes {high}:{low}?")
    return low, high


def parse_nproc_per_node(spec: str) -> int:
    """torchrun's --nproc-per-node: an int, `cpu`, `gpu` or `auto`."""
    if spec == "cpu":
        return os.cpu_count() or 1
    if spec in ("gpu", "auto"):
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
        if spec == "gpu":
            raise ValueError("--nproc-per-node gpu: no CUDA device is visible; use an int or cpu")
        return os.cpu_count() or 1
    if not spec.lstrip("-").isdigit():
        raise ValueError(f"bad --nproc-per-node {spec!r}: expected an int, cpu, gpu or auto")
    nproc = int(spec)
    if nproc < 1:
        raise ValueError(f"bad --nproc-per-node {spec}: need at least 1 worker per node")
    return nproc


def parse_std_spec(spec: str, name: str) -> Std | dict[int, Std]:
    """torchrun's --redirects/--tee: `3` for every local rank, or `0:1,1:2` per local rank."""
    try:
        if ":" not in spec:
            return Std(int(spec))
        mapping = {}
        for item in spec.split(","):
            rank, _, value = item.partition(":")
            mapping[int(rank)] = Std(int(value))
        return mapping
    except ValueError:
        raise ValueError(f"bad --{name} {spec!r}: expected 0-3 (none/out/err/both) or local_rank:value,...") from None


def default_node_id() -> str:
    return f"{socket.gethostname()}_{os.getpid()}"


class LaunchConfig(BaseModel):
    """Everything one agent needs; validated as a whole before any process or etcd key is created."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    min_nodes: int = Field(ge=1)
    max_nodes: int = Field(ge=1)
    nproc_per_node: int = Field(ge=1)
    rdzv_endpoint: str = ""
    rdzv_id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    rdzv: RendezvousSettings = RendezvousSettings()
    etcd_security: EtcdSecurity = EtcdSecurity()
    standalone: bool = False
    max_restarts: int = Field(0, ge=0)
    monitor_interval: float = Field(0.1, gt=0)
    worker_stop_timeout: float = Field(30.0, ge=0, description="grace between SIGTERM and SIGKILL of workers")
    # the progress watchdog (launcher.workers.watchdog): seconds of silence allowed after a heartbeat, auto, or off
    watchdog_timeout: float | Literal["auto", "off"] = "auto"
    watchdog_min: float = Field(60.0, gt=0, description="the least allowance of --watchdog-timeout auto")
    watchdog_long_op: float = Field(1800.0, gt=0, description="default allowance inside elastic.long_operation")
    drain_timeout: float = Field(
        60.0, ge=0, description="how long a planned change waits for the workers' drain checkpoint (0: no drain)"
    )
    log_dir: Path | None = None  # None: elastic-run makes a temp dir once the job can start
    redirects: Std | dict[int, Std] = Std.NONE
    tee: Std | dict[int, Std] = Std.NONE
    local_ranks_filter: set[int] | None = None
    # torchrun's: lines of any local worker's stream containing one of these also go to filtered_<stream>.log
    duplicate_stdout_filters: list[str] = []
    duplicate_stderr_filters: list[str] = []
    local_addr: str | None = None
    role: str = "default"
    node_id: str = Field(default_factory=default_node_id, min_length=1, pattern=r"^[A-Za-z0-9._:-]+$")
    signals_to_handle: list[int] = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT]
    entrypoint: str
    args: list[str] = []
    module: bool = False
    no_python: bool = False
    warm_workers: bool = (
        True  # pre-started interpreters, torch imported (launcher.workers.warm_pool); not with -m/--no-python
    )
    inprocess: bool = True  # workers under elastic.run take a new round in process (elastic.rounds)
    inprocess_timeout: float = Field(
        10.0, gt=0, description="how long a worker handed a new round in process has to re-enter it"
    )

    @model_validator(mode="after")
    def _check_consistency(self) -> LaunchConfig:
        if self.min_nodes > self.max_nodes:
            raise ValueError(f"--nnodes {self.min_nodes}:{self.max_nodes}: MIN must not exceed MAX")
        if self.standalone and self.rdzv_endpoint:
            raise ValueError("--standalone starts its own etcd: drop --rdzv-endpoint, or drop --standalone")
        if not self.standalone and not self.rdzv_endpoint:
            raise ValueError("no etcd to rendezvous on: pass --rdzv-endpoint host:port, or --standalone")
        if self.standalone and self.etcd_security != EtcdSecurity():
            raise ValueError(
                "--standalone runs a private etcd without TLS or login: drop cacert, cert, key and user "
                "from --rdzv-conf"
            )
        if self.module and self.no_python:
            raise ValueError("-m/--module and --no-python exclude each other")
        return self

    @field_validator("watchdog_timeout")
    @classmethod
    def _watchdog_timeout_positive(cls, value):
        if not isinstance(value, str) and not 0 < value < float("inf"):
            raise ValueError("--watchdog-timeout: seconds must be positive (or auto, or off)")
        return value

    @field_validator("rdzv_endpoint")
    @classmethod
    def _endpoint_parses(cls, value: str) -> str:
        if value:
            parse_endpoints(value)
        return value

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_given(cls, value: str) -> str:
        if not value:
            raise ValueError("no training script given: elastic-run [options] script.py [script args]")
        return value

    def std_for(self, spec: Std | dict[int, Std], local_rank: int) -> Std:
        return spec.get(local_rank, Std.NONE) if isinstance(spec, dict) else spec

    @property
    def starts_warm(self) -> bool:
        return self.warm_workers and not self.module and not self.no_python

    def worker_command(self) -> list[str]:
        if self.no_python:
            return [self.entrypoint, *self.args]
        if self.module:
            return [sys.executable, "-u", "-m", self.entrypoint, *self.args]
        return [sys.executable, "-u", self.entrypoint, *self.args]
