"""The dataset manifest: one JSON commit point listing shards (model), its sidecars and rows."""
