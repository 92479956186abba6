"""Optional dependencies ("extras") and the one error a missing one raises: ``MissingExtra``.

``pip install stallfree`` brings what every path needs; some paths need more (the cluster cache
needs redis, ``bench --plot`` matplotlib, ``shard --tokenizer`` tokenizers, ...). Those paths
import their library through ``require``, so a missing one is an error that names the extra to
install rather than a bare ``ModuleNotFoundError`` from deep inside: the CLI prints it as one line,
and library callers can still catch it as the ``ImportError`` it is. ``EXTRAS`` is the one table
of what each extra brings (``pyproject.toml``'s ``[project.optional-dependencies]``, kept equal by
``tests/cli/test_extras.py``); ``stallfree doctor`` reports from it. Imports nothing of ours.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import re
from types import ModuleType


@dataclasses.dataclass(frozen=True)
class Extra:
    """One pip extra: its ``name`` (``stallfree[name]``), the requirements it installs, the import
    names they provide, and what needs it."""

    name: str
    requirements: tuple[str, ...]
    modules: tuple[str, ...]
    purpose: str
    # for extras that provide the same module (the DALI builds): the case this one is for, said
    # when another is named, so a missing module does not send everyone to the first one
    for_case: str = ""

    def installed(self) -> bool:
        """Whether every distribution the extra installs is here (by its metadata, so the two DALI
        extras, which provide the same module, are told apart) and its modules can be found."""
        return all(_distribution_version(r) is not None for r in self.requirements) and all(
            _findable(module) for module in self.modules
        )

    def versions(self) -> dict[str, str | None]:
        """Each requirement's distribution name -> its installed version (None: not installed)."""
        return {_distribution_name(r): _distribution_version(r) for r in self.requirements}


_TORCH_CUDA = 'python -c "import torch; print(torch.version.cuda)"'  # which CUDA torch is built for

EXTRAS: dict[str, Extra] = {
    extra.name: extra
    for extra in (
        Extra(
            "dali",
            ("nvidia-dali-cuda120>=1.30",),
            ("nvidia.dali",),
            "GPU decode with DALI (for torch built for CUDA 12)",
            f"torch built for CUDA 12 ({_TORCH_CUDA})",
        ),
        Extra(
            "dali-cuda13",
            ("nvidia-dali-cuda130>=1.51",),
            ("nvidia.dali",),
            "GPU decode with DALI (for torch built for CUDA 13)",
            f"torch built for CUDA 13 ({_TORCH_CUDA})",
        ),
        Extra("redis", ("redis>=5",), ("redis",), "the cluster cache (ClusterCache, stallfree cache)"),
        # s3fs's own dependencies too: our S3 session code (storage/remote.py with_session)
        # imports aiobotocore before fsspec ever imports s3fs, and without the extra neither is here
        Extra("s3", ("s3fs>=2023.6",), ("s3fs", "aiobotocore", "botocore"), "reading s3:// URLs"),
        Extra("fast", ("simplejpeg>=1.7",), ("simplejpeg",), "ImageDecode(jpeg_library='simplejpeg')"),
        Extra("plot", ("matplotlib>=3.7",), ("matplotlib",), "stallfree bench --plot"),
        Extra(
            "tokens", ("tokenizers>=0.19",), ("tokenizers",), "tokenizing text (stallfree shard --tokenizer)"
        ),
        Extra(
            "hf",
            ("transformers>=5.25", "accelerate>=1.16"),
            ("transformers", "accelerate"),
            "stallfree.integrations (transformers Trainer, accelerate)",
        ),
        Extra(
            "spark",
            ("pyspark>=3.5",),
            ("pyspark",),
            "sharding on Spark (stallfree shard --engine spark, stallfree.shards.write_spark)",
        ),
        Extra(
            "ray",
            ("ray>=2.40",),
            ("ray",),
            "remote workers on a Ray cluster (stallfree.RayWorkers, DataLoader(remote=...))",
        ),
    )
}


class MissingExtra(ImportError):
    """``purpose`` needs ``module``, which extra ``extra`` installs. Survives pickling (a worker's
    error reaches the main process with its fields)."""

    def __init__(self, module: str, extra: str, purpose: str) -> None:
        self.module, self.extra, self.purpose = module, extra, purpose
        requirements = EXTRAS[extra].requirements if extra in EXTRAS else ()
        direct = f" (or: pip install {' '.join(repr(r) for r in requirements)})" if requirements else ""
        others = "".join(
            f"; or, for {other.for_case}: pip install 'stallfree[{other.name}]'"
            for other in _alternatives(extra)
        )
        super().__init__(
            f"{purpose} needs {module}: pip install 'stallfree[{extra}]'{direct}{others}", name=module
        )

    def __reduce__(self):
        return (type(self), (self.module, self.extra, self.purpose))


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """``import module`` for ``purpose``; ``MissingExtra`` naming ``extra`` when it is not installed.

    Only the missing module itself is turned into ``MissingExtra``: an installed library that
    fails to import for another reason (a missing system library, a broken install) keeps its own
    error, which says more than "install the extra" would."""
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; known: {', '.join(EXTRAS)}")
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or not _is_part_of(exc.name, module):
            raise
        raise MissingExtra(module, extra, purpose) from exc


def missing_extra_of(exc: BaseException) -> MissingExtra | None:
    """The ``MissingExtra`` behind ``exc``: ``exc`` itself, or a ``ModuleNotFoundError`` for a
    module an extra provides anywhere in its cause/context chain (a library we call, such as fsspec
    opening an ``s3://`` URL, raises its own ImportError from the missing module's). None when
    ``exc`` is no missing extra."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, MissingExtra):
            return current
        if isinstance(current, ModuleNotFoundError) and current.name:
            found = _extra_of(current.name)
            if found is not None:
                extra, module = found
                return MissingExtra(module, extra, EXTRAS[extra].purpose)
        current = current.__cause__ or current.__context__
    return None


def _alternatives(extra: str) -> list[Extra]:
    """The other extras that provide one of ``extra``'s modules and say which case they are for."""
    if extra not in EXTRAS:
        return []
    modules = set(EXTRAS[extra].modules)
    return [e for e in EXTRAS.values() if e.name != extra and e.for_case and modules & set(e.modules)]


def _extra_of(missing: str) -> tuple[str, str] | None:
    """(extra, its module) for a missing ``missing`` (the module, one of its parent packages or
    submodules); the first in ``EXTRAS`` wins (the CUDA 12 DALI extra for ``nvidia.dali``)."""
    for extra in EXTRAS.values():
        for module in extra.modules:
            if _is_part_of(missing, module) or _is_part_of(module, missing):
                return extra.name, module
    return None


def _is_part_of(missing: str, module: str) -> bool:
    """Whether a ModuleNotFoundError for ``missing`` means ``module`` is absent: the module
    itself or one of its parent packages (``nvidia`` for ``nvidia.dali``)."""
    return missing == module or module.startswith(missing + ".")


def _distribution_name(requirement: str) -> str:
    """``"nvidia-dali-cuda120>=1.30"`` -> ``"nvidia-dali-cuda120"``."""
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0]


def _distribution_version(requirement: str) -> str | None:
    try:
        return importlib.metadata.version(_distribution_name(requirement))
    except importlib.metadata.PackageNotFoundError:
        return None


def _findable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a broken one
        return False


__all__ = ["EXTRAS", "Extra", "MissingExtra", "missing_extra_of", "require"]
