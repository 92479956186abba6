"""ImageDecode through the real stallfree.DataLoader, reading real-photo JPEGs from tar shards."""

from __future__ import annotations

import pytest
import torch

from stallfree.errors import BatchDecodeError
from stallfree.gpu_decode.normalize import normalize
from stallfree.gpu_decode.select import ImageDecode
from stallfree.shards.open import open_dataset
from stallfree.shards.writer import ShardWriter

dataloader = pytest.importorskip("stallfree.loader.dataloader", reason="loader (issue 3) not landed yet")

BACKENDS = [pytest.param("dali", id="dali-cpu"), pytest.param("cpu", id="cpu")]
N = 20


@pytest.fixture(scope="module")
def shards(tmp_path_factory, rgb_jpegs, odd_images, bad_images):
    """20 samples over 3 tar shards; labels 0..19 so every image can be traced to its sample."""
    images = list(rgb_jpegs) + [odd_images["gray"], odd_images["cmyk"], odd_images["progressive"]]
    images = (images * 2)[:N]
    root = tmp_path_factory.mktemp("gd-shards")
    with ShardWriter(str(root / "good"), format="tar", max_samples=8) as w:
        for i, data in enumerate(images):
            w.write({"__key__": f"img{i:03d}", "jpg": data, "cls": str(i).encode()})
    with ShardWriter(str(root / "bad"), format="tar", max_samples=8) as w:
        for i, data in enumerate(images[:10]):
            if i in (3, 7):
                data = bad_images["truncated_jpeg"] if i == 3 else bad_images["corrupt_tables"]
            w.write({"__key__": f"img{i:03d}", "jpg": data, "cls": str(i).encode()})
    return root


def _loader(url, backend, **kw):
    ds = open_dataset(str(url))
    dec = ImageDecode(train=kw.pop("train", True), size=32, backend=backend, num_threads=2)
    return dataloader.DataLoader(
        ds, batch_size=6, shuffle=True, seed=kw.pop("seed", 7), decode=dec, **kw
    ), dec


def _epoch(loader) -> tuple[list[str], torch.Tensor, dict[str, torch.Tensor]]:
    keys, labels, images = [], [], {}
    for batch in loader:
        assert batch["image"].shape[1:] == (3, 32, 32) and batch["image"].dtype == torch.float32
        assert batch["label"].dtype == torch.int64 and len(batch["__key__"]) == batch["image"].shape[0]
        keys += batch["__key__"]
        labels.append(batch["label"])
        for k, img in zip(batch["__key__"], batch["image"], strict=True):
            images[k] = img.clone()
    return keys, torch.cat(labels), images


@pytest.mark.parametrize("backend", BACKENDS)
def test_loader_batches_labels_aligned_and_seeded(shards, backend):
    loader, dec = _loader(shards / "good", backend)
    keys, labels, imgs_e0 = _epoch(loader)
    assert sorted(keys) == [f"img{i:03d}" for i in range(N)]
    assert labels.tolist() == [int(k[3:]) for k in keys]  # label travels with its own image
    # Same seed, fresh loader: the same order and the same pixels.
    again, _ = _loader(shards / "good", backend)
    keys2, _, imgs2 = _epoch(again)
    assert keys2 == keys and all(torch.equal(imgs_e0[k], imgs2[k]) for k in keys)
    # Next epoch: new crops for every image.
    loader.set_epoch(1)
    _, _, imgs_e1 = _epoch(loader)
    assert all((imgs_e0[k] - imgs_e1[k]).abs().mean() > 1e-3 for k in keys)
    assert loader.stats()["decode"]["backend"] == backend
    assert dec.stats()["images"] == 2 * N


@pytest.mark.parametrize("backend", BACKENDS)
def test_loader_eval_preset_same_every_epoch(shards, backend):
    loader, _ = _loader(shards / "good", backend, train=False)
    _, _, e0 = _epoch(loader)
    loader.set_epoch(1)
    _, _, e1 = _epoch(loader)
    assert all(torch.equal(e0[k], e1[k]) for k in e0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_loader_on_error_raise_names_the_sample(shards, backend):
    loader, _ = _loader(shards / "bad", backend)
    with pytest.raises(BatchDecodeError, match=r"img00[37]"):
        _epoch(loader)


@pytest.mark.parametrize("backend", BACKENDS)
def test_loader_on_error_skip_drops_only_bad_samples(shards, backend):
    loader, _ = _loader(shards / "bad", backend, on_error="skip", max_failures=2)
    keys, labels, _ = _epoch(loader)
    assert sorted(keys) == [f"img{i:03d}" for i in range(10) if i not in (3, 7)]
    assert labels.tolist() == [int(k[3:]) for k in keys]


# -- the CPU decoder in the loader's worker processes (runs_in_workers) --------------------------


def test_workers_decode_the_same_pixels_as_the_main_process(shards):
    main, _ = _loader(shards / "good", "cpu")
    in_workers, dec = _loader(shards / "good", "cpu", num_workers=2)
    assert dec.runs_in_workers
    keys, labels, imgs = _epoch(main)
    keys_w, labels_w, imgs_w = _epoch(in_workers)
    assert keys_w == keys and torch.equal(labels_w, labels)
    assert all(torch.equal(imgs[k], imgs_w[k]) for k in keys)
    stats = in_workers.stats()["decode"]
    assert stats["where"] == "workers" and stats["images"] == N and stats["backend"] == "cpu"
    # the main process's copy decoded only the pool's first batch, before the workers forked
    # (loader/first_batch_inline.py); the workers decoded every other one
    assert dec.stats()["images"] == 6
    assert main.stats()["decode"]["where"] == "main"


def test_dali_decoder_stays_in_the_main_process_with_workers(shards):
    loader, dec = _loader(shards / "good", "dali", num_workers=2)
    assert not dec.runs_in_workers
    keys, _, _ = _epoch(loader)
    assert sorted(keys) == [f"img{i:03d}" for i in range(N)]
    assert loader.stats()["decode"]["where"] == "main" and dec.stats()["images"] == N


def test_workers_decoding_raise_a_batch_decode_error_naming_the_sample(shards):
    loader, _ = _loader(shards / "bad", "cpu", num_workers=2)
    with pytest.raises(BatchDecodeError, match=r"img00[37]") as info:
        _epoch(loader)
    assert {key for _, key, _ in info.value.failures} <= {"img003", "img007"}


def test_workers_decoding_skip_only_bad_samples_and_count_them(shards):
    loader, _ = _loader(shards / "bad", "cpu", on_error="skip", max_failures=2, num_workers=2)
    keys, labels, _ = _epoch(loader)
    assert sorted(keys) == [f"img{i:03d}" for i in range(10) if i not in (3, 7)]
    assert labels.tolist() == [int(k[3:]) for k in keys]
    stats = loader.stats()
    assert stats["failures"] == 2
    assert sorted(stats["failed_keys"]) == ["img003", "img007"]


def test_workers_decode_through_the_mapping_when_no_slot_file(shards, monkeypatch):
    from stallfree.loader.shm import storage as shm

    main, _ = _loader(shards / "good", "cpu")
    monkeypatch.setattr(shm.SlotFile, "of", classmethod(lambda cls, storage: None))
    in_workers, _ = _loader(shards / "good", "cpu", num_workers=2)
    keys, _, imgs = _epoch(main)
    keys_w, _, imgs_w = _epoch(in_workers)
    assert keys_w == keys and all(torch.equal(imgs[k], imgs_w[k]) for k in keys)


def _images_by_key(loader) -> dict[str, torch.Tensor]:
    out = {}
    for batch in loader:
        for k, img in zip(batch["__key__"], batch["image"], strict=True):
            out[k] = img.cpu().clone()
    return out


@pytest.mark.parametrize("num_workers", [0, 2])
def test_uint8_transfer_delivers_the_float_batches_bit_for_bit(shards, num_workers):
    """transfer="uint8": workers write uint8 rows, the main process normalises; the consumer
    sees exactly what the float32 decode gives, and the uint8 dtype gives those pixels raw."""
    got = {}
    for name, kwargs in {"float": {}, "transfer": {"transfer": "uint8"}, "uint8": {"dtype": "uint8"}}.items():
        dec = ImageDecode(train=True, size=32, backend="cpu", num_threads=1, **kwargs)
        loader = dataloader.DataLoader(
            open_dataset(str(shards / "good")),
            batch_size=6,
            shuffle=True,
            seed=3,
            num_workers=num_workers,
            decode=dec,
        )
        got[name] = _images_by_key(loader)
    assert sorted(got["float"]) == sorted(got["transfer"]) == sorted(got["uint8"]) and len(got["float"]) == N
    for key, img in got["float"].items():
        assert got["transfer"][key].dtype == torch.float32 and torch.equal(got["transfer"][key], img)
        assert got["uint8"][key].dtype == torch.uint8
        assert torch.equal(normalize(got["uint8"][key]), img)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (normalisation on the copy stream)")
def test_uint8_transfer_normalises_on_the_device_like_the_cpu(shards):
    got = {}
    for name, kwargs in {"cpu": ({}, None), "cuda": ({"transfer": "uint8"}, "cuda")}.items():
        dec = ImageDecode(train=True, size=32, backend="cpu", num_threads=1, device="cpu", **kwargs[0])
        loader = dataloader.DataLoader(
            open_dataset(str(shards / "good")),
            batch_size=6,
            shuffle=True,
            seed=3,
            num_workers=2,
            decode=dec,
            device=kwargs[1],
            pin_memory=kwargs[1] is not None,
        )
        got[name] = _images_by_key(loader)
    for key, img in got["cpu"].items():
        assert torch.allclose(got["cuda"][key], img, rtol=0, atol=1e-6)
