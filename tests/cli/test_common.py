"""The helpers the CLI subcommands share, and the flags that use them."""

from __future__ import annotations

import pytest

from stallfree.cli import main
from stallfree.cli._common import parse_key_value


def test_key_value_reads_json_values_and_keeps_other_text():
    assert parse_key_value("window=1") == ("window", 1)
    assert parse_key_value(" autotune =true") == ("autotune", True)
    assert parse_key_value("order=block") == ("order", "block")
    assert parse_key_value("anon=") == ("anon", "")
    assert parse_key_value("url=a=b") == ("url", "a=b")


@pytest.mark.parametrize("text", ["novalue", "=1", " =x"])
def test_key_value_without_a_key_is_refused_by_name(text):
    with pytest.raises(ValueError, match=f"storage option must be KEY=VALUE, got {text!r}"):
        parse_key_value(text, "storage option")


def test_shard_refuses_a_malformed_storage_option(tmp_path, capsys):
    rc = main(["shard", str(tmp_path), str(tmp_path / "out"), "-o", "novalue"])
    assert rc == 2
    assert capsys.readouterr().err.strip() == (
        "stallfree shard: error: storage option must be KEY=VALUE, got 'novalue'"
    )
    assert not (tmp_path / "out").exists()


def test_bench_refuses_a_malformed_loader_option(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "synthetic:8", "--loader-option", "window"])
    assert exc.value.code == 2
    assert "loader option must be KEY=VALUE, got 'window'" in capsys.readouterr().err


def test_cache_serve_refuses_half_a_tls_pair_before_starting(tmp_path, capsys):
    rc = main(["cache", "serve", "--port", "0", "--tls-cert", str(tmp_path / "cert.pem")])
    assert rc == 2
    assert capsys.readouterr().err.strip() == (
        "stallfree cache serve: error: --tls-cert and --tls-key go together"
    )
