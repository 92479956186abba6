"""Resume state: a tiny JSON-serialisable dict of what the consumer has received.

Only (seed, epoch, global position) are needed because the order is a pure function of them,
given the order's layout, which the state names (``order``: see ``order.order_identity``) so a
state is never continued on another one; the world size and worker count at save time are kept
for information and never required to match. The dataset's identity (its length, and its content
fingerprint where it has one) is kept so a state is never continued on other data by mistake;
states saved before it was recorded (length 0 outside our order, no fingerprint) still load.
Our order's states also carry the run's timeline (``step``, ``history``, ``skips``: timeline.py),
from which the samples of any step follow without a log; states without one still load.

A state comes from outside (a checkpoint file): ``from_dict`` checks every field's type and
bounds how deeply its values nest, so a malformed or hostile one is a ``ValueError``, never a
``RecursionError`` in whatever walks it later (a mixture's check compares its description).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

FORMAT = "stallfree.loader.state"  # a name on disk, not a module path: it never moves with the code
_READS = (FORMAT, "stallfree.loader.epoch.state")  # the second: written briefly after the layout move
VERSION = 1
MAX_DEPTH = 32  # nesting allowed in a state's values (a mixture's description uses 3)
MAX_ITEMS = 100_000  # containers and leaves walked in a state's values


@dataclass(frozen=True)
class LoaderState:
    seed: int
    epoch: int
    consumed: int  # global positions of the epoch's order consumed (all ranks together)
    dataset_len: int  # the dataset's length (0: not recorded, a state saved outside our order before)
    mode: str = "fast"  # "fast": our order; "sampler" / "iterable": resumed by skipping batches
    batches: int = 0  # batches this rank received in the epoch (used by the sampler and iterable modes)
    world_size: int = 1
    dataset: dict[str, Any] | None = None  # what the dataset needs to check a resume (a mixture's state)
    order: str | None = None  # the order's layout (order.order_identity); None: torch's sampler, a stream
    fingerprint: str | None = None  # the dataset's content fingerprint, where it has one
    step: int | None = None  # steps (batches per rank) delivered since the run began (our order)
    history: tuple[dict[str, Any], ...] = ()  # the run's spans (timeline.py): what samples_at reads
    skips: tuple[dict[str, Any], ...] = ()  # position ranges left out by skip_steps= (timeline.py)
    url: str | None = None  # where the dataset was opened from (open_dataset), for stallfree trace

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "mode": self.mode,
            "seed": self.seed,
            "epoch": self.epoch,
            "consumed": self.consumed,
            "dataset_len": self.dataset_len,
            "batches": self.batches,
            "world_size": self.world_size,
            **({"dataset": dict(self.dataset)} if self.dataset is not None else {}),
            **({"order": self.order} if self.order is not None else {}),
            **({"fingerprint": self.fingerprint} if self.fingerprint is not None else {}),
            **({"step": self.step} if self.step is not None else {}),
            **({"history": [dict(h) for h in self.history]} if self.history else {}),
            **({"skips": [dict(k) for k in self.skips]} if self.skips else {}),
            **({"url": self.url} if self.url is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LoaderState:
        if not isinstance(d, Mapping) or d.get("format") not in _READS:
            raise ValueError(
                f"not a stallfree loader state (format {d.get('format') if isinstance(d, Mapping) else d!r})"
            )
        if d.get("version") != VERSION or isinstance(d.get("version"), bool):  # True == 1
            raise ValueError(
                f"unsupported loader state version {d.get('version')!r} (this build reads {VERSION})"
            )
        check_nesting(d)
        try:
            epoch = _int(d, "epoch", low=0)
            return cls(
                seed=_int(d, "seed"),
                epoch=epoch,
                consumed=_int(d, "consumed"),  # range-checked against the epoch on load
                dataset_len=_int(d, "dataset_len", low=0),
                mode=str(d.get("mode", "fast")),
                batches=_int(d, "batches", 0),  # likewise
                world_size=_int(d, "world_size", 1, low=1),
                dataset=dict(d["dataset"]) if isinstance(d.get("dataset"), Mapping) else None,
                order=str(d["order"]) if d.get("order") is not None else None,
                fingerprint=_str(d, "fingerprint"),
                step=_int(d, "step", low=0) if d.get("step") is not None else None,
                history=_entries(d, "history"),
                skips=_entries(d, "skips"),
                url=_str(d, "url"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed loader state: {exc}") from exc


def _int(d: Mapping[str, Any], name: str, default: int | None = None, *, low: int | None = None) -> int:
    """An integer field: an int (numpy's too) or its decimal text; never a bool or a float;
    at least ``low`` when given (a world of 0 ranks, a count below 0: a damaged state)."""
    if name not in d and default is not None:
        return default
    value = d[name]
    if isinstance(value, bool):
        raise TypeError(f"{name!r} is {value!r}, not an integer")
    if isinstance(value, str):
        number = int(value)
    else:
        try:
            number = operator.index(value)
        except TypeError:
            raise TypeError(f"{name!r} is {value!r} ({type(value).__name__}), not an integer") from None
    if low is not None and number < low:
        raise ValueError(f"{name!r} is {number}, must be >= {low}")
    return number


def _entries(d: Mapping[str, Any], name: str) -> tuple[dict[str, Any], ...]:
    """A list of objects (the timeline's spans or skips; timeline.py checks their fields)."""
    value = d.get(name)
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, Mapping) for v in value):
        raise TypeError(f"{name!r} must be a list of objects, got {type(value).__name__}")
    return tuple(dict(v) for v in value)


def _str(d: Mapping[str, Any], name: str) -> str | None:
    value = d.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{name!r} is {value!r} ({type(value).__name__}), not a string")
    return value


def check_nesting(value: Any, *, max_depth: int = MAX_DEPTH, max_items: int = MAX_ITEMS) -> None:
    """Refuse a state whose values nest deeper than ``max_depth`` or hold more than ``max_items``
    containers and leaves, walking it without recursion (a ValueError naming the path)."""
    stack: list[tuple[Any, int, str]] = [(value, 0, "state")]
    seen = 0
    while stack:
        obj, depth, path = stack.pop()
        seen += 1
        if seen > max_items:
            raise ValueError(f"malformed loader state: more than {max_items} values")
        if isinstance(obj, Mapping):
            children = [(v, f"{path}[{k!r}]") for k, v in list(obj.items())[:max_items]]
        elif isinstance(obj, (list, tuple)):
            children = [(v, f"{path}[{i}]") for i, v in enumerate(obj[:max_items])]
        else:
            continue
        if depth >= max_depth and children:
            raise ValueError(
                f"malformed loader state: values nested deeper than {max_depth} levels at {_short(path)}"
            )
        stack.extend((v, depth + 1, p) for v, p in children)


def _short(path: str, limit: int = 120) -> str:
    return path if len(path) <= limit else f"{path[:limit]}..."
