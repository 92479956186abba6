"""Sources of ``stallfree shard``: one module per kind of input (files, tar, tables, HF, MDS,
LitData, another dataset); ``registry`` picks one for a path."""
