"""Tiered sample cache: process memory -> node (LMDB) -> cluster (Redis), one protocol.

Import the tiers from their modules (``stallfree.cache.memory`` etc.) or from ``stallfree``.
"""
