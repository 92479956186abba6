"""ClusterCache over TLS against a real redis-server with a throwaway CA (made with openssl)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from stallfree.cache.base import CacheKey
from stallfree.cache.cluster import ClusterCache, ClusterCacheError

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def certs(tmp_path):
    """A CA, and a server certificate for 127.0.0.1 signed by it (EC keys: fast)."""
    d = tmp_path / "pki"
    d.mkdir()
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(
        "req",
        "-x509",
        *ec,
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "1",
        "-subj",
        "/CN=test-ca",
        cwd=d,
    )
    _openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.crt",
        "-days",
        "1",
        "-extfile",
        "san.ext",
        cwd=d,
    )
    # a second, unrelated CA: the server's certificate must not verify against it
    _openssl(
        "req",
        "-x509",
        *ec,
        "-keyout",
        "other.key",
        "-out",
        "other.crt",
        "-days",
        "1",
        "-subj",
        "/CN=other",
        cwd=d,
    )
    return d


def test_tls_round_trip_and_verification(certs, redis_servers):
    try:
        (server,) = redis_servers(
            1,
            tls_cert_file=certs / "server.crt",
            tls_key_file=certs / "server.key",
            tls_ca_cert_file=certs / "ca.crt",
            password="pw",
        )
    except RuntimeError as exc:  # a redis-server built without TLS
        pytest.skip(f"redis-server without TLS support: {exc}")
    assert server.url.startswith("rediss://127.0.0.1:")
    k = CacheKey("fp", 1, "raw")
    good = ClusterCache([server.url], password="pw", tls_ca_certs=str(certs / "ca.crt"))
    good.put_many([(k, b"over tls")])
    assert good.get_many([k]) == [b"over tls"]
    assert good.check() == {server.url: "ok"}

    # plain TCP to a TLS port, or a CA that did not sign the server: misses and a clear error
    plain = ClusterCache([server.url.replace("rediss://", "redis://")], password="pw", timeout_s=0.5)
    untrusted = ClusterCache([server.url], password="pw", tls_ca_certs=str(certs / "other.crt"))
    for bad in (plain, untrusted):
        assert bad.get_many([k]) == [None]
        with pytest.raises(ClusterCacheError):
            bad.check()
    assert "certificate verify failed" in untrusted.stats()["servers"][server.url]["last_error"]
    # verification may be turned off explicitly
    lax = ClusterCache([server.url], password="pw", tls_verify=False)
    assert lax.get_many([k]) == [b"over tls"]


def test_stats_cli_over_tls(certs, redis_servers, capsys):
    import json

    from stallfree.cli import main

    try:
        (server,) = redis_servers(1, tls_cert_file=certs / "server.crt", tls_key_file=certs / "server.key")
    except RuntimeError as exc:
        pytest.skip(f"redis-server without TLS support: {exc}")
    assert main(["cache", "stats", server.url, "--tls-ca", str(certs / "ca.crt"), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["url"] == server.url and row["keys"] == 0
