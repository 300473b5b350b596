"""kvtier core library: cache keys, the prefix index, admission and eviction,
the break-even arithmetic and rendezvous affinity. No I/O lives here."""

from kvtier._compiled import use_fresh_sources as _use_fresh_sources

__version__ = "0.1.0"

_use_fresh_sources()  # KVTIER_PURE_PYTHON, before any compiled module is imported
