"""The sample log: one JSON line per rank and step (the samples it trained, its world size, round and time), which
the scenarios, tests and benchmarks read to check that every sample was used once across resizes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def append_sample_log(path: Path | str, record: dict[str, Any]) -> None:
    """Append `record` as one line. One write() on an O_APPEND descriptor: lines of concurrent ranks never mix."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)
