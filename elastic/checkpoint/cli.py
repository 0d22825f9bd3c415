"""``elastic-ckpt``: list, inspect, convert, adopt and prune the checkpoints of a directory.

``inspect`` and ``convert`` read committed checkpoints and foreign ones (whole DCP checkpoints another tool
wrote, such as torchtitan's); ``adopt`` commits foreign ones so that a CheckpointManager loads them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from elastic.checkpoint.adopt import adopt, adopt_all
from elastic.checkpoint.aside import is_set_aside
from elastic.checkpoint.errors import CheckpointError
from elastic.checkpoint.fence import read_fence
from elastic.checkpoint.integrity import read_metadata
from elastic.checkpoint.layout import (
    CheckpointEntry,
    folder_size,
    read_entry,
    saved_world_size,
    scan,
    step_dir,
    write_commit_record,
)
from elastic.checkpoint.retention import prune

PROG = "elastic-ckpt"


def _existing_directory(directory: Path) -> Path:
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory; pass the directory that holds the step-<N> folders")
    return directory


def _readable(directory: Path, step: int | None) -> CheckpointEntry:
    """The committed or foreign checkpoint of ``step``, or the newest of them when ``step`` is None."""
    if step is None:
        readable = [entry for entry in scan(_existing_directory(directory)) if entry.committed or entry.foreign]
        if not readable:
            raise CheckpointError(
                f"{directory} holds no committed or foreign checkpoint; run `{PROG} list {directory}`"
            )
        return readable[-1]
    folder = step_dir(_existing_directory(directory), step)
    if not folder.is_dir():
        raise CheckpointError(f"{folder} does not exist; run `{PROG} list {directory}` to see the steps")
    entry = read_entry(folder, read_fence(directory))
    if not (entry.committed or entry.foreign):
        raise CheckpointError(entry.problem)
    return entry


def _row(entry: CheckpointEntry) -> dict:
    record = entry.record
    return {
        "step": entry.step,
        "state": entry.state.value,
        "world_size": saved_world_size(entry),
        "round": record.round if record else None,
        "adopted": record.adopted if record else False,
        "bytes": folder_size(entry.path),
        "time": record.time.isoformat() if record else None,
        "path": str(entry.path),
        "problem": entry.problem,
    }


def _list(args: argparse.Namespace) -> None:
    rows = [_row(entry) for entry in scan(_existing_directory(args.directory))]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'step':>8}  {'state':<9}  {'world':>5}  {'size':>10}  time")
    for row in rows:
        world = row["world_size"] if row["world_size"] is not None else "-"
        print(f"{row['step']:>8}  {row['state']:<9}  {world:>5}  {_human(row['bytes']):>10}  {row['time'] or '-'}")
    set_aside = sorted(path.name for path in args.directory.iterdir() if is_set_aside(path.name))
    if set_aside:  # damaged or stale checkpoints moved out of the way: they do not load, but they are not gone
        print(f"set aside (not loaded): {', '.join(set_aside)}")


def _human(size: float) -> str:
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    unit = 0
    while size >= 1024 and unit < len(units) - 1:
        size /= 1024
        unit += 1
    return f"{size:.1f} {units[unit]}" if unit else f"{int(size)} B"


def _inspect(args: argparse.Namespace) -> None:
    entry = _readable(args.directory, args.step)
    record = entry.record
    if record is None:
        writers = saved_world_size(entry)
        print(
            f"{entry.path}: step {entry.step}, foreign (a whole DCP checkpoint without a commit record), written by "
            f"{writers if writers is not None else 'an unknown number of'} ranks; "
            f"`{PROG} adopt {args.directory} {entry.step}` commits it"
        )
    else:
        made_by = f", round {record.round}, attempt {record.attempt}" if record.attempt else ""
        adopted = ", adopted" if record.adopted else ""
        print(
            f"{entry.path}: step {record.step}, saved by {record.world_size} ranks at {record.time.isoformat()}, "
            f"torch {record.torch_version}, elastic {record.elastic_version}{made_by}{adopted}"
        )
    for key, item in sorted(read_metadata(entry.path).state_dict_metadata.items()):
        if isinstance(item, TensorStorageMetadata):
            shape = "x".join(map(str, item.size)) or "scalar"
            print(f"  {key}  {str(item.properties.dtype).removeprefix('torch.')}  {shape}")
        else:
            print(f"  {key}  object")


def _convert(args: argparse.Namespace) -> None:
    if args.to_torch:
        folder = _readable(args.directory, args.step).path
        dcp_to_torch_save(folder, args.to_torch)
        print(f"wrote {args.to_torch} from {folder}")
        return
    if not args.from_torch.is_file():
        raise CheckpointError(f"{args.from_torch} is not a file; pass a torch.save file to --from-torch")
    folder = step_dir(args.directory, args.step)
    if folder.exists():
        raise CheckpointError(f"{folder} already exists; pick a step that is not in the directory")
    folder.mkdir(parents=True)
    torch_save_to_dcp(args.from_torch, folder)
    write_commit_record(folder, args.step, world_size=1)
    print(f"wrote committed checkpoint {folder} from {args.from_torch}")


def _adopt(args: argparse.Namespace) -> None:
    directory = _existing_directory(args.directory)
    if args.step is None:
        adopted = adopt_all(directory)
    else:
        adopted = [step_dir(directory, args.step)]
        adopt(adopted[0])
    for folder in adopted:
        print(f"adopted {folder}")
    if not adopted:
        print(f"{directory} holds no foreign checkpoint (a whole DCP checkpoint without a commit record)")


def _prune(args: argparse.Namespace) -> None:
    deleted = prune(_existing_directory(args.directory), args.keep)
    for path in deleted:
        print(f"deleted {path}")
    print(f"kept the newest {args.keep} committed checkpoint(s); deleted {len(deleted)} folder(s)")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    listing = commands.add_parser("list", help="steps with state, world size, size and time")
    listing.add_argument("directory", type=Path)
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    listing.set_defaults(run=_list)

    inspecting = commands.add_parser("inspect", help="keys, dtypes and shapes of a committed checkpoint")
    inspecting.add_argument("directory", type=Path)
    inspecting.add_argument("step", type=int, nargs="?", help="default: the newest committed step")
    inspecting.set_defaults(run=_inspect)

    converting = commands.add_parser("convert", help="to or from a single torch.save file")
    converting.add_argument("directory", type=Path)
    converting.add_argument("step", type=int)
    direction = converting.add_mutually_exclusive_group(required=True)
    direction.add_argument("--to-torch", type=Path, metavar="OUT.pt", help="write step STEP to OUT.pt")
    direction.add_argument("--from-torch", type=Path, metavar="IN.pt", help="make a new committed step STEP")
    converting.set_defaults(run=_convert)

    adopting = commands.add_parser("adopt", help="commit whole DCP checkpoints another tool wrote, so they load")
    adopting.add_argument("directory", type=Path)
    adopting.add_argument("step", type=int, nargs="?", help="default: every foreign step")
    adopting.set_defaults(run=_adopt)

    pruning = commands.add_parser("prune", help="delete all but the newest K committed checkpoints")
    pruning.add_argument("directory", type=Path)
    pruning.add_argument("--keep", type=_positive, required=True, metavar="K")
    pruning.set_defaults(run=_prune)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        args.run(args)
    except (CheckpointError, OSError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
