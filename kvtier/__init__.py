"""kvtier core library: cache keys, the prefix index, admission and eviction,
the break-even arithmetic and rendezvous affinity. No I/O lives here."""

__version__ = "0.1.0"
