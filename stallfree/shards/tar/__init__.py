"""The tar format: WebDataset-compatible shards with DALI ``.idx`` indexes and per-member sums
(writer, walk, idx, sums, format adapter, indexing)."""
