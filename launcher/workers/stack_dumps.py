"""The stacks a hung worker's faulthandler wrote to its stderr: the last dump, and where its main thread was.

Peers of a hung worker show a collective there (`all_reduce` in torch/distributed/distributed_c10d.py), the hung
worker something else: the failure summary and the root cause tell the two apart by it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<function>\S+)')
_THREAD = ("Current thread 0x", "Thread 0x")


def last_dump(text: str) -> str:
    """The last faulthandler dump (every thread's stack) in a worker's stderr; "" if there is none."""
    lines = text.splitlines()
    headers = [i for i, line in enumerate(lines) if line.startswith(_THREAD)]
    if not headers:
        return ""

    def in_dump(line: str) -> bool:
        return line.startswith(_THREAD) or line.startswith("  ") or not line.strip()

    start = end = headers[-1]
    while start > 0 and in_dump(lines[start - 1]):
        start -= 1
    while end + 1 < len(lines) and (lines[end + 1].startswith("  ") or lines[end + 1].startswith(_THREAD)):
        end += 1
    return "\n".join(lines[start : end + 1]).strip("\n") + "\n"


def read_dump(path: Path, tail_bytes: int = 65536) -> str:
    """The last stack dump in the log file at `path` (its last `tail_bytes`), "" when none is there."""
    try:
        with open(path, "rb") as file:
            file.seek(max(0, file.seek(0, os.SEEK_END) - tail_bytes))
            return last_dump(file.read().decode(errors="replace"))
    except OSError:
        return ""


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str

    @property
    def in_collective(self) -> bool:
        return "/torch/distributed/" in self.file.replace(os.sep, "/")


def main_thread_frame(dump: str) -> Frame | None:
    """Where the main thread was (its innermost frame) in the last faulthandler dump in `dump`, if any.

    The main thread is the dumped thread whose outermost frame is `<module>`.
    """
    blocks: list[list[re.Match[str]]] = []
    current: list[re.Match[str]] | None = None
    for line in dump.splitlines():
        if line.startswith(_THREAD):
            current = []
            blocks.append(current)
        elif current is not None:
            match = _FRAME.match(line)
            if match:
                current.append(match)
            elif line.strip():
                current = None  # the dump ended
    candidates = [b for b in blocks[-32:] if b]
    main = next((b for b in reversed(candidates) if b[-1]["function"] == "<module>"), None)
    if main is None:
        return None
    top = main[0]
    return Frame(top["file"], int(top["line"]), top["function"])
