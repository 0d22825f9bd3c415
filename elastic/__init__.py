"""elastic: what a training script imports to survive failures and resizes (checkpoints, global progress)."""

__version__ = "0.1.0"
