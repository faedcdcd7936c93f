"""Checkpoint errors: one base class so callers can catch everything a checkpoint can get wrong."""
from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message names the key and/or file at fault."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The path holds no complete checkpoint (no index: never saved, or the save never finished)."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint and the state to fill disagree: missing or extra keys, shape or dtype."""


class CheckpointCorruptError(CheckpointError):
    """A file is truncated, unreadable, or a stored piece fails its checksum."""
