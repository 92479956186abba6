"""Sources made of plain files: an ImageFolder tree (``root/<class>/<image>``, labelled by class)
and files grouped by base name (``a.jpg`` + ``a.json`` -> one sample ``a``)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from stallfree.shards.fields import IMAGE_EXTENSIONS
from stallfree.shards.sources.base import (
    Item,
    Source,
    SourceError,
    normalize_field,
    read_file,
    safe_key,
    split_key_field,
    stat_size,
    walk_files,
)

log = logging.getLogger(__name__)


class ImageFolderSource(Source):
    """``root/<class>/.../<image>``: one sample per image with fields ``<ext>`` and ``cls`` (the
    class's index in sorted class-name order, as torchvision's ImageFolder numbers them)."""

    kind = "imagefolder"
    grouped = True

    def __init__(self, root: str | Path, *, on_error: str = "raise") -> None:
        super().__init__()
        self.root = Path(root)
        self.on_error = on_error
        self.classes = sorted(
            e.name for e in os.scandir(self.root) if e.is_dir() and not e.name.startswith(".")
        )
        if not self.classes:
            raise SourceError(
                f"{self.root} has no class sub-folders (ImageFolder layout: root/<class>/<image>)"
            )

    def _list(self) -> list[Item]:
        items: list[Item] = []
        seen: dict[str, str] = {}
        for idx, cls in enumerate(self.classes):
            base = os.path.join(str(self.root), cls)
            field_for: dict[str, str] = {}
            for rel in walk_files(Path(base)):
                stem, ext = os.path.splitext(rel)
                fieldname = field_for.get(ext)
                if fieldname is None:
                    if ext.lower() not in IMAGE_EXTENSIONS:
                        continue
                    fieldname = field_for[ext] = normalize_field(ext)
                path = f"{base}/{rel}"
                size = stat_size(path, self.on_error, self)
                if size is None:
                    continue
                key = f"{cls}/{safe_key(stem)}"
                if key in seen:
                    raise SourceError(f"{path} and {seen[key]} map to the same sample key {key!r}")
                seen[key] = path
                items.append(Item(path, (size, len(str(idx))), (key, fieldname, path, idx)))
        return items

    def read(self, item: Item) -> dict[str, Any]:
        key, fieldname, path, idx = item.ref
        return {"__key__": key, fieldname: read_file(path, key), "cls": idx}


class GroupedFilesSource(Source):
    """A directory of files grouped by base name: ``a.jpg`` + ``a.json`` -> one sample ``a`` with
    fields ``jpg`` and ``json`` (WebDataset's key/field split; sub-folders become key prefixes)."""

    kind = "files"
    grouped = True

    def __init__(self, root: str | Path, *, on_error: str = "raise") -> None:
        super().__init__()
        self.root = Path(root)
        self.on_error = on_error

    def _list(self) -> list[Item]:
        groups: dict[str, list[tuple[str, str]]] = {}
        for rel in walk_files(self.root):
            key, ext = split_key_field(rel)
            key = safe_key(key)
            if not key:
                log.debug("ignoring %s: no extension to name its field", rel)
                continue
            fields = groups.setdefault(key, [])
            fieldname = normalize_field(ext)
            if any(f == fieldname for f, _ in fields):
                raise SourceError(f"{self.root / rel}: sample {key!r} already has a field {fieldname!r}")
            fields.append((fieldname, str(self.root / rel)))
        items: list[Item] = []
        for key, fields in groups.items():
            sizes = [stat_size(path, self.on_error, self) for _, path in fields]
            if any(s is None for s in sizes):
                continue
            items.append(Item(fields[0][1], tuple(sizes), (key, tuple(fields))))  # type: ignore[arg-type]
        return items

    def read(self, item: Item) -> dict[str, Any]:
        key, fields = item.ref
        sample: dict[str, Any] = {"__key__": key}
        for fieldname, path in fields:
            sample[fieldname] = read_file(path, key)
        return sample
