"""Read an encoded image's format and size from its header, and refuse what no decoder should see.

Every backend (the CPU decoder, DALI's CPU operators, DALI on the GPU) gets its images through
``probe`` in ``ImageDecode.decode_batch``, so these refusals are the same everywhere and happen
before any decoder allocates a pixel. They exist because the decoders do not make them:

* Truncated files. libjpeg-turbo (inside PIL and DALI alike) fills a truncated JPEG's missing
  rows with grey and reports success. A JPEG is complete when an EOI marker follows the first
  start-of-scan of the main image (markers cannot occur inside entropy-coded data, and walking the
  segments by length skips EXIF thumbnails, which carry an EOI of their own); a PNG when its chunks
  run to an IEND chunk.
* Headers that claim more pixels than the data can hold (a 5 KB JPEG whose frame header says
  30000x30000: DALI spent 40 s and 4.9 GB on one and returned a grey image). The bound is what
  the coding can achieve at best, so no valid file is under it: baseline and progressive Huffman
  JPEG spends at least one bit on every 8x8 block of every component (its DC code); deflate (PNG)
  at most turns 2 bits into 258 bytes (1032:1). Measured on this project's real-photo JPEGs
  (quality 5-95, 64x48 to 4000x3000, 4:4:4 to 4:2:0, optimised and progressive, colour and grey):
  median 23 bits per block, least 2.15; one-colour images, the cheapest content there is, 2.0 (a
  1-bit DC code and a 1-bit end-of-block); a one-colour PNG at zlib level 9, 0.2 % over the bound.
  ``tests/gpu_decode/test_limits.py`` checks that such files pass.
* Images over ``max_pixels`` (``DEFAULT_MAX_PIXELS``, PIL's ``Image.MAX_IMAGE_PIXELS``; PIL warns
  above it and refuses above twice it): a real 30000x30000 JPEG took DALI 15.6 s and 3.6 GB.
* JPEGs with more than ``max_scans`` scans (``DEFAULT_MAX_SCANS``, 64). Each scan of a
  progressive JPEG is one more pass over every coefficient of the image, and a scan of a flat
  area costs under 100 bytes, so a file with one scan repeated passes every check above and
  decodes for minutes: a one-colour 8000x8000 file, 367 KB with its encoder's 10 scans, took our
  C decoder 0.7 s; with 100 scans (375 KB) 13 s, with 500 (412 KB) 82 s; PIL is as slow, being
  the same libjpeg-turbo. Encoders write 10 scans (libjpeg's progressive script for colour, 6 for
  grey) and rarely over 20 (mozjpeg's scan search, Photoshop's "5 scans"), so 64 refuses no real
  file and bounds the work at about 6x an ordinary progressive decode of the same size.
  (TurboJPEG's own scan limit, used by libjpeg-turbo's fuzzers, is 500: too high here.) Only
  progressive and multi-scan files are counted: libjpeg decodes any other file from its first
  scan alone and treats a second one as an error, so it has no such cost (and counting would be a
  pass over every file: 0.1-0.4 ms per 95 KB JPEG measured here, a tenth of its decode). The count
  looks for ``FF DA`` markers (which cannot occur inside entropy-coded data) in one regex pass, and
  walks the segments exactly only when that count is over the limit.
* JPEGs whose coefficient buffers exceed ``max_memory`` (``DEFAULT_MAX_MEMORY``, 320 MiB).
  libjpeg decodes a baseline file row by row, but a progressive or multi-scan file must keep
  every coefficient of the whole image until its last scan, 128 bytes per 8x8 block of every
  component, whatever region is wanted: a 9400x9400 4:4:4 progressive file (under
  ``max_pixels``) needs 505 MiB before a pixel comes out (measured: 736 MB peak per decode
  thread). 320 MiB admits a progressive 4:2:0 file at the full ``max_pixels`` (257 MiB) and
  4:4:4 up to about 55 M pixels; the C decoder also hands the limit to libjpeg
  (``max_memory_to_use``) and counts its decoded region against it.

Policy, the same in every backend: bytes that are not an image, a truncated or implausible file,
an image over the limit, or an image the decoder cannot produce (bad Huffman tables, unsupported
coding) fail that sample; damage inside the entropy-coded data that libjpeg-turbo recovers from
(it warns and goes on) decodes, with the damage visible, as it does in PIL, DALI and torchvision.
"""

from __future__ import annotations

import dataclasses
import io
import math
import re
import struct
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

# PIL.Image.MAX_IMAGE_PIXELS' default (about 9459 x 9459), written out so that the limit does not
# change with whatever another library set PIL's process-wide value to.
DEFAULT_MAX_PIXELS = 89_478_485
DEFAULT_MAX_SCANS = 64  # see the module docstring; _turbo.c has the same defaults
DEFAULT_MAX_MEMORY = 320 << 20

# Start-of-frame markers that carry the frame size (not DHT 0xC4, JPG 0xC8 or DAC 0xCC).
_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
# Non-differential Huffman frames (baseline, extended, progressive, lossless), where every block of
# every component costs at least one bit. Arithmetic coding and hierarchical frames have no such floor.
_HUFFMAN_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3})
_PROGRESSIVE_SOF = frozenset({0xC2, 0xC6, 0xCA, 0xCE})
# A marker in or after entropy-coded data: 0xFF (then fill bytes) and anything but a stuffed zero,
# a restart marker or more fill.
_MARKER = re.compile(rb"\xff+([^\x00\xd0-\xd7\xff])")
_SOS = re.compile(rb"\xff\xda")  # re's search beats bytes.count 2-3x on entropy-coded data (measured)
_PNG_SIG = b"\x89PNG\r\n\x1a\n"
_PNG_SAMPLES = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # colour type -> samples per pixel in the IDAT data
_PNG_COMPONENTS = {0: 1, 2: 3, 3: 3, 4: 2, 6: 4}  # colour type -> colour components (palette: RGB)
_DEFLATE_MAX_RATIO = 1032  # a 258-byte match in 2 bits (1-bit length and distance codes)


@dataclass(frozen=True)
class ImageInfo:
    """What the header says, and how many bytes of coded pixel data the file holds against how
    many an image of that size needs at least (0 where there is no such floor)."""

    format: str  # "jpeg", "png" or PIL's format name in lower case
    width: int
    height: int
    components: int  # colour components as stored (JPEG: 1 grey, 3 YCbCr/RGB, 4 CMYK); 0 if unknown
    coded_bytes: int = 0  # JPEG: first scan's data to EOI; PNG: sum of IDAT lengths
    min_coded_bytes: int = 0
    # JPEG: scan headers of a progressive or multi-scan file (at most; exact when over the limit);
    # 1 for other JPEGs (libjpeg reads only their first scan), 0 for other formats
    scans: int = 0
    buffer_bytes: int = 0  # JPEG: libjpeg's whole-image coefficient buffers (0: decoded in one pass)

    @property
    def pixels(self) -> int:
        return self.width * self.height


class BadImageError(ValueError):
    """The bytes are not a complete image in a format we can decode."""


class ImageTooLargeError(BadImageError):
    """The image is larger than the decoder's ``max_pixels``."""


class TooManyScansError(BadImageError):
    """The JPEG has more scans than the decoder's ``max_scans``."""


def probe(
    data: bytes | memoryview,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
    *,
    max_scans: int | None = DEFAULT_MAX_SCANS,
    max_memory: int | None = DEFAULT_MAX_MEMORY,
) -> ImageInfo:
    """Format and size of an encoded image, from its header and markers alone (no pixel is decoded).

    Raises ``BadImageError`` if it is unreadable, truncated, or claims more pixels than its data can
    hold; ``ImageTooLargeError`` if it has more than ``max_pixels`` pixels or its decode needs more
    than ``max_memory`` bytes of coefficient buffers; ``TooManyScansError`` for a JPEG with more
    than ``max_scans`` scans (None: no such limit)."""
    if len(data) < 8:
        raise BadImageError(f"too short to be an image ({len(data)} bytes)")
    buf = bytes(data) if isinstance(data, memoryview) else data
    if buf[:2] == b"\xff\xd8":
        info = _probe_jpeg(buf)
    elif buf[:8] == _PNG_SIG:
        info = _probe_png(buf)
    else:
        info = _probe_other(buf)
    if max_pixels is not None and info.pixels > max_pixels:
        raise ImageTooLargeError(
            f"{info.format} of {info.width}x{info.height} = {info.pixels:,} pixels is over the limit "
            f"of {max_pixels:,} (ImageDecode(max_pixels=...))"
        )
    if info.coded_bytes < info.min_coded_bytes:
        raise BadImageError(
            f"implausible {info.format}: its header says {info.width}x{info.height}, which needs at "
            f"least {info.min_coded_bytes:,} bytes of coded data, but the file holds {info.coded_bytes:,}"
        )
    if max_scans is not None and info.scans > max_scans:
        info = _exact_scans(buf, info)
        if info.scans > max_scans:
            raise TooManyScansError(
                f"jpeg of {info.width}x{info.height} has {info.scans:,} scans, over the limit of {max_scans} "
                "(each scan is one more pass over the whole image; ImageDecode(max_scans=...))"
            )
    if max_memory is not None and info.buffer_bytes > max_memory:
        raise ImageTooLargeError(
            f"progressive jpeg of {info.width}x{info.height} needs {info.buffer_bytes:,} bytes of "
            f"coefficient buffers to decode, over the limit of {max_memory:,} (ImageDecode(max_memory=...))"
        )
    return info


def _probe_jpeg(buf: bytes) -> ImageInfo:
    pos, n = 2, len(buf)
    frame: tuple[int, int, int, list[tuple[int, int]]] | None = None  # (marker, w, h, sampling)
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
            if pos + 10 + 3 * comps > n:
                break
            sampling = [(buf[pos + 11 + 3 * c] >> 4, buf[pos + 11 + 3 * c] & 15) for c in range(comps)]
            frame = (marker, w, h, sampling)
        if marker == 0xDA:  # start of scan: entropy-coded data follows
            if frame is None:
                raise BadImageError("corrupt JPEG: scan before frame header")
            start = pos + 2 + length
            end = buf.rfind(b"\xff\xd9", start)  # from the end: O(1) when complete
            if end < 0:
                raise BadImageError("truncated JPEG: no end-of-image marker after the scan data")
            sof, w, h, sampling = frame
            if w == 0 or h == 0:
                raise BadImageError(f"corrupt JPEG: frame size {w}x{h}")
            if not sampling or any(not (1 <= f <= 4) for hv in sampling for f in hv):
                raise BadImageError(f"corrupt JPEG: sampling factors {sampling}")
            floor = _jpeg_min_bytes(w, h, sampling) if sof in _HUFFMAN_SOF else 0
            # libjpeg buffers the whole image when it cannot decode in one pass: progressive,
            # or a first scan without every component (multi-scan sequential).
            comps_in_scan = buf[pos + 4] if pos + 4 < n else len(sampling)
            buffered = sof in _PROGRESSIVE_SOF or comps_in_scan < len(sampling)
            return ImageInfo(
                "jpeg",
                w,
                h,
                len(sampling),
                end - start,
                floor,
                # FF DA cannot occur in entropy-coded data, so this is exact unless a segment
                # between scans or data after the end holds those bytes (then it is more).
                scans=1 + len(_SOS.findall(buf, start, end)) if buffered else 1,
                buffer_bytes=_coefficient_bytes(w, h, sampling) if buffered else 0,
            )
        pos += 2 + length
    raise BadImageError("truncated JPEG: ends inside its header")


def _exact_scans(buf: bytes, info: ImageInfo) -> ImageInfo:
    """``info`` with the scans libjpeg would read: a walk from the first scan to the end-of-image
    marker that skips segments by their length (so bytes inside a COM or DQT segment between scans
    are not taken for markers). Only run when the quick count is over the limit."""
    pos = buf.find(b"\xff\xda")
    pos += 2 + int.from_bytes(buf[pos + 2 : pos + 4], "big")
    scans, n = 1, len(buf)
    while True:
        m = _MARKER.search(buf, pos)
        if m is None:
            break
        marker, at = m.group(1)[0], m.start(1) - 1
        if marker == 0xD9:
            break
        if marker == 0x01:  # TEM: no length
            pos = at + 2
            continue
        if at + 4 > n:
            break
        scans += marker == 0xDA
        pos = at + 2 + int.from_bytes(buf[at + 2 : at + 4], "big")
    return dataclasses.replace(info, scans=scans)


def _coefficient_bytes(w: int, h: int, sampling: list[tuple[int, int]]) -> int:
    """libjpeg's whole-image coefficient arrays (jdcoefct.c): per component, its blocks rounded up
    to whole iMCUs, 64 two-byte coefficients each."""
    h_max = max(hs for hs, _ in sampling)
    v_max = max(vs for _, vs in sampling)
    total = 0
    for hs, vs in sampling:
        blocks_w = -(-w * hs // (h_max * 8))
        blocks_h = -(-h * vs // (v_max * 8))
        total += -(-blocks_w // hs) * hs * -(-blocks_h // vs) * vs * 128
    return total


def _jpeg_min_bytes(w: int, h: int, sampling: list[tuple[int, int]]) -> int:
    """One bit per 8x8 block of each component: a Huffman-coded block's DC code is at least 1 bit."""
    h_max = max(hs for hs, _ in sampling)
    v_max = max(vs for _, vs in sampling)
    blocks = sum(
        math.ceil(math.ceil(w * hs / h_max) / 8) * math.ceil(math.ceil(h * vs / v_max) / 8)
        for hs, vs in sampling
    )
    return blocks // 8


def _probe_png(buf: bytes) -> ImageInfo:
    if len(buf) < 33 or buf[12:16] != b"IHDR":
        raise BadImageError("corrupt PNG: no IHDR chunk")
    w, h, depth, colour = struct.unpack_from(">IIBB", buf, 16)
    if w == 0 or h == 0:
        raise BadImageError(f"corrupt PNG: size {w}x{h}")
    idat, pos, n = 0, 8, len(buf)
    while True:  # walk the chunks by length to IEND, adding up the compressed pixel data
        if pos + 12 > n:
            raise BadImageError("truncated PNG: no IEND chunk")
        length, kind = struct.unpack_from(">I4s", buf, pos)
        if kind == b"IEND":
            break
        if kind == b"IDAT":
            idat += length
        pos += 12 + length
    raw = w * h * _PNG_SAMPLES.get(colour, 0) * depth // 8  # pixel data alone, no row filter bytes
    return ImageInfo("png", w, h, _PNG_COMPONENTS.get(colour, 0), idat, raw // _DEFLATE_MAX_RATIO)


def _probe_other(buf: bytes) -> ImageInfo:
    try:
        with Image.open(io.BytesIO(buf)) as img:
            fmt = (img.format or "unknown").lower()
            w, h = img.size
    except Image.DecompressionBombError as exc:  # PIL's own, process-wide limit, checked in open()
        raise ImageTooLargeError(str(exc)) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise BadImageError(f"not a recognised image format ({exc})") from None
    return ImageInfo(fmt, w, h, 0)
