"""One key's value as a `RangeMirror` (or a range read) holds it: plain data, so that the code that parses a
mirror's keys needs no etcd client."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    value: bytes
    mod_revision: int
