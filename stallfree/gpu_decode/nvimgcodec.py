"""nvImageCodec backend: NVIDIA's codec library decodes only each crop box, torch resizes on the GPU.

Why a second GPU backend beside DALI: DALI's CUDA 13 wheel is about 200 MB; nvImageCodec
(``nvidia-nvimgcodec-cu13``, 25 MB) plus the nvJPEG runtime (``nvidia-nvjpeg``, 4 MB) gives the
same decoders — the GPU's hardware JPEG engines (A100/H100 class), nvJPEG's CUDA decoder, and
libjpeg-turbo / OpenCV for what the GPU cannot take — without a graph framework around them.

One batch: each image's ``CodeStream`` gets the crop box drawn on the host (``augment.py``, the
same boxes every backend crops) as its region of interest, and one ``Decoder.decode`` call decodes
the whole batch, each image only as far as its box, on the current torch stream. nvImageCodec
spreads the batch over the backends we allow: a share ``hw_decoder_load`` to the hardware decoder
where the GPU has one, the rest (and whatever the hardware refuses) to nvJPEG's hybrid CPU/GPU
decoder, then the CPU decoders (PNG, CMYK, ...). A sample that no decoder could decode comes back
as ``None``: that is a per-sample failure, reported by position, not a failed batch.

Each decoded region (uint8 HWC in device memory) is wrapped as a torch tensor through
``__cuda_array_interface__`` (no copy) and resized to ``size`` x ``size`` by
``torch.nn.functional.interpolate(mode="bilinear", antialias=True)`` — the same antialiased
bilinear filter as PIL's, which the CPU backend uses — then mirrored where the box says so. Pixels
are rounded to uint8 values before normalising, so the float output equals normalising the uint8
output, as on the other backends. EXIF orientation is not applied: the boxes are in the stored
pixel grid that ``header.probe`` reads, as on the CPU backend.

``device_id=None`` runs nvImageCodec's CPU decoders and torch on the CPU: slower, but it lets the
same code path be exercised on a machine without a GPU.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .augment import Box
from .backend import Alloc, BackendBase, BackendOptions, Failures, OutputSpec
from .header import ImageInfo
from .normalize import normalize
from .registry import NVIMGCODEC_HINT as INSTALL_HINT

log = logging.getLogger(__name__)


def nvimgcodec_available() -> bool:
    """Whether nvImageCodec is installed, without importing it (the import loads every codec
    extension it ships, which forked loader workers would then carry even when it is not used)."""
    try:
        return importlib.util.find_spec("nvidia.nvimgcodec") is not None
    except (ImportError, ValueError):  # "nvidia" itself missing or broken
        return False


@functools.cache
def nvimgcodec_importable() -> bool:
    """Whether nvImageCodec imports (its native library loads), asked only when ``auto`` would pick
    it: on a GPU machine without DALI, where it is then imported anyway."""
    if not nvimgcodec_available():
        return False
    try:
        _module()
    except (ImportError, OSError) as exc:
        log.warning("nvImageCodec is installed but does not import: %s", exc)
        return False
    return True


def _module() -> Any:
    try:
        from nvidia import nvimgcodec
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT} ({exc})") from None
    return nvimgcodec


class NvImageCodecDecoder(BackendBase):
    """Batched region-of-interest decode with nvImageCodec, then resize + flip + normalise in torch."""

    name = "nvimgcodec"
    runs_in_workers = False

    def __init__(self, spec: OutputSpec, options: BackendOptions) -> None:
        if not nvimgcodec_available():
            raise ImportError(INSTALL_HINT)
        # GPU batches come from torch's caching allocator; the base's buffer pool is there for
        # stats() (and stays empty), as on the DALI backend.
        super().__init__(spec, options)
        self.mean, self.std = list(spec.mean), list(spec.std)
        self.device_id = options.device_id
        self.num_threads = options.num_threads
        self.hw_decoder_load = options.hw_decoder_load
        self.batch_retries = 0  # batches nvImageCodec raised on, re-decoded one image at a time
        self._decoder: Any = None
        self._params: Any = None
        self._lock = threading.Lock()

    def stats(self) -> dict:
        return {
            **super().stats(),
            "nvimgcodec_backends": self.backends,
            "nvimgcodec_batch_retries": self.batch_retries,
            "hw_decoder_load": self.hw_decoder_load,
        }

    @property
    def backends(self) -> list[str]:
        """The nvImageCodec backend kinds this decoder allows, in the order they are offered work."""
        kinds = ["cpu_only"] if self.device_id is None else ["hybrid_cpu_gpu", "gpu_only", "cpu_only"]
        if self.device_id is not None and self.hw_decoder_load > 0:
            kinds.insert(0, "hw_gpu_only")
        return kinds

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_decoder"] = state["_params"] = None
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def close(self) -> None:
        self._decoder = None

    def _build(self) -> Any:
        nv = _module()
        kind = {
            "hw_gpu_only": nv.BackendKind.HW_GPU_ONLY,
            "hybrid_cpu_gpu": nv.BackendKind.HYBRID_CPU_GPU,
            "gpu_only": nv.BackendKind.GPU_ONLY,
            "cpu_only": nv.BackendKind.CPU_ONLY,
        }
        # The hardware decoder takes its share of each batch (load_hint); what it leaves or
        # refuses falls through to the next allowed backend.
        backends = [
            nv.Backend(kind[k], load_hint=self.hw_decoder_load) if k == "hw_gpu_only" else nv.Backend(kind[k])
            for k in self.backends
        ]
        device = nv.NVIMGCODEC_DEVICE_CPU_ONLY if self.device_id is None else self.device_id
        self._decoder = nv.Decoder(device_id=device, max_num_cpu_threads=self.num_threads, backends=backends)
        self._params = nv.DecodeParams(
            apply_exif_orientation=False, color_spec=nv.ColorSpec.SRGB, sample_format=nv.SampleFormat.I_RGB
        )
        return self._decoder

    def decode(
        self,
        datas: Sequence[bytes],
        infos: Sequence[ImageInfo],
        boxes: Sequence[Box],
        *,
        alloc: Alloc | None = None,
    ) -> tuple[torch.Tensor, Failures]:
        """(batch, [(position, error)]); failed positions hold zeros. The batch is normalised
        (x - mean) / std in float dtypes, the crop-resized pixels as they are in uint8. ``infos``
        and ``alloc`` are not needed: nvImageCodec reads the headers and the batch is on the GPU."""
        if len(datas) != len(boxes):
            raise ValueError(f"{len(datas)} images but {len(boxes)} boxes")
        with self._lock:  # one nvImageCodec decoder: batches must not interleave between threads
            if self.device_id is None:
                return self._decode_locked(datas, boxes)
            with torch.cuda.device(self.device_id):
                return self._decode_locked(datas, boxes)

    def _decode_locked(
        self, datas: Sequence[bytes], boxes: Sequence[Box]
    ) -> tuple[torch.Tensor, list[tuple[int, BaseException]]]:
        nv = _module()
        decoder = self._decoder if self._decoder is not None else self._build()
        n, s = len(datas), self.size
        failures: list[tuple[int, BaseException]] = []
        sources: list[Any] = []
        where: list[int] = []
        for i, (data, box) in enumerate(zip(datas, boxes, strict=True)):
            try:
                sources.append(_region(nv, data, box))
                where.append(i)
            except (RuntimeError, ValueError) as exc:
                failures.append((i, exc if isinstance(exc, ValueError) else _parse_error(exc)))
        stream = torch.cuda.current_stream(self.device) if self.device_id is not None else None
        images = self._run(decoder, sources, stream)
        # Resize in float32 on the 0-255 scale; rounded to pixel values below.
        pixels = torch.zeros((n, 3, s, s), dtype=torch.float32, device=self.device)
        for i, image in zip(where, images, strict=True):
            if image is None:
                failures.append(
                    (i, RuntimeError("nvImageCodec could not decode it (every allowed decoder failed)"))
                )
                continue
            hwc = self._wrap(image)
            if hwc.dim() != 3 or hwc.shape[2] != 3:
                failures.append((i, RuntimeError(f"nvImageCodec returned {tuple(hwc.shape)}, not H x W x 3")))
                continue
            chw = hwc.permute(2, 0, 1).unsqueeze(0).float()
            resized = F.interpolate(chw, size=(s, s), mode="bilinear", align_corners=False, antialias=True)[0]
            pixels[i] = resized.flip(-1) if boxes[i].flip else resized
        out = pixels.round_().clamp_(0.0, 255.0).to(torch.uint8)
        if self.dtype != torch.uint8:  # the CPU decoder's arithmetic, on this device
            out = normalize(out, self.mean, self.std, self.dtype)
        if failures:
            out[[i for i, _ in failures]] = 0
        if stream is not None:
            # nvImageCodec frees each image's buffer when its Python object goes; let the kernels
            # reading them finish first (this blocks only the decode thread, not the training step).
            stream.synchronize()
        del images
        return out, sorted(failures, key=lambda f: f[0])

    def _run(self, decoder: Any, sources: list[Any], stream: torch.cuda.Stream | None) -> list[Any]:
        """Decode the batch; if nvImageCodec raises for the whole batch, decode one at a time so
        that only the images that cause it fail."""
        if not sources:
            return []
        handle = stream.cuda_stream if stream is not None else 0
        try:
            return list(decoder.decode(sources, params=self._params, cuda_stream=handle))
        except RuntimeError as exc:
            log.warning("nvImageCodec batch of %d failed, decoding one at a time: %s", len(sources), exc)
            self.batch_retries += 1
        images: list[Any] = []
        for src in sources:
            try:
                images.append(decoder.decode(src, params=self._params, cuda_stream=handle))
            except RuntimeError:
                images.append(None)
        return images

    def _wrap(self, image: Any) -> torch.Tensor:
        """The decoded region as a uint8 HWC tensor sharing nvImageCodec's buffer (rows may be
        padded: the strides say so)."""
        if self.device_id is None:
            return torch.from_numpy(np.asarray(image))
        return torch.as_tensor(image, device=self.device)


def _region(nv: Any, data: bytes, box: Box) -> Any:
    """A code stream limited to ``box``: nvImageCodec then decodes only that region."""
    stream = nv.CodeStream(data)
    if not (0 <= box.x and 0 <= box.y and box.w > 0 and box.h > 0) or (
        box.x + box.w > stream.width or box.y + box.h > stream.height
    ):
        raise ValueError(f"crop box {tuple(box)[:4]} outside the {stream.width}x{stream.height} image")
    return stream.get_sub_code_stream(region=nv.Region(box.y, box.x, box.y + box.h, box.x + box.w))


def _parse_error(exc: RuntimeError) -> RuntimeError:
    return RuntimeError(f"nvImageCodec cannot read the image's header: {exc}")
