"""The only module that touches torch's private APIs, each with a public fallback.

Private APIs change without notice between torch releases. Each one used here is looked up once, at import;
when it is missing or no longer behaves as expected, the public fallback runs instead and a warning names it,
so a torch upgrade makes checkpoints slower, never wrong. `tests/unit/test_torch_internals.py` fails loudly when
the installed torch lacks one, so an upgrade is noticed in CI rather than in a slow job.

- DCP's key flattening (`torch.distributed.checkpoint._nested_dict.flatten_state_dict`): the flat keys DCP
  writes into a checkpoint's metadata. Fallback: the same rules, written out here.
- Reading one storage record's offset inside a torch.save'd file (`torch._C.PyTorchFileReader` and its
  `get_record_offset`), so a resharding load reads only the rows it keeps. Fallback: DCP's general read path.
- Broadcasting many tensors in a few large buckets (`torch.distributed._broadcast_coalesced`). Fallback: one
  public `broadcast` per tensor.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Mapping
from typing import IO, Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

CHECKED_WITH_TORCH = "2.13"  # the torch release whose private APIs these were written against


def _lookup(what: str, find: Callable[[], Any]) -> Any:
    try:
        return find()
    except (ImportError, AttributeError) as error:
        logger.warning(
            "torch %s lacks %s (%s; checked with torch %s): using the public fallback",
            torch.__version__,
            what,
            error,
            CHECKED_WITH_TORCH,
        )
        return None


def _find_flatten() -> Any:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict


def _find_record_reader() -> Any:
    reader = torch._C.PyTorchFileReader
    if not hasattr(reader, "get_record_offset"):
        raise AttributeError("PyTorchFileReader.get_record_offset")
    return reader


_private_flatten = _lookup("DCP's flatten_state_dict", _find_flatten)
_private_record_reader = _lookup("PyTorchFileReader.get_record_offset", _find_record_reader)
_private_broadcast = _lookup("torch.distributed._broadcast_coalesced", lambda: dist._broadcast_coalesced)

# which private paths this torch offers (what the test checks)
PRIVATE_APIS = {
    "flatten_state_dict": _private_flatten is not None,
    "record_reader": _private_record_reader is not None,
    "broadcast_coalesced": _private_broadcast is not None,
}


def flat_keys(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """`state_dict` flattened as DCP flattens it when saving: `{"a": {"b": x}}` -> `{"a.b": x}`."""
    if _private_flatten is not None:
        return _private_flatten(state_dict)[0]
    return flatten_like_dcp(state_dict)


def flatten_like_dcp(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """DCP's flattening rules (torch >= 2.4): mappings are walked, keys joined by dots; a list or tuple is
    walked by index only when it holds tensors or mappings (or lists of them), otherwise it is one value."""
    flat: dict[str, Any] = {}

    def terminal(value: Any) -> bool:
        if isinstance(value, Mapping):
            return False
        if not isinstance(value, list):
            return True
        return not any(
            (isinstance(entry, (Mapping, list)) and not terminal(entry)) or isinstance(entry, torch.Tensor)
            for entry in value
        )

    def visit(path: tuple[str, ...], value: Any) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                visit((*path, str(key)), item)
        elif terminal(value):
            name = ".".join(path)
            if name in flat:
                raise ValueError(f"duplicated flatten key {name}")
            flat[name] = value
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                visit((*path, str(index)), item)

    for key, value in state_dict.items():
        visit((str(key),), value)
    return flat


class RecordView(io.RawIOBase):
    """The bytes [offset, offset + length) of an open binary file, as a seekable file of their own."""

    def __init__(self, file: IO[bytes], offset: int, length: int) -> None:
        super().__init__()
        self._file, self._start, self._length, self._position = file, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        wanted = min(len(view), self._length - self._position)
        if wanted <= 0:
            return 0
        self._file.seek(self._start + self._position)
        got = self._file.readinto(view[:wanted])  # type: ignore[attr-defined]  # every binary file we open has it
        self._position += got
        return got


def storage_record_offset(file: IO[bytes], offset: int, length: int) -> tuple[int, str] | None:
    """Where, inside the torch.save'd record at [offset, offset + length) of `file`, its one tensor storage
    starts, and that storage's record name; None when it holds other than one little-endian storage, or this
    torch cannot tell (the caller then reads the record whole, through DCP)."""
    if _private_record_reader is None:
        return None
    archive = _private_record_reader(RecordView(file, offset, length))
    storages = [name for name in archive.get_all_records() if name.startswith("data/")]
    if len(storages) != 1 or archive.get_record("byteorder") != b"little":
        return None
    return archive.get_record_offset(storages[0]), storages[0]


def broadcast_tensors(group: dist.ProcessGroup, tensors: list[torch.Tensor], bucket_bytes: int, src: int) -> None:
    """Broadcast `tensors` in place from group rank `src`: in large buckets where torch offers it."""
    if _private_broadcast is not None:
        _private_broadcast(group, tensors, bucket_bytes, src)
        return
    source = dist.get_global_rank(group, src)
    for tensor in tensors:
        dist.broadcast(tensor, src=source, group=group)
