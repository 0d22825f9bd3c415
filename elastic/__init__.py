"""elastic: what a training script imports to survive failures and resizes (checkpoints, global progress)."""

from elastic.channel import heartbeat, long_operation

__version__ = "0.1.0"
__all__ = ["heartbeat", "long_operation"]
