"""elastic: what a training script imports to survive failures and resizes (checkpoints, global progress)."""

from elastic.channel import heartbeat, long_operation
from elastic.rounds import RoundChanged, run

__version__ = "0.1.0"
__all__ = ["RoundChanged", "heartbeat", "long_operation", "run"]
