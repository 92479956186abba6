"""DALI-free decoder: decode, crop, resize, flip and normalise each image in a thread pool.

Speed comes from decoding less, not from more threads. JPEGs go through our own libjpeg-turbo
extension (``_turbo.c``, ``jpeg_library="turbo"``, the default where it was built): it decodes only
the rows and iMCU columns the crop box's filter touches, at the smallest DCT scale (1/1, 1/2, 1/4,
1/8) that still covers the box at the output size, and resamples straight into the CHW output,
uint8 or normalised float32, in one call with the GIL released. Without the extension (no
compiler or libjpeg headers at install time), JPEGs go through PIL with ``Image.draft`` (the same
DCT scaling, whole image), or simplejpeg when asked; CMYK JPEGs, PNGs and other formats always
through PIL. All of them release the GIL, so a thread pool scales across cores; each image is
written straight into its row of a (reused, see buffers.py) batch tensor by the thread that
decoded it.

Interpolation is PIL's antialiased bilinear; DALI uses its own antialiased linear filter (and no
DCT scaling), so outputs differ slightly — measured in tests/gpu_decode/test_agreement.py.
"""

from __future__ import annotations

import io
import logging
import math
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from PIL import Image

from .augment import Box
from .backend import Alloc, BackendBase, BackendOptions, Failures, OutputSpec
from .header import BadImageError, ImageInfo
from .jpeg_info import JpegDecoder as JpegDecoder  # re-exported: stallfree.gpu_decode.cpu.jpeg_decoder()
from .jpeg_info import jpeg_decoder as jpeg_decoder

log = logging.getLogger(__name__)

try:  # optional: ``pip install stallfree[fast]``
    import simplejpeg
except ImportError:  # pragma: no cover - depends on the environment
    simplejpeg = None

try:  # built by setup.py where libjpeg-turbo's headers are present
    import stallfree.gpu_decode._turbo as _turbo
except ImportError:  # pragma: no cover - depends on the build
    _turbo = None

JPEG_LIBRARIES = ("auto", "turbo", "simplejpeg", "pil")


def turbo_available() -> bool:
    """Whether the region-of-interest JPEG extension was built into this install."""
    return _turbo is not None


_pil_fallback_warned = False


def _warn_pil_fallback() -> None:
    """One WARNING per process, the first time a JPEG goes through PIL because the C decoder is
    missing (not when PIL was asked for): a silent fallback costs several times the CPU per image."""
    global _pil_fallback_warned
    if _pil_fallback_warned:
        return
    _pil_fallback_warned = True
    log.warning("decoding JPEGs with PIL, not the C region-of-interest decoder: %s", jpeg_decoder().reason)


class CpuDecoder(BackendBase):
    """Decodes a batch of encoded images into a normalised ``[N, 3, size, size]`` tensor on the CPU.

    The one backend that runs in the loader's workers: picklable (its thread pool is rebuilt on
    first use), CPU only, and it writes into the worker's shared slot through ``alloc``."""

    name = "cpu"
    runs_in_workers = True

    def __init__(self, spec: OutputSpec, options: BackendOptions) -> None:
        super().__init__(spec, options)
        jpeg_library = options.jpeg_library
        if jpeg_library not in JPEG_LIBRARIES:
            raise ValueError(f"jpeg_library must be one of {', '.join(JPEG_LIBRARIES)}, got {jpeg_library!r}")
        if jpeg_library == "simplejpeg" and simplejpeg is None:
            raise ImportError("jpeg_library='simplejpeg' needs simplejpeg: pip install stallfree[fast]")
        if jpeg_library == "turbo" and _turbo is None:
            raise ImportError(
                "jpeg_library='turbo' needs stallfree's C extension, built at install time with a C "
                "compiler and libjpeg-turbo's headers (Debian: apt-get install gcc libjpeg62-turbo-dev)"
            )
        self.num_threads = options.num_threads  # a worker sets its share (use_threads)
        # "auto": the region decoder where built (benchmarks/RESULTS.md, "Decode + augment"), else
        # PIL: simplejpeg measured no faster end to end than PIL with draft (1.27 vs 1.16 ms/image
        # at ImageNet sizes), so it stays an explicit choice.
        self.pil_fallback = jpeg_library == "auto" and _turbo is None  # PIL because the C decoder is missing
        if jpeg_library == "auto":
            jpeg_library = "turbo" if _turbo is not None else "pil"
        self.jpeg_library = jpeg_library
        # header.probe has refused what is over these already; the C decoder checks them again
        # while it decodes (its progress monitor, libjpeg's memory limit), 0 meaning none.
        self._limits = {"max_scans": options.max_scans or 0, "max_memory": options.max_memory or 0}
        self._mean = list(spec.mean)
        self._inv_std = [1.0 / v for v in spec.std]
        self._mean_np = np.asarray(spec.mean, np.float32).reshape(3, 1, 1)
        self._inv_std_np = (1.0 / np.asarray(spec.std, np.float32)).reshape(3, 1, 1)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._local = threading.local()  # per decode thread: a one-image scratch buffer

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_pool"] = None
        del state["_pool_lock"], state["_local"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._pool_lock = threading.Lock()
        self._local = threading.local()

    def _thread_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="stallfree-decode")
            return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def use_threads(self, n: int) -> None:
        self.close()  # the next batch starts a pool of the new size
        self.num_threads = max(1, n)

    def stats(self) -> dict:
        return {**super().stats(), "jpeg_library": self.jpeg_library}

    def decode(
        self,
        datas: Sequence[bytes],
        infos: Sequence[ImageInfo],
        boxes: Sequence[Box],
        *,
        alloc: Alloc | None = None,
    ) -> tuple[torch.Tensor, Failures]:
        """(batch, [(position, error)]); failed positions hold zeros. The batch is normalised
        (x - mean) / std in float dtypes, the decoded pixels as they are in uint8.

        ``alloc(shape, dtype)`` gives the output tensor (a loader worker's shared slot); when it
        also has ``put_row(dst, src)``, each image is normalised into a small per-thread buffer and
        handed to it (which writes the slot without mapping it) instead of written in place."""
        n = len(datas)
        put_row = getattr(alloc, "put_row", None)
        shape = (n, 3, self.size, self.size)
        out = alloc(shape, self.dtype) if alloc is not None else None
        if out is None:  # uninitialised and, once the consumer dropped an earlier batch, reused
            out = self.buffers.tensor(shape, self.dtype)
        failures: list[tuple[int, BaseException]] = []

        def one(i: int) -> None:
            # put_row: into this thread's reused scratch (stays in cache), then into the slot
            dst = out[i] if put_row is None else self._scratch(out.shape[1:], out.dtype)
            try:
                self.decode_into(dst, datas[i], infos[i], boxes[i])
            except Exception as exc:  # every decoder error becomes a per-sample failure
                failures.append((i, exc))
                out[i].zero_()
                return
            if put_row is not None:
                put_row(out[i], dst)

        if n > 1 and self.num_threads > 1:
            list(self._thread_pool().map(one, range(n)))
        else:
            for i in range(n):
                one(i)
        return out, sorted(failures, key=lambda f: f[0])

    def _scratch(self, shape: tuple[int, ...], dtype: torch.dtype, name: str = "scratch") -> torch.Tensor:
        buf = getattr(self._local, name, None)
        if buf is None or tuple(buf.shape) != tuple(shape) or buf.dtype != dtype:
            buf = torch.empty(shape, dtype=dtype)
            setattr(self._local, name, buf)
        return buf

    def decode_into(self, dst: torch.Tensor, data: bytes, info: ImageInfo, box: Box) -> None:
        """One image into ``dst`` (``[3, size, size]``, contiguous, this decoder's dtype)."""
        if self.jpeg_library == "turbo" and info.format == "jpeg":
            if dst.dtype == torch.float16:  # the extension writes uint8 or float32: uint8, then here
                pixels = self._scratch(dst.shape, torch.uint8, "pixels")
                if self._turbo_into(pixels, data, box):
                    self.normalise_into(dst, pixels.numpy().transpose(1, 2, 0))
                    return
            elif self._turbo_into(dst, data, box):
                return
        elif self.pil_fallback and info.format == "jpeg":
            _warn_pil_fallback()
        self.normalise_into(dst, self.decode_one(data, info, box))

    def _turbo_into(self, dst: torch.Tensor, data: bytes, box: Box) -> bool:
        """Decode through the extension; False when it leaves this image to PIL (CMYK)."""
        ok, _denom, _warnings, message = _turbo.decode_into(
            data,
            box.x,
            box.y,
            box.w,
            box.h,
            self.size,
            box.flip,
            dst.numpy(),
            self._mean,
            self._inv_std,
            **self._limits,
        )
        if ok is False:
            raise BadImageError(message)
        return ok is True

    def normalise_into(self, dst: torch.Tensor, arr: np.ndarray) -> None:
        """uint8 HWC -> (x - mean) / std, CHW, written into ``dst``, in the worker thread while the
        image is still in cache (uint8 ``dst``: the pixels as they are). numpy rather than torch:
        torch's intra-op threads, started from every pool thread at once, oversubscribe the cores
        (measured 0.05 -> 4.8 ms per image on a busy 2-core machine); numpy's loops run in the
        calling thread with the GIL released."""
        src = arr[..., :3].transpose(2, 0, 1)
        out = dst.numpy()
        if out.dtype == np.uint8:
            np.copyto(out, src)
        elif out.dtype == np.float32:
            np.subtract(src, self._mean_np, out=out)
            np.multiply(out, self._inv_std_np, out=out)
        else:
            tmp = np.subtract(src, self._mean_np, dtype=np.float32)
            np.multiply(tmp, self._inv_std_np, out=out, casting="same_kind")

    def decode_one(self, data: bytes, info: ImageInfo, box: Box) -> np.ndarray:
        """One image: decode (DCT-scaled when possible), crop ``box``, resize, flip -> uint8 HWC
        (3 channels, or 4 with a padding byte last)."""
        s = self.size
        # Smallest decoded size that keeps the box at least ``size`` pixels in both directions.
        min_w = min(info.width, math.ceil(info.width * s / box.w))
        min_h = min(info.height, math.ceil(info.height * s / box.h))
        if info.format == "jpeg" and info.components in (1, 3) and self.jpeg_library == "simplejpeg":
            try:
                # strict=False: recover from damaged entropy data as PIL and DALI do (see header.py).
                # RGBX is PIL's own in-memory layout for RGB: frombuffer then shares the array
                # instead of repacking every pixel (the 4th byte is dropped in normalise_into).
                arr = simplejpeg.decode_jpeg(
                    data, colorspace="RGBX", min_width=min_w, min_height=min_h, strict=False
                )
            except ValueError as exc:
                raise BadImageError(f"corrupt JPEG ({exc})") from None
            img = Image.frombuffer("RGBX", (arr.shape[1], arr.shape[0]), arr, "raw", "RGBX", 0, 1)
        else:
            img = _pil_open(data, info, min_w, min_h)
        fx, fy = img.width / info.width, img.height / info.height
        crop = (box.x * fx, box.y * fy, (box.x + box.w) * fx, (box.y + box.h) * fy)
        img = img.resize((s, s), Image.Resampling.BILINEAR, box=crop)
        if box.flip:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return np.asarray(img)


def _pil_open(data: bytes, info: ImageInfo, min_w: int, min_h: int) -> Image.Image:
    try:
        img = Image.open(io.BytesIO(data))
        if info.format == "jpeg":
            img.draft(img.mode if img.mode in ("RGB", "L", "CMYK") else "RGB", (min_w, min_h))
        img.load()
    except Image.DecompressionBombError as exc:  # only when max_pixels is above PIL's process-wide limit
        raise BadImageError(f"{exc} (raise PIL.Image.MAX_IMAGE_PIXELS to decode it on the CPU)") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise BadImageError(f"cannot decode {info.format} ({exc})") from None
    if img.mode in ("RGBA", "LA") or (img.mode == "P" and "transparency" in img.info):
        # Drop alpha and keep the colour channels as stored, as DALI's RGB output does.
        img = img.convert("RGBA")
        img = Image.fromarray(np.asarray(img)[..., :3])
    return img.convert("RGB") if img.mode != "RGB" else img
