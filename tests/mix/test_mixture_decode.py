"""Issue 19 item 5: a mixture of images and tokens through the loader: the README's
``stallfree.mix.collate_by_source`` line, a clear error from the default collate, and decode per
source (``mix(..., decode={"images": ImageDecode(...)})``)."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest
import torch

import stallfree
from stallfree.mix.collate import collate_by_source, collate_mixed


@pytest.fixture
def image_and_tokens(tmp_path):
    from stallfree.testing.images import jpeg_bytes
    from tests.tokens.helpers import random_docs, write_megatron

    with stallfree.ShardWriter(str(tmp_path / "img"), format="tar") as w:
        for i, jpg in enumerate(jpeg_bytes(6, sizes=((32, 24),))):
            w.write({"__key__": f"img{i}", "jpg": jpg, "cls": i})
    write_megatron(tmp_path / "tok", random_docs(1, n=30), "int32")
    return stallfree.open_dataset(str(tmp_path / "img")), stallfree.TokenDataset(str(tmp_path / "tok"), 8)


def test_readme_collate_line_resolves_after_the_function_is_used():
    """``stallfree.mix`` stays the (callable) package after ``stallfree.mix(...)``, in a fresh
    interpreter, whichever is touched first."""
    code = (
        "import stallfree\n"
        "ds = stallfree.mix({'a': [1, 2]}, {'a': 1})\n"
        "assert len(ds) == 2\n"
        "from stallfree.mix.collate import collate_by_source\n"
        "assert stallfree.mix.collate_by_source is collate_by_source\n"
        "from stallfree import mix\n"
        "assert mix.collate_by_source is collate_by_source and len(mix({'a': [1]}, {'a': 1})) == 1\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_default_collate_of_mixed_sources_is_a_clear_error(image_and_tokens):
    images, tokens = image_and_tokens
    m = stallfree.mix({"images": images, "tokens": tokens}, {"images": 1, "tokens": 3}, samples_per_epoch=24)
    loader = stallfree.DataLoader(m, batch_size=8, num_workers=0)
    with pytest.raises(TypeError) as err:
        next(iter(loader))
    msg = str(err.value)
    assert "images has __key__, cls, jpg" in msg and "tokens has doc_ids, input_ids" in msg
    assert "collate_fn=stallfree.mix.collate_by_source" in msg
    same = stallfree.mix({"a": [1, 2], "b": [3]}, {"a": 1, "b": 1})
    assert collate_mixed([same[0], same[1]]).tolist() == [same[0], same[1]]  # non-dict samples: torch's


@pytest.mark.parametrize("num_workers", [0, 2])
def test_decode_only_the_image_source(image_and_tokens, num_workers):
    images, tokens = image_and_tokens
    decode = stallfree.ImageDecode(train=False, size=16, backend="cpu", label_field="cls")
    m = stallfree.mix(
        {"images": images, "tokens": tokens},
        {"images": 1, "tokens": 3},
        samples_per_epoch=24,
        seed=1,
        decode={"images": decode},
    )
    loader = stallfree.DataLoader(m, batch_size=8, num_workers=num_workers)
    got = list(loader)
    assert len(got) == 3
    for k, batch in enumerate(got):
        names = [m.source_of(i) for i in range(8 * k, 8 * k + 8)]
        assert batch["__source__"] == names and Counter(names) == {"images": 2, "tokens": 6}
        img = batch["images"]
        assert img["image"].shape == (2, 3, 16, 16) and img["image"].dtype == torch.float32
        located = [m.locate(i, 0) for i in range(8 * k, 8 * k + 8)]
        want_keys = [images[j]["__key__"] for name, j in located if name == "images"]
        assert img["__key__"] == want_keys and img["label"].tolist() == [int(key[3:]) for key in want_keys]
        want_ids = torch.stack([tokens[j]["input_ids"] for name, j in located if name == "tokens"])
        assert torch.equal(batch["tokens"]["input_ids"], want_ids)
    # the same images decode the same way again (the decode seed is a function of seed, epoch, source)
    again = list(stallfree.DataLoader(m, batch_size=8, num_workers=0))
    assert all(
        torch.equal(a["images"]["image"], b["images"]["image"]) for a, b in zip(got, again, strict=True)
    )


def test_per_sample_decoder_and_explicit_collate():
    m = stallfree.mix(
        {"a": [{"x": 1}, {"x": 2}], "b": [{"y": 10}]},
        {"a": 2, "b": 1},
        decode={"b": lambda s: {"y": s["y"] * 2}},
    )
    batch = m.collate([m[i] for i in range(3)])
    assert batch["b"]["y"].tolist() == [20] and sorted(batch["a"]["x"].tolist()) == [1, 2]
    plain = collate_by_source([m[i] for i in range(3)])  # the module function: no decoders
    assert plain["b"]["y"].tolist() == [10]
    with pytest.raises(ValueError, match=r"decode= names sources \['c'\]"):
        stallfree.mix({"a": [1]}, {"a": 1}, decode={"c": len})
    with pytest.raises(TypeError, match="dict samples tagged with '__source__'"):
        collate_by_source([1, 2])
