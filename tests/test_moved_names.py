"""Names users imported before the layout moved (storage/, format folders) still work: the error
types are the same classes under both names, the sharding job is where it was, and staging
forwards with a DeprecationWarning naming its new place."""

from __future__ import annotations

import pickle
import warnings

import pytest


def test_shards_errors_is_stallfree_errors():
    import stallfree.errors
    import stallfree.shards.errors as old
    from stallfree.shards.errors import CorruptShardError

    assert old is stallfree.errors
    assert CorruptShardError is stallfree.errors.CorruptShardError
    err = CorruptShardError("bad header", shard="a.tar", key="k", offset=512)
    again = pickle.loads(pickle.dumps(err))
    assert isinstance(again, stallfree.errors.CorruptShardError) and again.offset == 512


def test_shard_dataset_is_where_it_was():
    from stallfree.shards.parallel import shard_dataset

    assert callable(shard_dataset)


def test_staging_forwards_with_a_warning():
    from stallfree.storage.staging import Staging

    with pytest.warns(DeprecationWarning, match="stallfree.storage.staging.Staging"):
        from stallfree.shards.staging import Staging as old
    assert old is Staging
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError):
            from stallfree.shards import staging

            staging.NoSuchThing  # noqa: B018
