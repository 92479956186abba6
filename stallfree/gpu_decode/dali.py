"""DALI backend: our loader feeds encoded bytes into a DALI pipeline through ``fn.external_source``.

Graph: ``decoders.image_slice`` (decodes only the crop box: nvJPEG / the hardware JPEG decoder
with ``device="mixed"`` on a GPU, libjpeg-turbo on the CPU) -> ``resize`` to size x size ->
``crop_mirror_normalize`` (mirror, mean/std, CHW, float16/float32). The box and the mirror flag
are per-sample inputs drawn on the host (see ``augment.py`` for why), so the graph itself holds
no random state: its output depends only on what it is fed, whatever the pipeline's seed.

The pipeline runs synchronously (``exec_async=False, exec_pipelined=False``): the loader already
calls ``decode_batch`` off the training thread, and a synchronous pipeline lets each call feed
exactly one batch and get exactly that batch back. On a GPU, ``run()`` returns once the batch is
complete (DALI's default: outputs synchronised with the host, which only blocks the decode
thread), then ``feed_ndarray`` copies it device-to-device into a torch tensor on torch's current
stream for that device: the pixels never travel through host memory.

A DALI error invalidates the whole pipeline ("Current pipeline object is no longer valid"), so on
an error we rebuild it and decode the batch's samples one at a time to find the bad ones; the
caller turns those into a ``BatchDecodeError``. Bad input is rare and mostly caught earlier by
``header.probe``, so the rebuilds cost nothing in the common case.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
from collections.abc import Sequence

import numpy as np
import torch

from .augment import Box
from .backend import Alloc, BackendBase, BackendOptions, Failures, OutputSpec
from .header import ImageInfo
from .registry import DALI_HINT as INSTALL_HINT

log = logging.getLogger(__name__)


def dali_available() -> bool:
    """Whether DALI is installed, without importing it: the import costs time and RSS (0.15 s and
    65 MB in a one-off measurement here), which every forked loader worker would then carry, even
    when the CPU decoder is chosen."""
    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except (ImportError, ValueError):  # "nvidia" itself missing or broken
        return False


class DaliDecoder(BackendBase):
    """A DALI decode+augment pipeline for one device (``options.device_id=None``: CPU operators only)."""

    name = "dali"
    runs_in_workers = False
    max_batch_size = 256  # the pipeline is built for this many, or for the batch if larger

    def __init__(self, spec: OutputSpec, options: BackendOptions) -> None:
        if not dali_available():
            raise ImportError(INSTALL_HINT)
        super().__init__(spec, options)
        self.mean, self.std = list(spec.mean), list(spec.std)
        self.device_id = options.device_id
        self.num_threads = options.num_threads
        self.hw_decoder_load = options.hw_decoder_load
        self.rebuilds = 0
        self._pipe = None
        self._lock = threading.Lock()

    def stats(self) -> dict:
        return {**super().stats(), "dali_rebuilds": self.rebuilds, "hw_decoder_load": self.hw_decoder_load}

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_pipe"] = None
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def close(self) -> None:
        self._pipe = None

    def _build(self, batch_size: int) -> None:
        from nvidia.dali import fn, pipeline_def, types

        gpu = self.device_id is not None
        dali_dtype = {torch.float16: types.FLOAT16, torch.uint8: types.UINT8}.get(self.dtype, types.FLOAT)
        # uint8: the pixels as decoded (crop_mirror_normalize then only mirrors and transposes)
        mean, std = ([0.0] * 3, [1.0] * 3) if self.dtype == torch.uint8 else (self.mean, self.std)

        @pipeline_def
        def graph():
            data = fn.external_source(name="data", dtype=types.UINT8, ndim=1)
            anchor = fn.external_source(name="anchor", dtype=types.FLOAT, ndim=1)
            shape = fn.external_source(name="shape", dtype=types.FLOAT, ndim=1)
            mirror = fn.external_source(name="mirror", dtype=types.INT32, ndim=0)
            decode_args = {"hw_decoder_load": self.hw_decoder_load} if gpu else {}
            img = fn.decoders.image_slice(
                data,
                anchor,
                shape,
                device="mixed" if gpu else "cpu",
                output_type=types.RGB,
                axis_names="WH",
                normalized_anchor=False,
                normalized_shape=False,
                adjust_orientation=False,  # the stored pixels, as every backend (see select.py)
                **decode_args,
            )
            img = fn.resize(img, size=(self.size, self.size), interp_type=types.INTERP_LINEAR, antialias=True)
            return fn.crop_mirror_normalize(
                img, mirror=mirror, dtype=dali_dtype, output_layout="CHW", mean=mean, std=std
            )

        pipe = graph(
            batch_size=batch_size,
            num_threads=self.num_threads,
            device_id=self.device_id,
            exec_async=False,
            exec_pipelined=False,
            seed=0,  # unused: the graph has no random operators
        )
        pipe.build()
        self._pipe = pipe

    def _run(self, datas: Sequence[np.ndarray], boxes: Sequence[Box]) -> torch.Tensor:
        from nvidia.dali.plugin.pytorch import feed_ndarray

        n = len(datas)
        if self._pipe is None or self._pipe.max_batch_size < n:
            self._build(max(n, self.max_batch_size))
        pipe = self._pipe
        pipe.feed_input("data", list(datas))
        pipe.feed_input("anchor", [np.array([b.x, b.y], np.float32) for b in boxes])
        pipe.feed_input("shape", [np.array([b.w, b.h], np.float32) for b in boxes])
        pipe.feed_input("mirror", [np.array(int(b.flip), np.int32) for b in boxes])
        (out,) = pipe.run()
        dense = out.as_tensor()
        if self.device_id is None:
            result = self.buffers.tensor((n, 3, self.size, self.size), self.dtype)
            feed_ndarray(dense, result)
        else:
            result = torch.empty((n, 3, self.size, self.size), dtype=self.dtype, device=self.device)
            stream = torch.cuda.current_stream(self.device)
            feed_ndarray(dense, result, cuda_stream=stream)
            # The next run() may reuse DALI's output buffer: let the copy finish first (this blocks
            # only the decode thread, never the training step).
            stream.synchronize()
        return result

    def decode(
        self,
        datas: Sequence[bytes],
        infos: Sequence[ImageInfo],
        boxes: Sequence[Box],
        *,
        alloc: Alloc | None = None,
    ) -> tuple[torch.Tensor, Failures]:
        """(normalised batch, [(position, error)]); failed positions hold zeros. ``infos`` and
        ``alloc`` are not needed: DALI reads the headers itself and owns its output."""
        arrays = [np.frombuffer(d, np.uint8) for d in datas]
        with self._lock:  # one pipeline: feed and run must not interleave between threads
            return self._decode_locked(arrays, boxes)

    def _decode_locked(
        self, arrays: list[np.ndarray], boxes: Sequence[Box]
    ) -> tuple[torch.Tensor, list[tuple[int, BaseException]]]:
        try:
            return self._run(arrays, boxes), []
        except RuntimeError as batch_exc:
            log.warning(
                "DALI batch of %d failed, locating bad samples: %s", len(arrays), _last_line(batch_exc)
            )
            self._pipe = None
            self.rebuilds += 1
        result = torch.zeros((len(arrays), 3, self.size, self.size), dtype=self.dtype, device=self.device)
        failures: list[tuple[int, BaseException]] = []
        for i, (arr, box) in enumerate(zip(arrays, boxes, strict=True)):
            try:
                result[i] = self._run([arr], [box])[0]
            except RuntimeError as exc:
                failures.append((i, RuntimeError(f"DALI could not decode it: {_last_line(exc)}")))
                self._pipe = None
                self.rebuilds += 1
        return result, failures


def _last_line(exc: BaseException) -> str:
    """DALI's messages are long tracebacks; the line after "encountered:" says what went wrong."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    for i, ln in enumerate(lines):
        if ln == "encountered:" and i + 1 < len(lines):
            what = lines[i + 1]
            # "Failed to decode sample #0 :" is followed by the codec's reason on the next line.
            if what.endswith(":") and i + 2 < len(lines) and not lines[i + 2].startswith("C++ context"):
                what = f"{what} {lines[i + 2]}"
            return what
    return lines[0] if lines else type(exc).__name__
