"""The errors of elastic.checkpoint, in a module of their own so every other module can raise them."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint or checkpoint directory that cannot be used as asked; the message says why and what to do."""


class FencedError(CheckpointError):
    """A save whose manager no longer owns the checkpoint directory: a newer one (a later round) took it over."""


class UnreadableDataError(CheckpointError):
    """A data file of a committed checkpoint could not be decoded: its bytes changed after the commit."""
