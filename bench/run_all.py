"""Every benchmark in one run, within 25 minutes on a 2-core machine: writes docs/benchmarks.md and its plots.

    bench/run_all                      # or: python bench/run_all.py [--only recovery,checkpoint] [--out docs]

With --only, the chosen sections are replaced in (or added to) the existing benchmarks.md and the others kept as
they are; each replaced section says when and at which commit it ran.

Each benchmark runs as its own process with settings small enough for the budget, and compares against the
baseline it measures in the same run (torchrun, a raw write, a cold start, ...); this script only collects:
the machine the figures came from, each benchmark's command, its printed tables, its duration and its plot.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Benchmark:
    name: str
    args: list[str]
    timeout_s: float
    conditions: str
    plot: str | None = None  # the PNG the benchmark writes into the output folder


BENCHMARKS = [
    Benchmark(
        "recovery",
        [
            "bench/recovery_bench.py",
            "--launchers",
            "elastic-run,elastic-run-inprocess,elastic-run-cold,torchrun",
            "--faults",
            "kill,stop,crash,cascade",
            "--deadline",
            "30",
            "--plot",
            "{out}/recovery.png",
        ],
        720,
        "3 nodes x 2 workers of examples/collective_probe.py on one host (elastic-run-inprocess: under "
        "elastic.run); the last node (never the controller, never torchrun's store host) faulted after 8 s of "
        "training (cascade: a worker of node1 crashed, then the last node killed 3 s after the job trains "
        "again); elastic-run lease 1 s x 3, probe_timeout "
        "0.5 s; torchrun c10d with keep-alive 1 s x 3, last call 2 s",
        "recovery.png",
    ),
    Benchmark(
        "training-recovery",
        ["bench/training_recovery_bench.py"],
        480,
        "3 nodes x 2 workers of examples/train.py (a tiny model, a disk checkpoint every 50 steps) on one host, the "
        "last node faulted at step 25; elastic-run defaults (warm workers, a snapshot in memory every step, drains) "
        "against the same faults with --no-warm-workers --drain-timeout 0 and --memory-every 0; lease 1 s x 3; the "
        "hang fault with --watchdog-min 5",
    ),
    Benchmark(
        "checkpoint",
        ["bench/checkpoint_bench.py", "--megabytes", "256", "--rounds", "3"],
        300,
        "256 MiB of model state on 4 and 8 gloo ranks, 3 interleaved rounds, the temp directory's disk; memory "
        "snapshots at 4 ranks as 2 nodes of 2 (a /dev/shm folder each), their stalls after 2 warm-up rounds (a run's "
        "steady state), the page cache dropped before each disk load",
    ),
    Benchmark(
        "rendezvous",
        [
            "bench/rendezvous_bench.py",
            "--agents",
            "16,256,1024",
            "--idle-seconds",
            "5",
            "--budget",
            "180",
            "--plot",
            "{out}/rendezvous.png",
        ],
        240,
        "N simulated agents (the real Agent and Controller, no-op workers, 256 agents per process) on one local "
        "etcd; lease 1 s x 3",
        "rendezvous.png",
    ),
    Benchmark(
        "idle",
        ["bench/idle_cost.py", "--seconds", "10"],
        90,
        "3 real elastic-run agents whose workers sleep, 10 s window, default flags (lease 1 s x 3)",
    ),
    Benchmark(
        "chaos",
        ["bench/chaos_bench.py", "--spares", "1", "--bracket"],
        900,
        "3 nodes x 2 workers of examples/train.py (400 steps, global batch 24, a disk checkpoint every 50 steps), "
        "--nnodes 2:3, --max-restarts 1000, lease 1 s x 3, last call 3 s, --watchdog-min 3; a fault every 15 s "
        "cycling kill, stop (SIGKILLed 10 s later), crash, hang, term, aimed at nodes that train; one spare agent "
        "takes a gone node's place, and a new one joins as the next spare 5 s later; the same job without faults "
        "before and after it, in the same run (goodput against the mean of the two)",
    ),
    Benchmark(
        "peers",
        ["bench/peer_bench.py"],
        900,
        "torchft 0.2.0, NVIDIA nvidia-resiliency-ext 0.4.1 (ft_launcher) and elastic-run on one host, each 3 nodes "
        "x 2 ranks of examples/train.py's tiny GPT, global batch 32, the last node faulted at step 25; each peer "
        "tuned for fast detection (settings printed below); needs the optional extra: pip install -e '.[peers]' "
        "(with torch==2.13.0 on the same command line)",
    ),
    Benchmark(
        "peer-chaos",
        ["bench/chaos_bench.py", "--systems", "elastic-run,torchft,nvrx", "--deadline", "400"],
        1500,
        "the chaos section's stream of faults (one every 15 s, cycling kill, stop, crash, hang, term; a gone node "
        "replaced 5 s later) against elastic-run (the chaos section's job) and bench/peer_bench.py's torchft and "
        "ft_launcher jobs (3 nodes x 2 ranks, the tiny GPT unpaced, 1600 and 4400 steps: about as long fault-free "
        "as elastic-run's 400), each next to its own fault-free run, at most 400 s per run; ft_launcher's node 0 "
        "(the c10d store) is never faulted; needs the [peers] extra",
    ),
]


def machine() -> list[str]:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in _lines("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor() or "?",
    )
    memory = next((line.split()[1] for line in _lines("/proc/meminfo") if line.startswith("MemTotal")), None)
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return [
        f"- when: {datetime.now():%Y-%m-%d %H:%M}",
        f"- commit: {commit.stdout.strip() or '?'}",
        f"- CPU: {cpu}, {os.cpu_count()} cores; memory: {int(memory) // 1024**2 if memory else '?'} GiB",
        f"- {platform.system()} {platform.release()}, Python {platform.python_version()}, torch {torch.__version__}",
        "- other work may have run on the host: treat the figures as +-30%; ratios are taken within one run",
    ]


def _lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def run(benchmark: Benchmark, out: Path) -> list[str]:
    args = [arg.replace("{out}", str(out)) for arg in benchmark.args]
    print(f"== {benchmark.name}: python {' '.join(args)} (at most {benchmark.timeout_s:.0f} s)", flush=True)
    started = time.monotonic()
    try:
        result = subprocess.run(
            [sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=benchmark.timeout_s
        )
        output, outcome = result.stdout, f"exit code {result.returncode}"
        if result.returncode != 0:
            output += "\n" + result.stderr[-3000:]
    except subprocess.TimeoutExpired as expired:
        partial = expired.stdout or ""
        output = partial.decode(errors="replace") if isinstance(partial, bytes) else partial
        outcome = f"stopped at its {benchmark.timeout_s:.0f} s budget"
    seconds = time.monotonic() - started
    print(f"   {outcome}, {seconds:.0f} s", flush=True)
    section = [
        f"## {benchmark.name}",
        "",
        f"`python {' '.join(benchmark.args).replace('{out}/', 'docs/')}`: {outcome}, {seconds:.0f} s.",
        "",
        f"Conditions: {benchmark.conditions}.",
        "",
        "```",
        output.strip(),
        "```",
        "",
    ]
    if benchmark.plot and (out / benchmark.plot).is_file():
        section += [f"![{benchmark.name}]({benchmark.plot})", ""]
    return section


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs", help="where benchmarks.md and the plots go")
    parser.add_argument("--only", default="", help="comma-separated names: " + ", ".join(b.name for b in BENCHMARKS))
    args = parser.parse_args(argv)
    chosen = [b for b in BENCHMARKS if not args.only or b.name in args.only.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    path = args.out / "benchmarks.md"
    if args.only and path.is_file():  # a partial run: the other sections stay as the last run wrote them
        fresh = {}
        for benchmark in chosen:
            section = run(benchmark, args.out.resolve())
            note = f"Run alone by `bench/run_all --only {args.only}` ({', '.join(machine()[:2]).replace('- ', '')})."
            fresh[benchmark.name] = [*section[:2], note, "", *section[2:]]
        path.write_text(merge(path.read_text(), fresh))
        print(f"updated {', '.join(fresh)} in {path}")
        return 0
    sections = [line for benchmark in chosen for line in run(benchmark, args.out.resolve())]
    minutes = (time.monotonic() - started) / 60
    header = ["# Benchmarks", "", f"Written by `bench/run_all` in {minutes:.1f} minutes, on this machine:", ""]
    path.write_text("\n".join([*header, *machine(), "", *sections]))
    print(f"wrote {path}")
    return 0


def merge(existing: str, fresh: dict[str, list[str]]) -> str:
    """`existing` benchmarks.md with the sections named in `fresh` replaced (in place) or appended (in BENCHMARKS
    order); the header and every other section kept as they are."""
    lines = existing.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("## ")]
    preamble = lines[: starts[0]] if starts else lines
    sections = {lines[i][3:].strip(): lines[i:end] for i, end in zip(starts, [*starts[1:], len(lines)])}
    for name in (b.name for b in BENCHMARKS):
        if name in fresh:
            sections[name] = fresh[name]
    return "\n".join([*preamble, *(line for section in sections.values() for line in section)]).rstrip() + "\n"


if __name__ == "__main__":
    sys.exit(main())
