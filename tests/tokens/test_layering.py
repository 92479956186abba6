"""stallfree.tokens may import only itself and stallfree.shards; stallfree.mix only itself
(DESIGN.md layering), checked with the project's import-graph helpers."""

from __future__ import annotations

import pytest

from tests.test_imports import _violations, import_graph


@pytest.mark.parametrize(
    "source, allowed",
    [
        ("stallfree.tokens", ("stallfree.tokens", "stallfree.shards", "stallfree.extras")),
        ("stallfree.mix", ("stallfree.mix",)),
    ],
)
def test_layering(source, allowed):
    bad = _violations(import_graph(), source, allowed)
    assert not bad, f"{source} may import only {allowed}:\n" + "\n".join(bad)
