import subprocess
import sys

import pytest

import stallfree


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        stallfree.nope  # noqa: B018


def test_cli_help_lists_commands():
    out = subprocess.run(
        [sys.executable, "-m", "stallfree", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "usage: stallfree" in out
    assert "demo" in out and "doctor" in out


def test_shard_error_names_shard_key_and_offset():
    from stallfree.errors import CorruptShardError

    err = CorruptShardError("bad tar header", shard="s-000.tar", key="k1", offset=1536)
    assert str(err) == "bad tar header (shard s-000.tar, sample 'k1', byte offset 1536)"
    import pickle

    again = pickle.loads(pickle.dumps(err))
    assert (again.shard, again.key, again.offset, str(again)) == (err.shard, err.key, err.offset, str(err))


def test_public_api_names_resolve():
    import stallfree.cache
    import stallfree.gpu_decode
    import stallfree.shards

    for name in stallfree.__all__:
        assert getattr(stallfree, name) is not None
    assert stallfree.DataLoader.__module__ == "stallfree.loader.dataloader"
    assert stallfree.gpu_decode.ImageDecode is stallfree.ImageDecode
    assert stallfree.shards.open_dataset is stallfree.open_dataset
    assert stallfree.cache.TieredCache is stallfree.TieredCache


def test_the_cli_parser_and_the_extras_table_import_no_heavy_library():
    """`stallfree --help` and a refused command stay quick, and extras.py (which every layer may
    import) pulls in none of the optional libraries it describes."""
    code = (
        "import sys\n"
        "from stallfree.cli import build_parser\n"
        "from stallfree.extras import EXTRAS\n"
        "build_parser()\n"
        "[e.installed() for e in EXTRAS.values()]\n"
        "heavy = ('torch', 'numpy', 'pyarrow', 'redis', 'matplotlib', 'tokenizers', 'nvidia.dali', 's3fs')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_importing_the_package_does_not_import_torch():
    code = "import sys, stallfree, stallfree.cache, stallfree.shards, stallfree.gpu_decode; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_the_region_jpeg_decoder_is_built_in_the_dev_environment():
    """scripts/setup.sh installs gcc and libjpeg-turbo's headers, so the optional C extension must
    have been built here; without it the turbo tests would skip and the default decode path would
    quietly be PIL's."""
    from stallfree.gpu_decode import cpu

    assert cpu.turbo_available(), (
        "stallfree.gpu_decode._turbo missing: reinstall with libjpeg62-turbo-dev present"
    )
