"""The guide's own-transform example (``class Augmented``, in docs/decode.md) runs without a
warning, in the main process and in 2 workers, under ``warnings.simplefilter("error")``.

It raised torch's "The given NumPy array is not writable" warning: the example handed
``np.asarray(pil_image)``, a read-only view of PIL's bytes, to ``torch.from_numpy``; nothing in
stallfree's path (open_dataset, the loader's read-ahead, shared-memory collate) warns. The
guide's code is read from docs/decode.md and run as it is, in a subprocess with a timeout."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.zygote import run_python

ROOT = Path(__file__).resolve().parents[2]
GUIDE = (ROOT / "docs" / "decode.md").read_text(encoding="utf-8")
BLOCKS = re.findall(r"```python\n(.*?)```", GUIDE, flags=re.S)
EXAMPLE = next((b for b in BLOCKS if "class Augmented" in b), None)
OLD_CALL = "torch.from_numpy(np.asarray(img))"

DRIVER = """
import sys, warnings
from stallfree.shards.open import open_dataset
from stallfree.shards.writer import ShardWriter
from stallfree.testing.images import jpeg_bytes

with ShardWriter(sys.argv[1], format="tar", max_samples=6) as w:
    for i, b in enumerate(jpeg_bytes(12, seed=3, sizes=((80, 60), (60, 80)))):
        w.write({"__key__": f"k{i:03d}", "jpg": b, "cls": str(i % 3).encode()})
ds = open_dataset(sys.argv[1])
warnings.simplefilter("error")  # every warning from here on, in this process and its workers, raises
WORKERS = int(sys.argv[2])
"""


def test_pil_asarray_is_read_only():
    """Why the example must copy: PIL hands numpy its bytes, read-only."""
    img = Image.new("RGB", (4, 4))
    assert not np.asarray(img).flags.writeable and np.array(img).flags.writeable


# workers=0 passed even with the old README (np.asarray): torch warns once per process, and on the
# loader's worker thread that one warning does not reach the caller; 2 workers showed the fault
@pytest.mark.parametrize("workers", [0, 2])
def test_readme_augmented_example_runs_without_warnings(tmp_path, workers):
    assert EXAMPLE is not None, "docs/decode.md has no `class Augmented` example"
    assert OLD_CALL not in EXAMPLE
    code = textwrap.dedent(DRIVER) + EXAMPLE.replace("num_workers=2", "num_workers=WORKERS")
    # forked from the test zygote (torch imported once, before any warning filter is set)
    proc = run_python(code, str(tmp_path / "ds"), str(workers), timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
