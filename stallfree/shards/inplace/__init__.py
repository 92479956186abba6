"""Datasets read in place without re-sharding: MosaicML MDS and LitData (``index.json``)."""
