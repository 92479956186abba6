"""``jpeg_decoder()``: which JPEG decoder the CPU backend uses, said before a run and not only in
``stats()``; without the C extension the reason says how to get it, the backend's reason makes no
claim of the C decoder's speed, and the first JPEG through the PIL fallback logs one WARNING."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap

import pytest

from stallfree.gpu_decode import cpu
from stallfree.gpu_decode.jpeg_info import JpegDecoder, jpeg_decoder


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )


def test_report_is_a_frozen_value_and_imports_no_torch():
    proc = _run(
        """
        import sys
        from stallfree.gpu_decode import jpeg_decoder
        d = jpeg_decoder()
        print(d.name)
        print("torch" in sys.modules, "PIL" in sys.modules)
        """
    )
    assert proc.returncode == 0, proc.stderr
    name, imported = proc.stdout.splitlines()
    assert name in ("turbo", "pil")
    assert imported == "False False"
    with pytest.raises(dataclasses.FrozenInstanceError):
        jpeg_decoder().name = "x"  # type: ignore[misc]


@pytest.mark.skipif(not cpu.turbo_available(), reason="stallfree's C extension was not built")
def test_built_extension_reports_turbo():
    d = jpeg_decoder()
    assert isinstance(d, JpegDecoder) and d.name == "turbo"
    assert "stallfree.gpu_decode._turbo is built against libjpeg API" in d.reason and "loaded" in d.reason
    assert cpu.jpeg_decoder() == d  # the name the CLI imports
    from stallfree.gpu_decode.select import ImageDecode

    reason = ImageDecode(backend="auto", device="cpu", size=32).stats()["reason"]
    assert "region-of-interest C decoder" in reason and "RESULTS.md" in reason, reason


# A process where the extension cannot be imported, as after a build without gcc or libjpeg headers.
WITHOUT_TURBO = """
    import io, logging, sys
    sys.modules["stallfree.gpu_decode._turbo"] = None  # `import` of it raises ImportError
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(levelname)s %(name)s %(message)s")
    from PIL import Image
    from stallfree.gpu_decode.cpu import jpeg_decoder
    from stallfree.gpu_decode.select import ImageDecode
    d = jpeg_decoder()
    print("NAME", d.name)
    print("REASON", d.reason)
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 10)).save(buf, format="JPEG")
    sample = {"__key__": "k", "jpg": buf.getvalue(), "cls": b"1"}
    dec = ImageDecode(backend="auto", device="cpu", size=16, num_threads=1)
    print("STATS", dec.stats()["jpeg_library"])
    print("WHY", dec.stats()["reason"])
    for seed in range(3):
        dec.decode_batch([sample, sample], seed=seed)
    asked = ImageDecode(backend="auto", device="cpu", size=16, num_threads=1, jpeg_library="pil")
    print("ASKED", asked.stats()["reason"])
    asked.decode_batch([sample], seed=0)  # PIL asked for: not a fallback, no second warning
"""


def test_without_the_extension_pil_is_reported_and_warned_once():
    proc = _run(WITHOUT_TURBO)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    got = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in lines if not line.startswith("WARNING")}
    assert got["NAME"] == "pil"
    assert got["REASON"].startswith("the C extension stallfree.gpu_decode._turbo is not built (")
    assert got["REASON"].endswith("install gcc and libjpeg62-turbo-dev, then reinstall stallfree")
    assert got["STATS"] == "pil"
    # the auto reason names PIL and never claims the C decoder's measured speed
    assert "JPEGs through PIL" in got["WHY"] and "measured faster" not in got["WHY"], got["WHY"]
    assert "libjpeg62-turbo-dev" in got["WHY"]
    warnings = [line for line in lines if line.startswith("WARNING")]
    assert warnings == [
        "WARNING stallfree.gpu_decode.cpu decoding JPEGs with PIL, not the C region-of-interest decoder: "
        + got["REASON"]
    ]
    assert "JPEGs through pil (jpeg_library='pil')" in got["ASKED"], got["ASKED"]
