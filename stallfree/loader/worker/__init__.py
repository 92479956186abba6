"""What runs inside a worker process: its main loop, reads, the per-sample stages, concurrent
shard reads, the lifeline to the parent and the first-batch gate."""
