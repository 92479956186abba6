"""Merging byte ranges into fewer requests: reads at most ``max_gap`` apart become one ranged
read (a remote request costs a round trip; the bytes between two samples cost far less)."""

from __future__ import annotations

# get_many merges two ranged reads when the gap between them is at most this many bytes.
MAX_GAP = 16 * 1024
MAX_MERGED = 64 << 20


def coalesce(spans: list[tuple[int, int, int]], max_gap: int = MAX_GAP) -> list[tuple[int, int, list[int]]]:
    """``[(start, end, tag)]`` -> merged ``[(start, end, [tags])]`` for reads at most ``max_gap`` apart."""
    merged: list[tuple[int, int, list[int]]] = []
    for start, end, tag in sorted(spans):
        if merged:
            m_start, m_end, tags = merged[-1]
            if start - m_end <= max_gap and max(end, m_end) - m_start <= MAX_MERGED:
                merged[-1] = (m_start, max(end, m_end), tags + [tag])
                continue
        merged.append((start, end, [tag]))
    return merged
