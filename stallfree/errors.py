"""Errors raised for bad shards and datasets; each names the shard, sample key and byte offset."""

from __future__ import annotations


class ShardError(Exception):
    """Base class: something is wrong with a dataset on disk (or behind a URL).

    ``shard``, ``key`` and ``offset`` are kept as attributes so callers (the loader's error
    policy, ``stallfree verify``) can report and count them without parsing the message.
    """

    def __init__(
        self,
        message: str,
        *,
        shard: str | None = None,
        key: str | None = None,
        offset: int | None = None,
    ) -> None:
        self.shard = shard
        self.key = key
        self.offset = offset
        self.reason = message
        where = self.where
        super().__init__(f"{message} ({where})" if where else message)

    @property
    def where(self) -> str:
        """``shard S, sample 'K', byte offset N``: the parts that are known (may be empty)."""
        parts = []
        if self.shard is not None:
            parts.append(f"shard {self.shard}")
        if self.key is not None:
            parts.append(f"sample {self.key!r}")
        if self.offset is not None:
            parts.append(f"byte offset {self.offset}")
        return ", ".join(parts)

    def __reduce__(self):  # keep attributes across process boundaries (worker -> main)
        return (_rebuild, (type(self), self.reason, self.shard, self.key, self.offset))


def _rebuild(cls, reason, shard, key, offset):
    return cls(reason, shard=shard, key=key, offset=offset)


class CorruptShardError(ShardError):
    """A shard's bytes do not parse (bad tar header, truncated member, bad Arrow file)."""


class IndexMismatchError(ShardError):
    """An ``.idx`` file (or manifest count) disagrees with the shard it describes."""


class HashMismatchError(ShardError):
    """A shard's sha256 differs from the one recorded in the manifest."""


class ChecksumMismatchError(HashMismatchError):
    """One member's data differs from the checksum recorded when it was written (``sums.py``):
    names the shard, the sample key and the member's data offset."""


class MissingShardError(ShardError):
    """A shard named by the manifest (or pattern) does not exist."""


class ShardReadError(ShardError):
    """A shard could not be read (an I/O error, permissions): not known to be damaged."""


class RemoteReadError(ShardReadError):
    """A remote read did not deliver what was asked, after the retries ``shards.remote`` allows:
    a short or over-long body, a server error, an endpoint that refused or did not answer.

    Besides the base fields it keeps ``url`` (what was read, with the endpoint where the
    filesystem has one), the asked ``start``/``end`` (None for a whole-file read or a probe) and
    ``got`` (the bytes returned; None when the read failed outright), so a caller can tell a
    shrunk object from a dead server without parsing the message.
    """

    def __init__(
        self,
        message: str,
        *,
        shard: str | None = None,
        key: str | None = None,
        offset: int | None = None,
        url: str | None = None,
        start: int | None = None,
        end: int | None = None,
        got: int | None = None,
    ) -> None:
        self.url, self.start, self.end, self.got = url, start, end, got
        super().__init__(message, shard=shard, key=key, offset=offset)

    def __reduce__(self):
        return (
            _rebuild_remote,
            (self.reason, self.shard, self.key, self.offset, self.url, self.start, self.end, self.got),
        )


def _rebuild_remote(reason, shard, key, offset, url, start, end, got):
    return RemoteReadError(
        reason, shard=shard, key=key, offset=offset, url=url, start=start, end=end, got=got
    )


class ManifestError(ShardError):
    """``manifest.json`` is missing fields, malformed, or of an unknown format version."""


class DuplicateKeyError(ShardError):
    """Two samples in one shard share a key."""


class WriteError(ShardError):
    """The destination cannot be written (permissions, missing bucket, disk full)."""


class DatasetExistsError(WriteError):
    """The destination already holds a dataset and replacing it was not asked for.

    How to ask depends on the caller: Python passes ``overwrite=True``, the command line says
    ``--overwrite``. ``str(exc)`` names the Python argument; ``advice(option)`` gives the same
    message naming another spelling, so the CLI can say ``--overwrite`` and neither caller reads
    the other's vocabulary."""

    PYTHON_OPTION = "overwrite=True"

    def __init__(
        self,
        message: str,
        *,
        shard: str | None = None,
        key: str | None = None,
        offset: int | None = None,
    ) -> None:
        super().__init__(message, shard=shard, key=key, offset=offset)
        self.args = (self.advice(self.PYTHON_OPTION),)

    def advice(self, option: str) -> str:
        """The message, ending in how to replace the dataset with ``option``."""
        where = f" ({self.where})" if self.where else ""
        return f"{self.reason}{where}; pass {option} to replace it"


class SampleDecodeError(ShardError):
    """A sample's field could not be decoded (corrupt image, wrong type)."""


class BatchDecodeError(Exception):
    """A batch decoder (``decode_batch``) found bad samples.

    ``failures`` lists ``(position_in_batch, sample_key, cause)``. The loader applies its
    ``on_error`` policy: raise, or drop those samples (counted against the failure budget) and
    decode the rest again.
    """

    def __init__(self, failures: list[tuple[int, str, BaseException]]) -> None:
        self.failures = list(failures)
        keys = ", ".join(f"{key!r} ({type(exc).__name__}: {exc})" for _, key, exc in self.failures[:5])
        more = f" and {len(self.failures) - 5} more" if len(self.failures) > 5 else ""
        super().__init__(f"{len(self.failures)} sample(s) failed to decode: {keys}{more}")

    def __reduce__(self):
        return (BatchDecodeError, (self.failures,))
