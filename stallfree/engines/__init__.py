"""Engines that run stallfree work on other machines: one file per engine; imports stay lazy."""
