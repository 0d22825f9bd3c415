"""`elastic-run`: torchrun's command line, an etcd v3 rendezvous behind it. `elastic-run log` reads the membership
log."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from launcher.config import (
    IGNORED_RDZV_CONF_KEYS,
    SECURITY_RDZV_CONF_KEYS,
    EtcdSecurity,
    LaunchConfig,
    RendezvousSettings,
    default_keep_alive_interval,
    one_line,
    parse_nnodes,
    parse_nproc_per_node,
    parse_rdzv_conf,
    parse_std_spec,
)
from launcher.etcd import client as etcd_client
from launcher.workers.watchdog_rules import parse_timeout

logger = logging.getLogger("elastic-run")

# torchrun flags that only make sense for its static rendezvous or its Python API; each gets a one-line refusal.
UNSUPPORTED_FLAGS = {
    "node-rank": "node ranks come from the etcd rendezvous",
    "master-addr": "the rendezvous picks each round's master address",
    "master-port": "the rendezvous picks a fresh master port every round",
    "run-path": "pass the script as the positional argument",
    "logs-specs": "use --log-dir, --redirects and --tee",
    "numa-binding": "not implemented",
    "virtual-local-rank": "not implemented",
    "local-rank": "it is what torch.distributed.launch passes to a script; elastic-run, like torchrun, sets "
    "LOCAL_RANK in each worker's environment",
}
RDZV_BACKENDS = {"etcd", "etcd-v3"}


class ConfigError(Exception):
    """Bad input: printed as one line, nothing started."""


def _env_default(dest: str, default):
    return os.environ.get(f"PET_{dest.upper()}", default)


def _default(field: str) -> Any:
    """LaunchConfig's default of `field`: a flag's default is defined there, once."""
    return LaunchConfig.model_fields[field].get_default()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elastic-run",
        allow_abbrev=False,  # a script flag such as --log must never be read as a prefix of ours
        description="Fault-tolerant, elastic drop-in for torchrun: rendezvous in etcd v3, rounds re-formed on node "
        "loss, worker failure or scale-up. `elastic-run log --help` shows the membership log; "
        "`elastic-run purge --help` deletes a finished job's keys.",
    )

    def add(*names: str, dest: str, default=None, **kwargs) -> None:
        # torchrun accepts --nproc-per-node and --nproc_per_node alike
        spellings = list(dict.fromkeys(n for name in names for n in (name, name[:2] + name[2:].replace("-", "_"))))
        action = kwargs.get("action")
        if action in ("store_true",):
            value = _env_default(dest, None)
            kwargs["default"] = value.lower() in ("1", "true", "yes") if value is not None else False
        else:
            kwargs["default"] = _env_default(dest, default)
        parser.add_argument(*spellings, dest=dest, **kwargs)

    add("--nnodes", dest="nnodes", default="1:1", help="N or MIN:MAX nodes (default %(default)s)")
    add("--nproc-per-node", dest="nproc_per_node", default="1", help="workers per node: int, cpu, gpu or auto")
    add("--rdzv-backend", dest="rdzv_backend", default="etcd", help="etcd (v3 API; also spelled etcd-v3)")
    add(
        "--rdzv-endpoint",
        dest="rdzv_endpoint",
        default=_default("rdzv_endpoint"),
        help="etcd host:port, or a comma-separated list",
    )
    add("--rdzv-id", dest="rdzv_id", default=None, help="job id: every agent of one job passes the same")
    add(
        "--rdzv-conf",
        dest="rdzv_conf",
        default="",
        help="k=v,... keep_alive_interval, keep_alive_max_attempt, "
        "join_timeout, last_call_timeout, close_timeout, max_events, quarantine_after, quarantine_cooldown, "
        "probe_timeout; for a secured etcd: cacert, cert, key, user (password from ELASTIC_ETCD_PASSWORD)",
    )
    add("--standalone", dest="standalone", action="store_true", help="run a private etcd on free loopback ports")
    add(
        "--max-restarts",
        dest="max_restarts",
        default=_default("max_restarts"),
        help="worker failures tolerated, job-wide (default %(default)s)",
    )
    add(
        "--monitor-interval",
        dest="monitor_interval",
        default=_default("monitor_interval"),
        help="seconds between worker checks (a worker's exit, or its ring when main raised, is checked at once)",
    )
    add(
        "--start-method",
        dest="start_method",
        default="spawn",
        choices=["spawn", "fork", "forkserver"],
        help="accepted for torchrun compatibility; scripts always start as new processes",
    )
    add("--role", dest="role", default=_default("role"), help="worker role name (ROLE_NAME)")
    add("-m", "--module", dest="module", action="store_true", help="run the script as a Python module")
    add("--no-python", dest="no_python", action="store_true", help="run the script as an executable")
    add(
        "--no-warm-workers",
        dest="no_warm_workers",
        action="store_true",
        help="start every worker as a new interpreter; by default each local rank's next worker waits pre-started "
        "with torch imported, which saves seconds at every restart (never with -m or --no-python)",
    )
    add(
        "--no-inprocess",
        dest="no_inprocess",
        action="store_true",
        help="stop and start every worker at each new round; by default a worker whose script runs under "
        "elastic.run takes a new round that includes its node in process, without restarting",
    )
    add(
        "--inprocess-timeout",
        dest="inprocess_timeout",
        type=float,
        default=_default("inprocess_timeout"),
        help="seconds a worker handed a new round in process has to re-enter it before it is replaced by a new "
        "process (default %(default)s)",
    )
    add(
        "--log-dir",
        dest="log_dir",
        default=_default("log_dir"),
        help="worker logs and membership.jsonl (default: a temp dir)",
    )
    values = "0-3 or local_rank:v,... (default %(default)s)"
    add(
        "-r",
        "--redirects",
        dest="redirects",
        default=str(_default("redirects")),
        help=f"worker streams to files: {values}",
    )
    add("-t", "--tee", dest="tee", default=str(_default("tee")), help=f"worker streams to files and console: {values}")
    add("--local-ranks-filter", dest="local_ranks_filter", default="", help="local ranks whose tee'd output shows")
    add(
        "--local-addr", dest="local_addr", default=_default("local_addr"), help="address other nodes reach this node at"
    )
    add(
        "--signals-to-handle",
        dest="signals_to_handle",
        default=",".join(signal.Signals(number).name for number in _default("signals_to_handle")),
        help="signals forwarded to workers before the agent leaves",
    )
    add("--node-id", dest="node_id", default=None, help="this agent's name in the job (default: hostname_pid)")
    add(
        "--shutdown-timeout",
        "--worker-stop-timeout",
        dest="shutdown_timeout",
        default=os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", _default("worker_stop_timeout")),
        help="seconds between SIGTERM and SIGKILL when stopping workers (default: TORCH_ELASTIC_SHUTDOWN_TIMEOUT "
        f"or {_default('worker_stop_timeout'):g})",
    )
    add(
        "--event-log-handler",
        dest="event_log_handler",
        default="null",
        help="torchrun's event handler: only null (events go to elastic-run's membership log: elastic-run log)",
    )
    add(
        "--duplicate-stdout-filters",
        dest="duplicate_stdout_filters",
        default=_default("duplicate_stdout_filters"),
        help="lines of the workers' stdout containing any of these comma-separated strings (,, escapes a comma) are "
        "also written to <log-dir>/<node>/attempt_<round>/filtered_stdout.log",
    )
    add(
        "--duplicate-stderr-filters",
        dest="duplicate_stderr_filters",
        default=_default("duplicate_stderr_filters"),
        help="the same for stderr, into filtered_stderr.log",
    )
    add(
        "--watchdog-timeout",
        dest="watchdog_timeout",
        default=_default("watchdog_timeout"),
        help="a worker that called elastic.heartbeat and is then silent this long is hung: its stacks are dumped "
        "and it is killed, counted as a failure. SECONDS, auto (the larger of --watchdog-min and 10x its "
        "slowest of the last 100 steps) or off (default %(default)s)",
    )
    add(
        "--watchdog-min",
        dest="watchdog_min",
        default=_default("watchdog_min"),
        help="the least allowance under auto (default %(default)s s)",
    )
    add(
        "--watchdog-long-op",
        dest="watchdog_long_op",
        default=_default("watchdog_long_op"),
        help="allowance inside elastic.long_operation without its own timeout (default %(default)s s)",
    )
    add(
        "--drain-timeout",
        dest="drain_timeout",
        default=_default("drain_timeout"),
        help="before a node joins or an agent told to stop leaves, the workers checkpoint at their next step and "
        "wait, so nothing is redone; the change waits at most this long for it (default %(default)s s; 0: no "
        "drain)",
    )
    for flag in UNSUPPORTED_FLAGS:
        # a value is optional: some of these are switches in torchrun; either way the flag is refused in one line
        parser.add_argument(
            f"--{flag}",
            f"--{flag.replace('-', '_')}",
            dest=f"unsupported_{flag}",
            nargs="?",
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )
    parser.add_argument("training_script", nargs="?", default="", help="the script (or module) each worker runs")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="its arguments")
    return parser


def comma_separated(value: str | list[str]) -> list[str]:
    """torchrun's list syntax for the duplicate filters: comma-separated, a doubled comma is a literal one."""
    if isinstance(value, list):
        return value
    placeholder = "\0"
    return [item.replace(placeholder, ",") for item in value.replace(",,", placeholder).split(",") if item]


def rendezvous_conf(conf: dict[str, str], max_nodes: int) -> tuple[RendezvousSettings, EtcdSecurity]:
    """A parsed --rdzv-conf of a job of at most `max_nodes` nodes as timings and etcd security; raises ValueError
    or ValidationError."""
    known = [*RendezvousSettings.model_fields, *SECURITY_RDZV_CONF_KEYS]
    unknown = set(conf) - set(known) - IGNORED_RDZV_CONF_KEYS
    if unknown:
        raise ValueError(f"unknown --rdzv-conf key(s) {', '.join(sorted(unknown))}; known: {', '.join(known)}")
    timings: dict[str, object] = {k: v for k, v in conf.items() if k in RendezvousSettings.model_fields}
    timings.setdefault("keep_alive_interval", default_keep_alive_interval(max_nodes))
    return RendezvousSettings.model_validate(timings), EtcdSecurity.from_conf(conf, os.environ)


def config_from_args(args: argparse.Namespace) -> LaunchConfig:
    """Turn parsed flags into a validated LaunchConfig, or raise ConfigError with one line."""
    for flag, why in UNSUPPORTED_FLAGS.items():
        if hasattr(args, f"unsupported_{flag}"):
            raise ConfigError(f"elastic-run does not take --{flag}: {why}")
    if args.event_log_handler != "null":
        raise ConfigError(
            f"--event-log-handler {args.event_log_handler}: elastic-run records every event in its "
            "membership log (elastic-run log); pass null or drop the flag"
        )
    if args.rdzv_backend not in RDZV_BACKENDS:
        raise ConfigError(
            f"--rdzv-backend {args.rdzv_backend}: elastic-run rendezvous only in etcd (v3 API); "
            "pass --rdzv-backend etcd or drop the flag"
        )
    try:
        min_nodes, max_nodes = parse_nnodes(args.nnodes)
        nproc = parse_nproc_per_node(str(args.nproc_per_node))
        conf = parse_rdzv_conf(args.rdzv_conf)
        rdzv, security = rendezvous_conf(conf, max_nodes)
        redirects = parse_std_spec(args.redirects, "redirects")
        tee = parse_std_spec(args.tee, "tee")
        ranks_filter = {int(r) for r in args.local_ranks_filter.split(",") if r.strip()} or None
        signals = [signal.Signals[s.strip()].value for s in args.signals_to_handle.split(",") if s.strip()]
        watchdog_timeout = parse_timeout(args.watchdog_timeout)
        watchdog = {}
        for name in ("watchdog_min", "watchdog_long_op"):
            try:
                watchdog[name] = float(getattr(args, name))
                if not 0 < watchdog[name] < float("inf"):
                    raise ValueError
            except ValueError:
                raise ValueError(
                    f"bad --{name.replace('_', '-')} {getattr(args, name)!r}: expected positive seconds"
                ) from None
    except ValidationError as exc:
        raise ConfigError(one_line(exc, prefix="--rdzv-conf ")) from None
    except KeyError as exc:
        raise ConfigError(f"bad --signals-to-handle: unknown signal {exc}") from None
    except ValueError as exc:
        raise ConfigError(str(exc)) from None

    script = args.training_script
    if script and not args.module and not args.no_python and not Path(script).is_file():
        raise ConfigError(
            f"training script {script!r} not found (run from the directory that holds it, or fix the path)"
        )
    rdzv_id = args.rdzv_id or (uuid.uuid4().hex[:12] if args.standalone else "none")
    fields = dict(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=rdzv_id,
        rdzv=rdzv,
        etcd_security=security,
        standalone=args.standalone,
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        worker_stop_timeout=args.shutdown_timeout,
        log_dir=args.log_dir,
        duplicate_stdout_filters=comma_separated(args.duplicate_stdout_filters),
        duplicate_stderr_filters=comma_separated(args.duplicate_stderr_filters),
        redirects=redirects,
        tee=tee,
        local_ranks_filter=ranks_filter,
        local_addr=args.local_addr,
        role=args.role,
        signals_to_handle=signals,
        entrypoint=script,
        args=args.training_script_args,
        module=args.module,
        no_python=args.no_python,
        warm_workers=not args.no_warm_workers,
        inprocess=not args.no_inprocess,
        inprocess_timeout=args.inprocess_timeout,
        watchdog_timeout=watchdog_timeout,
        drain_timeout=args.drain_timeout,
        **watchdog,
    )
    if args.node_id:
        fields["node_id"] = args.node_id
    try:
        return LaunchConfig(**fields)
    except ValidationError as exc:
        raise ConfigError(one_line(exc)) from None


def _setup_logging(node_id: str) -> None:
    level = os.environ.get("LOGLEVEL", "INFO").upper()
    logging.basicConfig(
        level=level, format=f"[elastic-run {node_id}] %(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S"
    )


def run(config: LaunchConfig) -> int:
    from launcher.etcd.server import EtcdServer
    from launcher.node.agent import Agent
    from launcher.rendezvous.protocol import JobStore

    server = None
    try:
        if config.standalone:
            server = EtcdServer().start()
            config = config.model_copy(update={"rdzv_endpoint": server.endpoint})
            logger.info("standalone: private etcd at %s, job id %s", server.endpoint, config.rdzv_id)
        try:
            client = etcd_client.connect_reachable(config.rdzv_endpoint, config.etcd_security, config.max_nodes)
        except etcd_client.EtcdUnreachable as exc:
            print(f"elastic-run: error: {exc}", file=sys.stderr)
            return 1
        try:
            JobStore(client, config.rdzv_id).check_access()
        except Exception as exc:
            etcd_client.close(client)
            print(
                f"elastic-run: error: {etcd_client.explain(exc, config.rdzv_endpoint, config.etcd_security)}",
                file=sys.stderr,
            )
            return 1
        # like torchrun: a fresh temp dir unless one was given, created only once the job can start
        log_dir = config.log_dir or Path(tempfile.mkdtemp(prefix=f"elastic_{config.rdzv_id}_"))
        log_dir.mkdir(parents=True, exist_ok=True)
        config = config.model_copy(update={"log_dir": log_dir})
        logger.info(
            "job %s on etcd %s: nodes %d:%d, %d worker(s) here, logs in %s",
            config.rdzv_id,
            config.rdzv_endpoint,
            config.min_nodes,
            config.max_nodes,
            config.nproc_per_node,
            config.log_dir,
        )
        try:
            return Agent(config, client).run()
        finally:
            etcd_client.close(client)
    finally:
        if server is not None:
            server.stop()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["log"]:
        from launcher.commands.log import main as log_main

        return log_main(argv[1:])
    if argv[:1] == ["purge"]:
        from launcher.commands.purge import main as purge_main

        return purge_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"elastic-run: error: {exc}", file=sys.stderr)
        return 2
    _setup_logging(config.node_id)
    try:
        return run(config)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
