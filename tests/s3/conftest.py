"""A real S3 API server (moto's server mode, in its own process) on a loopback port, shared by the
tests of this folder; skipped with the reason when moto or s3fs is not installed."""

import itertools
import os

import pytest

from stallfree.testing.s3serve import moto_available, serve_s3

_reason = moto_available()
_names = itertools.count()


@pytest.fixture(scope="session")
def s3():
    if _reason is not None:
        pytest.skip(_reason)
    with serve_s3() as server:
        yield server


@pytest.fixture
def bucket(s3):
    """A fresh, empty bucket for one test."""
    name = f"bkt-{os.getpid()}-{next(_names)}"
    s3.create_bucket(name)
    s3.reset()
    return name
