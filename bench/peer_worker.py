"""One rank of bench/peer_bench.py's training job under a peer: torchft or NVIDIA's ft_launcher (nvidia-resiliency-ext).

The model, the corpus and the model flags are examples/train.py's (its GPT, its generated text, its flag parser),
so the peers train what bench/training_recovery_bench.py runs under elastic-run. The global batch (--global-batch,
32 like train.py's default) is split over the 6 ranks of 3 "nodes" x 2; the sample indices of a step are a function
of the step number only. Every attempt at a step appends one JSON line to --log:

    {"system", "step", "rank", "world_size", "round", "committed", "time", "started", "pid"}

`committed` is false only for torchft, when Manager.should_commit() dropped the step; `round` is torchft's quorum
id (0 under ft_launcher, whose restarts show as a later `started`, the time the process began).

  torchft     one replica group per torchrun (2 ranks); Manager(ProcessGroupGloo) + torchft's DDP and Optimizer
              wrappers for the gradient average across replica groups, a gloo all_reduce within the group (HSDP's
              layout, with DDP inside); a returning group heals from a live one (Manager's state_dict callbacks);
              the DDP wrapper's comm hook is patched where torchft 0.2.0 asserts after a failed all_reduce;
  nvrx        plain DDP on gloo; a heartbeat to the rank monitor every step (RankMonitorClient.send_heartbeat);
              rank 0 saves the model and optimizer to --ckpt every --ckpt-every steps (tmp + rename) and every
              rank resumes from it, since ft_launcher restarts all workers from scratch like torchrun.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

STARTED = time.time()

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from train import GPT, CharWindows, generate_corpus, parse_config  # type: ignore[import-not-found]  # noqa: E402

from elastic.rng import sample_generator  # noqa: E402
from elastic.sample_log import append_sample_log  # noqa: E402


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system", choices=("torchft", "nvrx"), required=True)
    parser.add_argument("--log", type=Path, required=True, help="the JSON-lines step log all ranks append to")
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--nodes", type=int, default=3, help="replica groups (torchft) or agents (nvrx) at full size")
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--ckpt", type=Path, default=None, help="nvrx: the checkpoint file")
    parser.add_argument("--ckpt-every", type=int, default=1, help="nvrx: save every this many steps")
    parser.add_argument("--gloo-timeout", type=float, default=2.0, help="torchft: ProcessGroupGloo timeout, s")
    parser.add_argument("--manager-timeout", type=float, default=2.0, help="torchft: Manager timeout, s")
    parser.add_argument("--quorum-timeout", type=float, default=15.0, help="torchft: Manager quorum_timeout, s")
    parser.add_argument("--connect-timeout", type=float, default=10.0, help="torchft: Manager connect_timeout, s")
    return parser.parse_known_args(argv)


class Share:
    """This rank's part of a step's global batch: the same samples for a step whatever happened before it."""

    def __init__(self, dataset: CharWindows, global_batch: int, index: int, ranks: int) -> None:
        self.dataset = dataset
        self.global_batch = global_batch
        base, extra = divmod(global_batch, ranks)
        self.first = index * base + min(index, extra)
        self.count = base + (index < extra)

    def indices(self, step: int) -> list[int]:
        start = step * self.global_batch + self.first
        return [(start + i) % len(self.dataset) for i in range(self.count)]

    def loss(self, model: torch.nn.Module, seed: int, step: int) -> torch.Tensor:
        indices = self.indices(step)
        tokens, targets = (torch.stack(t) for t in zip(*(self.dataset[i] for i in indices), strict=True))
        logits = model(tokens, [sample_generator(seed, step, i) for i in indices])
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def log_step(args: argparse.Namespace, **fields: object) -> None:
    append_sample_log(
        args.log, {"system": args.system, **fields, "time": time.time(), "started": STARTED, "pid": os.getpid()}
    )


def run_torchft(args: argparse.Namespace, config, model: GPT, dataset: CharWindows) -> None:
    from torch.distributed import TCPStore
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo  # type: ignore[import-untyped,import-not-found]

    group = int(os.environ["REPLICA_GROUP_ID"])
    dist.init_process_group("gloo")  # within the replica group: torchrun's store and ranks
    group_rank, group_size = dist.get_rank(), dist.get_world_size()
    share = Share(dataset, args.global_batch, group * group_size + group_rank, args.nodes * group_size)
    inner = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.1)

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    class PatchedDDP(DistributedDataParallel):
        """torchft 0.2.0's DDP comm hook asserts (`assert fut._fut`) when the gloo all_reduce raises, e.g. when a
        peer group dies: the survivors would crash instead of dropping the step. The Manager has recorded the error
        by then (should_commit() will say no), so hand the bucket back unchanged, as the wrapper means to."""

        @staticmethod
        def _comm_hook(state, bucket):  # unannotated: DDP checks a hook's annotations, which are strings here
            work = state.allreduce(bucket.buffer())
            work.wait()
            inner = getattr(work.get_future(), "_fut", None)
            if inner is not None:
                return inner
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done

    # The Manager's store: a fresh one per incarnation of the group. In torchrun's agent store (MASTER_PORT) a
    # restarted group's rank 1 can read the manager address its dead predecessor published and wait on it forever.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) if group_rank == 0 else None
    port = [store.port if store else 0]
    dist.broadcast_object_list(port, src=0)
    manager = Manager(
        store_addr="127.0.0.1",
        store_port=port[0],
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.gloo_timeout)),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        replica_id=f"peer_bench_{group}",
        timeout=timedelta(seconds=args.manager_timeout),
        quorum_timeout=timedelta(seconds=args.quorum_timeout),
        connect_timeout=timedelta(seconds=args.connect_timeout),
    )
    ddp = PatchedDDP(manager, model)
    optimizer = Optimizer(manager, inner)
    while manager.current_step() < args.steps:
        step = manager.current_step() + 1
        optimizer.zero_grad()  # starts the quorum, which overlaps the forward pass
        share.loss(ddp, config.seed, step).backward()  # the DDP hooks average across replica groups
        for parameter in model.parameters():
            if parameter.grad is not None:
                dist.all_reduce(parameter.grad, op=dist.ReduceOp.AVG)
        optimizer.step()  # should_commit(): every replica group of the quorum votes
        log_step(
            args,
            step=step,
            rank=group * group_size + group_rank,
            world_size=manager.num_participants() * group_size,
            round=manager._quorum_id,
            committed=manager.current_step() == step,
        )
    manager.shutdown(wait=False)
    dist.destroy_process_group()


def run_nvrx(args: argparse.Namespace, config, model: GPT, dataset: CharWindows) -> None:
    from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient  # type: ignore[import-untyped,import-not-found]

    monitor = RankMonitorClient()
    monitor.init_workload_monitoring()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    share = Share(dataset, args.global_batch, rank, world_size)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.1)
    start = 0
    if args.ckpt and args.ckpt.is_file():
        state = torch.load(args.ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        start = state["step"]
    for step in range(start + 1, args.steps + 1):
        optimizer.zero_grad()
        share.loss(ddp, config.seed, step).backward()
        optimizer.step()
        log_step(args, step=step, rank=rank, world_size=world_size, round=0, committed=True)
        monitor.send_heartbeat()
        if args.ckpt and rank == 0 and step % args.ckpt_every == 0:
            partial = args.ckpt.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}, partial)
            os.replace(partial, args.ckpt)
    monitor.shutdown_workload_monitoring()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args, model_flags = parse_args(sys.argv[1:] if argv is None else argv)
    config = parse_config(model_flags)  # examples/train.py's flags: --seq-len, --n-layer, ...
    torch.manual_seed(config.seed)  # the same initial weights on every rank
    dataset = CharWindows(generate_corpus(config.corpus_chars), config.seq_len)
    model = GPT(config, vocab_size=len(dataset.vocab))
    if args.system == "torchft":
        run_torchft(args, config, model, dataset)
    else:
        run_nvrx(args, config, model, dataset)


if __name__ == "__main__":
    main()
