"""Image decode + augment for the loader's ``decode=``: DALI (GPU "mixed" or CPU) or a DALI-free CPU path.

``ImageDecode`` (select.py) is the entry point; dali.py and cpu.py are the backends, augment.py
draws the crop boxes both share, header.py reads sizes and rejects truncated files.
"""
