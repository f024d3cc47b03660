"""Storage tiers below the server's pool: the interface (``base.Tier``), the checksums both
formats use (``integrity``), the local disk (``disk.DiskTier``), the remote (``remote.RemoteTier``)
and how the data plane uses them (``stack.TierStack``). See docs/design/tiers.md."""
