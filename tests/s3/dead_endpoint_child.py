"""Child process of ``test_s3_integrity.py``: its own S3 server, a dataset on it, reads, then the
server dies (stopped mid-run) and a dataset is opened at an endpoint nobody listens on. Prints one
JSON line per outcome (error class and module, message, seconds taken). Run under a timeout.

    python -m tests.s3.dead_endpoint_child
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

from stallfree.shards.open import open_dataset
from stallfree.shards.writer import ShardWriter
from stallfree.testing.s3serve import serve_s3


def _outcome(what: str, fn) -> None:
    t0 = time.monotonic()
    fields: dict[str, Any] = {"what": what}
    try:
        got = fn()
        fields.update(result="ok", key=got["__key__"] if isinstance(got, dict) else None)
    except Exception as exc:  # noqa: BLE001 - the child reports every outcome
        fields.update(
            result="error",
            type=type(exc).__name__,
            module=type(exc).__module__,
            message=str(exc),
            url=getattr(exc, "url", None),
        )
    fields["seconds"] = round(time.monotonic() - t0, 3)
    print(json.dumps(fields), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    with serve_s3() as s3:
        s3.create_bucket("dead")
        opts = s3.storage_options
        with ShardWriter("s3://dead/ds", format="tar", max_samples=5, **opts) as w:
            for i in range(10):
                w.write({"__key__": f"s{i:03d}", "bin": bytes(1000 + i)})
        ds = open_dataset("s3://dead/ds", **opts)
        _outcome("before", lambda: ds[0])
        endpoint = s3.endpoint_url
        s3.stop()  # the server dies mid-run
        _outcome("opened-shard", lambda: ds[1])
        _outcome("new-shard", lambda: ds[7])
    print(json.dumps({"what": "endpoint", "url": endpoint}), flush=True)
    wrong = f"http://127.0.0.1:{_free_port()}"
    print(json.dumps({"what": "wrong-endpoint", "url": wrong}), flush=True)
    _outcome("open-wrong", lambda: open_dataset("s3://dead/ds", **{**opts, "endpoint_url": wrong}))
    _outcome("glob-wrong", lambda: open_dataset("s3://dead/ds/*.tar", **{**opts, "endpoint_url": wrong}))


if __name__ == "__main__":
    main()
