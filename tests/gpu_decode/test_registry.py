"""The decode-backend registry: a toy backend is one class and one ``register_backend`` line, and
``ImageDecode`` and the real DataLoader (in its worker processes too) use it like a built-in.
Lookups are lazy: naming a backend imports nothing until it is chosen."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from stallfree.errors import BatchDecodeError
from stallfree.gpu_decode import registry
from stallfree.gpu_decode.augment import Box
from stallfree.gpu_decode.backend import Backend, BackendBase, BackendOptions, OutputSpec
from stallfree.gpu_decode.header import ImageInfo, probe
from stallfree.gpu_decode.select import ImageDecode
from stallfree.loader.dataloader import DataLoader
from stallfree.shards.open import open_dataset
from stallfree.shards.writer import ShardWriter

from .conftest import samples_from

ROOT = Path(__file__).resolve().parents[2]


class ToyBackend(BackendBase):
    """Paints each image one colour, (width, height, box x) mod 256, and fails files that say so:
    enough to tell that the header, the box and the options reached it."""

    name = "toy"
    runs_in_workers = True

    def __init__(self, spec: OutputSpec, options: BackendOptions) -> None:
        super().__init__(spec, options)
        self.threads = options.num_threads
        self.calls = 0

    def decode(
        self,
        datas: Sequence[bytes],
        infos: Sequence[ImageInfo],
        boxes: Sequence[Box],
        *,
        alloc=None,
    ) -> tuple[torch.Tensor, list[tuple[int, BaseException]]]:
        self.calls += 1
        shape = self.spec.shape(len(datas))
        out = alloc(shape, self.dtype) if alloc is not None else None
        out = torch.empty(shape, dtype=self.dtype) if out is None else out
        failures: list[tuple[int, BaseException]] = []
        for i, (data, info, box) in enumerate(zip(datas, infos, boxes, strict=True)):
            if b"toy-fail" in data:
                failures.append((i, RuntimeError("the toy refuses this one")))
                out[i].zero_()
                continue
            colour = torch.tensor([info.width % 256, info.height % 256, box.x % 256], dtype=torch.float32)
            if self.dtype != torch.uint8:
                colour = (colour - torch.tensor(self.spec.mean)) / torch.tensor(self.spec.std)
            out[i].copy_(colour.view(3, 1, 1).expand(3, self.size, self.size))
        return out, failures

    def use_threads(self, n: int) -> None:
        self.threads = n

    def stats(self) -> dict:
        return {**super().stats(), "toy_calls": self.calls}


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))  # undone after the test
    registry.register_backend("toy", ToyBackend)
    return ToyBackend


def test_a_registered_backend_decodes_through_image_decode(toy, rgb_jpegs):
    samples = samples_from(rgb_jpegs[:4])
    samples[2]["jpg"] = samples[2]["jpg"] + b"toy-fail"  # still a complete JPEG for probe
    dec = ImageDecode(train=False, size=8, backend="toy", dtype="uint8", num_threads=3)
    assert isinstance(dec._decoder, Backend) and dec.runs_in_workers and dec.device == torch.device("cpu")
    assert dec.reason == "forced by backend='toy'"
    with pytest.raises(BatchDecodeError) as info:
        dec.decode_batch(samples, seed=0)
    assert [(key, str(exc)) for _, key, exc in info.value.failures] == [
        ("s0002", "cannot decode image: the toy refuses this one (sample 's0002')")
    ]
    del samples[2]
    out = dec.decode_batch(samples, seed=0)
    for image, sample in zip(out["image"], samples, strict=True):
        info = probe(sample["jpg"])
        box = dec.preset.box(info.width, info.height, 0, sample["__key__"])
        assert image[:, 0, 0].tolist() == [info.width % 256, info.height % 256, box.x % 256]
    st = dec.stats()
    assert st["backend"] == "toy" and st["toy_calls"] == 2 and st["images"] == 3
    dec.use_threads(1)
    assert dec._decoder.threads == 3  # num_threads was given: a worker does not override it
    # float output and the uint8 transfer reach it through the spec, as for the CPU backend
    moved = ImageDecode(train=False, size=8, backend="toy", transfer="uint8")
    assert moved._decoder.dtype == torch.uint8 and moved.needs_finish
    finished = moved.finish(moved.decode_batch(samples, seed=0))["image"]
    direct = ImageDecode(train=False, size=8, backend="toy").decode_batch(samples, seed=0)["image"]
    assert finished.dtype == direct.dtype == torch.float32 and torch.allclose(finished, direct)


def test_a_registered_backend_runs_in_the_loaders_workers(toy, tmp_path, rgb_jpegs):
    with ShardWriter(str(tmp_path), format="tar") as w:
        for s in samples_from(rgb_jpegs[:6]):
            w.write(s)
    dec = ImageDecode(train=False, size=4, backend="toy", dtype="uint8")
    loader = DataLoader(open_dataset(str(tmp_path)), batch_size=3, decode=dec, num_workers=1)
    keys = [k for batch in loader for k in batch["__key__"]]
    assert sorted(keys) == [f"s{i:04d}" for i in range(6)]
    decode = loader.stats()["decode"]
    assert decode["backend"] == "toy" and decode["where"] == "workers"


def test_names_duplicates_and_missing_backends(toy):
    assert registry.backend_names()[:3] == ("dali", "nvimgcodec", "cpu") and "toy" in registry.backend_names()
    with pytest.raises(ValueError, match="'auto', 'dali', 'nvimgcodec', 'cpu' or 'toy', got 'nope'"):
        ImageDecode(backend="nope")
    with pytest.raises(ValueError, match="'toy' is already registered"):
        registry.register_backend("toy", ToyBackend)
    registry.register_backend("toy", "tests.gpu_decode.test_registry:ToyBackend", clobber=True)
    assert registry.backend_class("toy") is ToyBackend  # a "module:Class" string, imported when asked
    for bad in ("", "auto", None):
        with pytest.raises(ValueError, match="a backend name must be"):
            registry.register_backend(bad, ToyBackend)
    registry.register_backend(
        "absent",
        registry.BackendEntry("no_such_package.mod:Thing", lambda: False, install_hint="pip install toy"),
    )
    assert not registry.available("absent") and not registry.usable("absent")
    with pytest.raises(ImportError, match="pip install toy"):
        ImageDecode(backend="absent")
    registry.register_backend(
        "broken", registry.BackendEntry("no_such_package.mod:Thing", install_hint="pip x")
    )
    with pytest.raises(ImportError, match=r"pip x \(No module named 'no_such_package'\)"):
        ImageDecode(backend="broken")


def test_looking_up_backends_imports_none_until_chosen():
    """A CPU-only job never imports DALI or nvImageCodec (nor our modules wrapping them)."""
    code = (
        "import sys, json; from stallfree.gpu_decode.select import ImageDecode; "
        "ImageDecode(backend='cpu'); "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('nvidia', 'stallfree.gpu_decode.')))))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "stallfree.gpu_decode.cpu" in loaded
    assert not [m for m in loaded if m.startswith("nvidia") or m.endswith((".dali", ".nvimgcodec"))], loaded


def test_output_spec_and_options_check_their_values():
    spec = OutputSpec(8, (1, 2, 3), (4, 5, 6))
    assert spec.mean == (1.0, 2.0, 3.0) and spec.shape(2) == (2, 3, 8, 8) and spec.dtype == torch.float32
    with pytest.raises(ValueError, match="size must be a positive int"):
        OutputSpec(0, (1, 2, 3), (4, 5, 6))
    with pytest.raises(ValueError, match="mean and std need 3 values each"):
        OutputSpec(8, (1, 2), (4, 5, 6))
    with pytest.raises(ValueError, match="hw_decoder_load must be in"):
        BackendOptions(hw_decoder_load=1.5)
    assert BackendOptions(num_threads=0).num_threads == 1 and BackendOptions().device == torch.device("cpu")
    assert BackendOptions(device_id=0).device == torch.device("cuda", 0)
