"""The shared-memory transport between workers and the main process: storages, slots,
segments, returned slots, rows and the heap (glibc) tuning."""
