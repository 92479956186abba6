"""Read an encoded image's format and size from its header, and reject truncated files up front.

Both backends need the size before decoding (crop boxes are sampled on the host, see
``augment.py``), and both must treat a truncated file as an error: libjpeg-turbo (inside PIL and
DALI alike) fills a truncated JPEG's missing rows with grey and reports success, so the check has
to happen here. A JPEG is complete when an EOI marker follows the first start-of-scan of the main
image (markers cannot occur inside entropy-coded data, and walking the segments by length skips
EXIF thumbnails, which carry an EOI of their own); a PNG when its IEND chunk is present.

Policy, the same in every backend: bytes that are not an image, a truncated file, or an image the
decoder cannot produce (bad Huffman tables, unsupported coding) fail that sample; damage inside
the entropy-coded data that libjpeg-turbo recovers from (it warns and goes on) decodes, with the
damage visible, as it does in PIL, DALI and torchvision.
"""

from __future__ import annotations

import io
import struct
from typing import NamedTuple

from PIL import Image, UnidentifiedImageError

# Start-of-frame markers that carry the frame size (not DHT 0xC4, JPG 0xC8 or DAC 0xCC).
_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
_PNG_SIG = b"\x89PNG\r\n\x1a\n"


class ImageInfo(NamedTuple):
    format: str  # "jpeg", "png" or PIL's format name in lower case
    width: int
    height: int
    components: int  # colour components as stored (JPEG: 1 grey, 3 YCbCr/RGB, 4 CMYK); 0 if unknown


class BadImageError(ValueError):
    """The bytes are not a complete image in a format we can decode."""


def probe(data: bytes | memoryview) -> ImageInfo:
    """Format and size of an encoded image; raises ``BadImageError`` if it is unreadable or truncated."""
    if len(data) < 8:
        raise BadImageError(f"too short to be an image ({len(data)} bytes)")
    head = bytes(data[:8])
    if head[:2] == b"\xff\xd8":
        return _probe_jpeg(data)
    if head == _PNG_SIG:
        return _probe_png(data)
    return _probe_other(data)


def _probe_jpeg(data: bytes | memoryview) -> ImageInfo:
    buf = bytes(data) if isinstance(data, memoryview) else data
    pos, n = 2, len(buf)
    size: tuple[int, int, int] | None = None
    while pos + 4 <= n:
        if buf[pos] != 0xFF:
            raise BadImageError(f"corrupt JPEG: no marker at byte {pos}")
        marker = buf[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in (0x01,) or 0xD0 <= marker <= 0xD7:  # standalone markers
            pos += 2
            continue
        if marker == 0xD9:
            raise BadImageError("corrupt JPEG: end of image before any scan")
        (length,) = struct.unpack_from(">H", buf, pos + 2)
        if length < 2:
            raise BadImageError(f"corrupt JPEG: bad segment length at byte {pos}")
        if marker in _SOF:
            if pos + 10 > n:
                break
            h, w, comps = struct.unpack_from(">HHB", buf, pos + 5)
            size = (w, h, comps)
        if marker == 0xDA:  # start of scan: entropy-coded data follows
            if size is None:
                raise BadImageError("corrupt JPEG: scan before frame header")
            if buf.rfind(b"\xff\xd9", pos + 2 + length) < 0:  # from the end: O(1) when complete
                raise BadImageError("truncated JPEG: no end-of-image marker after the scan data")
            w, h, comps = size
            if w == 0 or h == 0:
                raise BadImageError(f"corrupt JPEG: frame size {w}x{h}")
            return ImageInfo("jpeg", w, h, comps)
        pos += 2 + length
    raise BadImageError("truncated JPEG: ends inside its header")


def _probe_png(data: bytes | memoryview) -> ImageInfo:
    buf = bytes(data) if isinstance(data, memoryview) else data
    if len(buf) < 33 or buf[12:16] != b"IHDR":
        raise BadImageError("corrupt PNG: no IHDR chunk")
    w, h, _depth, colour = struct.unpack_from(">IIBB", buf, 16)
    if w == 0 or h == 0:
        raise BadImageError(f"corrupt PNG: size {w}x{h}")
    if buf.rfind(b"IEND", max(0, len(buf) - 64)) < 0:
        raise BadImageError("truncated PNG: no IEND chunk")
    comps = {0: 1, 2: 3, 3: 3, 4: 2, 6: 4}.get(colour, 0)
    return ImageInfo("png", w, h, comps)


def _probe_other(data: bytes | memoryview) -> ImageInfo:
    try:
        with Image.open(io.BytesIO(bytes(data))) as img:
            fmt = (img.format or "unknown").lower()
            w, h = img.size
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise BadImageError(f"not a recognised image format ({exc})") from None
    return ImageInfo(fmt, w, h, 0)
