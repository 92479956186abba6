"""``ImageDecode``: the loader's ``decode=`` object; picks a backend and turns sample dicts into a batch.

Backend choice (``backend="auto"``):
1. DALI with ``device="mixed"`` on the rank's GPU, when CUDA and DALI are both present;
2. nvImageCodec (region decode, hardware JPEG decoder where present) on the rank's GPU, when CUDA
   is present, DALI is not, and nvImageCodec imports;
3. otherwise the DALI-free CPU decoder. DALI's CPU operators are used only when asked for
   (``backend="dali"`` without a GPU): in benchmarks/bench_peers.py, side by side on the same
   ImageNet-like JPEGs, our CPU decoder (the region-of-interest C decoder) used ~1.35x less CPU
   per image than DALI's own CPU pipeline and than simplejpeg in torch's DataLoader, and was
   ~1.4x faster in img/s (benchmarks/RESULTS.md, "Decode + augment"), so the slower paths are not
   auto-picked. Whether the GPU backends beat it is measured by benchmarks/gpu_check.sh where a
   GPU is lent; on a GPU the rule assumes they do (they also free the CPU for the training step).
``stats()["backend"]`` and ``stats()["reason"]`` say which ran and why.

What an image is, the same for every backend: its pixels as stored, the size ``header.probe``
reads, on which ``augment.py`` draws the box. EXIF orientation is not applied (DALI is told not
to, ``adjust_orientation=False``; nvImageCodec ``apply_exif_orientation=False``; PIL and the C
decoder never do), as torchvision's ``ImageFolder`` and ``decode_jpeg`` do by default. Applying it
in one backend only drew boxes on one size and cropped another: DALI failed orientations 5-8 on
every image and cropped 2-4 differently from the CPU (tests/gpu_decode/test_orientation.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..shards.errors import BatchDecodeError, SampleDecodeError
from ..shards.fields import IMAGE_FIELDS
from . import registry
from .augment import IMAGENET_MEAN, IMAGENET_STD, Box, Preset
from .backend import Backend, BackendOptions, OutputSpec
from .header import (
    DEFAULT_MAX_MEMORY,
    DEFAULT_MAX_PIXELS,
    DEFAULT_MAX_SCANS,
    BadImageError,
    ImageInfo,
    probe,
)
from .normalize import normalize
from .sample_fields import DEFAULT_LABEL_FIELD, check_label_field, class_field_of, passthrough, read_label

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "uint8": torch.uint8,
    torch.float32: torch.float32,
    torch.float16: torch.float16,
    torch.uint8: torch.uint8,
}


class ImageDecode:
    """Decode + augment a batch of raw samples into ``{"image", "label", "__key__", ...}``.

    ``image``: ``[N, 3, size, size]`` tensor (on the GPU for the DALI mixed backend): normalised
    ``(x - mean) / std`` for float dtypes; for ``dtype="uint8"`` the crop-resized pixels as they are,
    to normalise yourself (``stallfree.normalize(batch["image"])``, e.g. on the GPU in the training
    step); ``label``: int64 ``[N]`` from the label field, on the same device; ``__key__``: the
    sample keys; every other field of the samples under its own name, collated (a tensor of
    numbers or same-shaped arrays, a list of ``bytes``/``str``, else a list; sample_fields.py).
    ``train`` picks random-resized-crop + flip (random per ``seed`` passed by the loader and per
    sample key) or resize + centre crop.

    ``label_field``: the field holding each sample's integer class. None (the default): the
    ``class_field`` of the dataset's manifest (``stallfree shard`` records it for Hugging Face
    ``ClassLabel`` columns), learnt by ``for_dataset(ds)`` (or by the loader's ``bind_dataset``
    call), else ``"cls"``; ``False``: no labels (no ``label`` in the batch). A sample without the
    field is a decode error naming its key and its fields.

    ``transfer="uint8"`` with a float ``dtype``: the CPU backend's workers write uint8 pixels, a
    quarter of the bytes through shared memory and over PCIe, and the loader normalises them into
    ``dtype`` where it is cheapest: on the GPU right after the copy, on the copy stream, when the
    loader has ``device=``; otherwise in the main process before the batch is handed over. Values
    equal ``transfer=None``'s (bit for bit on the CPU, float rounding on the GPU).

    ``device``: the GPU to decode on (default: torch's current device, which each rank sets with
    ``torch.cuda.set_device(local_rank)``); ``"cpu"`` keeps everything on the CPU. ``num_threads``:
    decode threads (default: the cores this process may use). ``hw_decoder_load``: share of JPEGs
    sent to the GPU's hardware decoder (A100/H100 class), the rest to nvJPEG's CUDA decoder.
    ``reuse_buffers``: CPU output batches kept for reuse once the consumer drops them (0: none).
    ``max_pixels``: larger images (by their header) fail their sample before any decoder sees them,
    as do headers claiming more pixels than the file's data can hold (see header.py). The default is
    PIL's ``Image.MAX_IMAGE_PIXELS`` (89,478,485, about 9459 x 9459); None: no limit of ours (the CPU
    backend still meets PIL's own, twice ``Image.MAX_IMAGE_PIXELS``, process-wide).
    ``max_scans``: JPEGs with more scans fail their sample (each scan of a progressive JPEG is one
    more pass over the whole image; encoders write about 10). ``max_memory``: so do JPEGs whose
    decode must hold more bytes of coefficient buffers (progressive files: about 6 bytes a pixel at
    4:4:4, 3 at 4:2:0), for every backend, by the header (see header.py). None: no such limit.
    """

    def __init__(
        self,
        train: bool = True,
        size: int = 224,
        backend: str = "auto",
        *,
        dtype: str | torch.dtype = "float32",
        transfer: str | torch.dtype | None = None,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        flip_p: float = 0.5,
        resize_size: int | None = None,
        image_field: str | None = None,
        label_field: str | None | bool = None,
        device: str | torch.device | int | None = None,
        num_threads: int | None = None,
        hw_decoder_load: float = 0.65,
        jpeg_library: str = "auto",
        reuse_buffers: int = 4,
        max_pixels: int | None = DEFAULT_MAX_PIXELS,
        max_scans: int | None = DEFAULT_MAX_SCANS,
        max_memory: int | None = DEFAULT_MAX_MEMORY,
    ) -> None:
        for name, limit in (("max_pixels", max_pixels), ("max_scans", max_scans), ("max_memory", max_memory)):
            if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
                raise ValueError(f"{name} must be a positive int or None, got {limit!r}")
        if backend != "auto":
            registry.entry(backend)  # ValueError naming the registered backends
        check_label_field(label_field)
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'float32', 'float16' or 'uint8', got {dtype!r}")
        if transfer is not None and _DTYPES.get(transfer) != torch.uint8:
            raise ValueError(f"transfer must be None or 'uint8', got {transfer!r}")
        spec = OutputSpec(size, tuple(mean), tuple(std), _DTYPES[dtype])
        self.preset = Preset(
            train=train, size=size, scale=scale, ratio=ratio, flip_p=flip_p, resize_size=resize_size
        )
        self.dtype = spec.dtype
        self.mean, self.std = spec.mean, spec.std
        self.image_field = image_field
        self.label_field = label_field
        self._class_field: str | None = None  # the bound dataset's manifest's, for label_field=None
        self._bound_by_loader = False  # a loader (or mixture) bound it: another binding must agree
        self.max_pixels = max_pixels
        self.max_scans = max_scans
        self.max_memory = max_memory
        threads = num_threads if num_threads is not None else _cpu_count()
        self._threads_given = num_threads is not None
        gpu_id = _gpu_id(device)
        self.backend, self.reason = _choose(backend, gpu_id, jpeg_library)
        cls = registry.backend_class(self.backend)
        if transfer is not None and cls.runs_in_workers:  # only a worker-run backend has a transfer to shrink
            spec = dataclasses.replace(spec, dtype=_DTYPES[transfer])
        options = BackendOptions(
            # a CPU backend, or a GPU backend without CUDA (its CPU operators), gets no device
            device_id=gpu_id if torch.cuda.is_available() and registry.entry(self.backend).gpu else None,
            num_threads=threads,
            hw_decoder_load=hw_decoder_load,
            jpeg_library=jpeg_library,
            reuse_buffers=reuse_buffers,
            max_scans=max_scans,
            max_memory=max_memory,
        )
        self._decoder: Backend = cls(spec, options)
        self.device = self._decoder.device
        self._stats = {"batches": 0, "images": 0, "failures": 0, "decode_s": 0.0}

    def bind_dataset(self, dataset: Any) -> None:
        """Learn what the dataset's manifest says about its fields (its ``class_field``, used
        when ``label_field`` is None). The loader's (and a mixture's) hook.

        Every loader given this object runs it (its workers get copies made after the binding),
        so a second loader over a dataset whose labels are in another field would relabel the
        first loader's batches: that is refused, naming both fields."""
        field = class_field_of(dataset)
        if self._bound_by_loader and self.label_field is None and field != self._class_field:
            raise ValueError(
                f"this ImageDecode already reads labels from {self._class_field or DEFAULT_LABEL_FIELD!r} "
                f"for the dataset a loader gave it; this dataset's are in {field or DEFAULT_LABEL_FIELD!r}. "
                "Every loader runs the one decoder object: give each dataset its own ImageDecode, or name "
                "label_field= where both datasets keep their labels in the same field"
            )
        self._class_field = field
        self._bound_by_loader = True

    def for_dataset(self, dataset: Any) -> ImageDecode:
        """``self``, labelled as ``dataset``'s manifest says: ``DataLoader(ds,
        decode=ImageDecode(...).for_dataset(ds))``. An explicit rebinding: unlike a loader's
        ``bind_dataset`` it replaces whatever was bound before."""
        self._class_field = class_field_of(dataset)
        self._bound_by_loader = False
        return self

    @property
    def resolved_label_field(self) -> str | None:
        """The field labels are read from (None: no labels): ``label_field`` when named, else the
        bound manifest's ``class_field``, else ``"cls"``."""
        if self.label_field is False:
            return None
        if isinstance(self.label_field, str):
            return self.label_field
        return self._class_field or DEFAULT_LABEL_FIELD

    @property
    def needs_finish(self) -> bool:
        """Whether decoded batches still need ``finish`` (uint8 transfer into a float dtype)."""
        return self._decoder.dtype != self.dtype

    def finish(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Normalise a transferred uint8 batch into ``dtype``, where it now is (the loader calls
        this after its device copy, on the copy stream)."""
        if not self.needs_finish or batch["image"].dtype != torch.uint8:
            return batch
        return dict(batch, image=normalize(batch["image"], self.mean, self.std, self.dtype))

    @property
    def runs_in_workers(self) -> bool:
        """Whether the backend may run in the loader's worker processes (the CPU decoder: each
        worker decodes the batches it reads, into shared memory); GPU backends stay in the main
        process, which owns the device."""
        return self._decoder.runs_in_workers

    @property
    def restarts_threads(self) -> bool:
        """Whether ``close()`` only stops the decode threads, a later batch starting them again
        (the CPU decoder): the loader may then decode its first batch in the main process and
        fork its workers after (loader/first_batch_inline.py)."""
        return self._decoder.runs_in_workers

    def use_threads(self, n: int) -> None:
        """Set by a loader worker to its share of the cores, unless ``num_threads`` was given."""
        if not self._threads_given:
            self._decoder.use_threads(n)

    def decode_batch(
        self, samples: Sequence[dict], *, seed: int, alloc: Callable[..., torch.Tensor | None] | None = None
    ) -> dict[str, Any]:
        """Decode ``samples``; raises ``BatchDecodeError`` naming every bad sample (none decoded then).

        Every image passes ``header.probe`` here first, whichever backend decodes it: the one place
        where truncated, implausible, over-``max_pixels``, over-``max_scans`` and over-``max_memory``
        images are refused.

        ``alloc(shape, dtype)``: where the CPU decoder writes the image batch (a loader worker's
        shared slot); None, or a None result, uses the decoder's own reused buffers."""
        t0 = time.perf_counter()
        keys = [str(s.get("__key__", i)) for i, s in enumerate(samples)]
        label_field = self.resolved_label_field
        from_manifest = self.label_field is None and self._class_field is not None
        failures: list[tuple[int, str, BaseException]] = []
        datas: list[bytes] = []
        infos: list[ImageInfo] = []
        boxes: list[Box] = []
        labels: list[int] = []
        good: list[int] = []
        consumed: set[str] = set() if label_field is None else {label_field}
        for i, (sample, key) in enumerate(zip(samples, keys, strict=True)):
            try:
                field, data = self._image_bytes(sample)
                if label_field is not None:
                    labels.append(read_label(sample, label_field, from_manifest=from_manifest))
                consumed.add(field)
                info = probe(data, self.max_pixels, max_scans=self.max_scans, max_memory=self.max_memory)
            except (BadImageError, KeyError, TypeError, ValueError) as exc:
                failures.append((i, key, SampleDecodeError(str(exc).strip("'\""), key=key)))
                continue
            datas.append(data)
            infos.append(info)
            boxes.append(self.preset.box(info.width, info.height, seed, key))
            good.append(i)
        if good:
            images, bad = self._decoder.decode(datas, infos, boxes, alloc=alloc)
            for j, exc in bad:
                i = good[j]
                failures.append((i, keys[i], SampleDecodeError(f"cannot decode image: {exc}", key=keys[i])))
        if failures:
            self._stats["failures"] += len(failures)
            raise BatchDecodeError(sorted(failures, key=lambda f: f[0]))
        if not good:
            images = torch.empty(
                (0, 3, self.preset.size, self.preset.size), dtype=self._decoder.dtype, device=self.device
            )
        out: dict[str, Any] = {"image": images}
        if label_field is not None:
            label_t = torch.tensor(labels, dtype=torch.int64)
            if self.device.type != "cpu":
                label_t = label_t.to(self.device, non_blocking=True)
            out["label"] = label_t
        out["__key__"] = keys
        out.update(passthrough(samples, consumed, tuple(out), self.device))
        self._stats["batches"] += 1
        self._stats["images"] += len(samples)
        self._stats["decode_s"] += time.perf_counter() - t0
        return out

    def stats(self) -> dict[str, Any]:
        s = dict(self._stats)
        s["images_per_s"] = s["images"] / s["decode_s"] if s["decode_s"] > 0 else 0.0
        s.update(
            backend=self.backend, reason=self.reason, device=str(self.device), preset=self._preset_name()
        )
        s.update(self._decoder.stats())
        return s

    def close(self) -> None:
        self._decoder.close()

    def _preset_name(self) -> str:
        return "train" if self.preset.train else "eval"

    def _image_bytes(self, sample: dict) -> tuple[str, bytes]:
        """(the image field, its encoded bytes)."""
        field = self.image_field
        if field is None:
            field = next((f for f in IMAGE_FIELDS if f in sample), None)
            if field is None:
                raise KeyError(f"no image field (looked for {', '.join(IMAGE_FIELDS)}; set image_field=)")
        elif field not in sample:
            raise KeyError(f"no {field!r} field in sample")
        value = sample[field]
        if isinstance(value, bytes):
            return field, value
        if isinstance(value, (bytearray, memoryview)):
            return field, bytes(value)
        if isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.ndim == 1:
            return field, value.tobytes()
        if isinstance(value, dict) and isinstance(value.get("bytes"), bytes):
            return field, value["bytes"]  # a Hugging Face Image() cell {"bytes": ..., "path": ...}
        hint = ""
        if type(value).__module__.startswith("PIL."):  # a Hugging Face Image() column, decoded on access
            hint = (
                ": a Hugging Face Image() column decodes each image when read; "
                f"dataset.cast_column({field!r}, datasets.Image(decode=False)) hands over its encoded bytes"
            )
        raise TypeError(f"field {field!r} holds {type(value).__name__}, expected encoded image bytes{hint}")


def _choose(backend: str, gpu_id: int | None, jpeg_library: str = "auto") -> tuple[str, str]:
    """(backend name, why). A name is taken as given (ImportError with its install hint when it is
    missing); ``auto`` is the rule in the module docstring. Where auto picks the CPU backend the
    reason also says which JPEG decoder runs (``jpeg_info.jpeg_decoder``), and claims the measured
    speed only for the C decoder it was measured with."""
    has_cuda = torch.cuda.is_available() and gpu_id is not None
    if backend != "auto":
        entry = registry.entry(backend)
        if not registry.available(backend):
            raise ImportError(entry.install_hint or f"decode backend {backend!r} is not installed")
        why = f" (no CUDA: {entry.without_cuda})" if entry.gpu and not has_cuda else ""
        return backend, f"forced by backend={backend!r}{why}"  # stats()["jpeg_library"] says the rest
    has_dali = registry.available("dali")
    if has_dali and has_cuda:
        return "dali", f"auto: CUDA device {gpu_id} and DALI present -> DALI mixed (GPU) decode"
    if has_cuda and not has_dali and registry.usable("nvimgcodec"):
        return "nvimgcodec", (
            f"auto: CUDA device {gpu_id}, DALI not installed, nvImageCodec present -> nvImageCodec GPU decode"
        )
    if not has_cuda:  # no GPU to decode on: our CPU decoder beats DALI's CPU pipeline (RESULTS.md)
        why = "device is the CPU" if torch.cuda.is_available() else "no CUDA"
        return "cpu", f"auto: {why} -> CPU decoder; {_cpu_jpeg(jpeg_library)}"
    return "cpu", (
        f"auto: CUDA device {gpu_id} but DALI not installed and no nvImageCodec -> CPU decoder "
        f"(for GPU decode: pip install 'stallfree[dali-cuda13]', or 'stallfree[dali]' for a CUDA 12 torch); "
        f"{_cpu_jpeg(jpeg_library)}"
    )


def _cpu_jpeg(jpeg_library: str) -> str:
    """Which JPEG decoder the CPU backend runs, and what is known of its speed."""
    from .jpeg_info import jpeg_decoder

    if jpeg_library != "auto":
        return f"JPEGs through {jpeg_library} (jpeg_library={jpeg_library!r})"
    info = jpeg_decoder()
    if info.name == "turbo":
        return (
            "JPEGs through the region-of-interest C decoder, measured faster per image than DALI's own "
            "CPU pipeline and simplejpeg (benchmarks/RESULTS.md, Decode + augment)"
        )
    return f"JPEGs through PIL, slower than the C decoder the benchmarks measured: {info.reason}"


def _gpu_id(device: str | torch.device | int | None) -> int | None:
    """The CUDA device index to decode on: explicit, else the current one (each rank sets its own)."""
    if device is None:
        return torch.cuda.current_device() if torch.cuda.is_available() else None
    if isinstance(device, int):
        return device
    dev = torch.device(device)
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    if dev.index is not None:
        return dev.index
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def _cpu_count() -> int:
    import os

    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not on Linux
        return max(1, os.cpu_count() or 1)
