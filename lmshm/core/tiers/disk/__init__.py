"""The local-disk tier: ``DiskTier`` (``tier.py``: the index, capacity and rebuild), its file
format and I/O (``format.py``), and its checked directory, key and lock (``dirs.py``)."""

from lmshm.core.tiers.disk.tier import DiskTier

__all__ = ["DiskTier"]
