"""Storage tiers below the server's pool (issue 17): the interface (``base.Tier``), the local
disk (``disk.DiskTier``) and how the data plane uses them (``stack.TierStack``). See
docs/design/tiers.md."""
