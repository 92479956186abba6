"""stallfree.tokens may import only itself, stallfree.shards and the floors below it (storage,
errors); stallfree.mix only itself (docs/ARCHITECTURE.md's layers), checked with the project's
import-graph helpers."""

from __future__ import annotations

import pytest

from tests.test_imports import _violations, import_graph


@pytest.mark.parametrize(
    "source, allowed",
    [
        (
            "stallfree.tokens",
            (
                "stallfree.tokens",
                "stallfree.shards",
                "stallfree.storage",
                "stallfree.errors",
                "stallfree.extras",
            ),
        ),
        ("stallfree.mix", ("stallfree.mix",)),
    ],
)
def test_layering(source, allowed):
    bad = _violations(import_graph(), source, allowed)
    assert not bad, f"{source} may import only {allowed}:\n" + "\n".join(bad)
