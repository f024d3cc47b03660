"""The remote tier: ``RemoteTier`` (``tier.py``), its value format and MAC (``value.py``), its
URL and secret parsing (``target.py``), the circuit breaker (``breaker.py``), cluster slot
routing (``slots.py``) and its RESP read path (``resp.py``)."""

from lmshm.core.tiers.remote.target import MIN_SECRET_BYTES, read_ca_file, read_secret_file
from lmshm.core.tiers.remote.tier import RemoteTier

__all__ = ["MIN_SECRET_BYTES", "RemoteTier", "read_ca_file", "read_secret_file"]
