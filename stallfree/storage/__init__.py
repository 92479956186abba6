"""Bytes at a URL: fsspec reads with retries and pins, S3 direct ranges, local staging,
atomic writes, digests. The ground floor: imports nothing of stallfree but ``stallfree.errors``."""
