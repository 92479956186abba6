"""The loaders' states inside a framework's checkpoint directory: one JSON file, never pickle.

A ``stallfree.DataLoader`` state is a global position (seed, epoch, positions consumed by all
ranks together), the same on every rank, so one file per checkpoint is enough: the process that
saves the framework's files writes it, every process reads it. Frameworks' own ways to keep extra
state (accelerate's ``register_for_checkpointing``, ``torch.save`` of a dict) pickle it; this file
is plain JSON, bounded in size when read, and written under a temporary name then renamed, so a
checkpoint holds either the whole file or none.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STATE_FILE = "stallfree_loader_state.json"
FORMAT = "stallfree.integrations.loader_states"
VERSION = 1
MAX_BYTES = 16 << 20  # a loader state is a few hundred bytes; a mixture's some KiB


class LoaderStateFileError(Exception):
    """The checkpoint's loader-state file is unreadable, too big or malformed; ``path`` names it."""

    def __init__(self, message: str, *, path: str) -> None:
        self.path = path
        self.reason = message
        super().__init__(f"{message} ({path})")

    def __reduce__(self):  # keep ``path`` across process boundaries
        return (type(self)._rebuild, (self.reason, self.path))

    @classmethod
    def _rebuild(cls, reason: str, path: str) -> LoaderStateFileError:
        return cls(reason, path=path)


class MissingLoaderStateError(LoaderStateFileError):
    """The checkpoint has no loader-state file: it was saved without the integration."""


@dataclass(frozen=True)
class SavedLoaders:
    """What a checkpoint records of the loaders: each one's ``state_dict()`` (in the order the
    framework knows them), the framework's step count when it saved, and the world size then."""

    loaders: tuple[dict[str, Any], ...]
    step: int
    world_size: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "step": self.step,
            "world_size": self.world_size,
            "loaders": [dict(s) for s in self.loaders],
        }

    @classmethod
    def from_dict(cls, d: Any, *, path: str) -> SavedLoaders:
        if not isinstance(d, Mapping) or d.get("format") != FORMAT:
            raise LoaderStateFileError(f"not a {FORMAT} file", path=path)
        if d.get("version") != VERSION:
            raise LoaderStateFileError(
                f"unsupported version {d.get('version')!r} (this build reads {VERSION})", path=path
            )
        loaders = d.get("loaders")
        if not isinstance(loaders, list) or not all(isinstance(s, Mapping) for s in loaders):
            raise LoaderStateFileError("'loaders' must be a list of loader states", path=path)
        try:
            return cls(tuple(dict(s) for s in loaders), int(d["step"]), int(d["world_size"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise LoaderStateFileError(f"malformed: {exc!r}", path=path) from None


def path_in(directory: str | os.PathLike[str]) -> Path:
    """Where a checkpoint directory keeps the loaders' states."""
    return Path(directory) / STATE_FILE


def write(
    directory: str | os.PathLike[str], states: Sequence[Mapping[str, Any]], *, step: int, world_size: int
) -> Path:
    """Write the loaders' states into ``directory`` (created if missing), atomically."""
    saved = SavedLoaders(tuple(dict(s) for s in states), int(step), int(world_size))
    data = json.dumps(saved.to_dict(), indent=1, sort_keys=True).encode()
    target = path_in(directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{STATE_FILE}.", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def read(directory: str | os.PathLike[str]) -> SavedLoaders:
    """The loaders' states saved in ``directory``; a typed error naming the file when it is missing,
    over ``MAX_BYTES`` or not what ``write`` writes."""
    path = path_in(directory)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise MissingLoaderStateError(
            "checkpoint has no stallfree loader state: it was saved without stallfree.integrations, "
            "so where the loader stood is unknown (resume from a checkpoint saved with the integration, "
            "or start the epoch over)",
            path=str(path),
        ) from None
    except OSError as exc:
        raise LoaderStateFileError(f"cannot read: {exc}", path=str(path)) from None
    if len(data) > MAX_BYTES:
        raise LoaderStateFileError(f"larger than {MAX_BYTES} bytes: not a loader state", path=str(path))
    try:
        decoded = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise LoaderStateFileError(f"not JSON: {exc}", path=str(path)) from None
    return SavedLoaders.from_dict(decoded, path=str(path))
