"""The loader's own error types: each names the worker and the sample it was working on."""

from __future__ import annotations


class LoaderError(RuntimeError):
    """Base class for errors the loader raises about its own machinery."""


class WorkerDiedError(LoaderError):
    """A worker process exited while it owed the loader batches."""


class WorkerHungError(LoaderError):
    """A worker process made no progress on a sample for longer than the allowed time."""


class IteratorSupersededError(LoaderError):
    """A later ``iter()`` on a loader with persistent workers took over its one worker pool while
    this iterator was mid-epoch (torch resets its one iterator there); the rest of this
    iterator's epoch is not delivered."""


class TooManyOpenFilesError(LoaderError):
    """The process ran out of file descriptors (EMFILE): each batch kept alive holds one
    shared-memory descriptor. The message says how to raise the limit or keep fewer."""


class StateMismatchError(ValueError):
    """A resume state refused: saved for another dataset (length or fingerprint), or a position
    outside the epoch. A ValueError, as every bad state is."""


class FailureBudgetExceeded(LoaderError):
    """More samples failed than ``max_failures`` allows; ``failed`` lists ``(index, key, reason)``."""

    def __init__(self, message: str, failed: list[tuple[int, str, str]]) -> None:
        self.failed = list(failed)
        keys = ", ".join(repr(k) for _, k, _ in self.failed[:20])
        more = f" and {len(self.failed) - 20} more" if len(self.failed) > 20 else ""
        super().__init__(f"{message}; failed keys: {keys}{more}")

    def __reduce__(self):
        return (_rebuild_budget, (self.args[0], self.failed))


def _rebuild_budget(message: str, failed: list[tuple[int, str, str]]) -> FailureBudgetExceeded:
    err = FailureBudgetExceeded.__new__(FailureBudgetExceeded)
    RuntimeError.__init__(err, message)
    err.failed = failed
    return err
