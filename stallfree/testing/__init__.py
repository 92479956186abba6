"""Helpers for tests, benchmarks and the demo: realistic sample images and loopback servers."""
