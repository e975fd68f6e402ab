"""Storage tiers: the NVMe block tier on LMDB (and, later, the DRAM pool backends)."""
