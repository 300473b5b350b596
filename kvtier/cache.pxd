# Types for the compiled build of cache.py (see radix.pxd): LocalCache as an extension
# type whose attributes are struct fields (Python objects, as in the .py), its index,
# pool and tuner typed so their cpdef methods are called directly.
from kvtier.blockpool cimport BlockPool
from kvtier.eviction cimport WindowTuner
from kvtier.radix cimport Node, PrefixIndex

cdef class LocalCache:
    cdef public object thrash_ratio, _thrash_events, block_size, block_bytes, num_slots, capacity_bytes
    cdef public object metadata_only, clock, drain_budget_s, hot_sightings, pinned_fraction, pin_max_bytes
    cdef public object _arena, policy, _admission, _removed, _removed_seq, _removal_reset
    cdef public BlockPool _pool
    cdef public PrefixIndex _index
    cdef public WindowTuner _tuner
    cdef public object _duel, _queue, _lock, _reservations, _tenants, _total, _evictions, _stores_enqueued
    cdef public object _stores_applied, _invalidated_blocks, _reserved_blocks, _chain_memo, _match_memo

    # Called per request from the methods above: direct calls, no Python call protocol.
    cpdef release(self, hit)
    cpdef commit(self, res, num_blocks=*)
    cpdef _evicted(self, region, hashes)
    cpdef _tenant(self, tenant)
    cpdef _sight(self, root, tb, m, n_full)
    cpdef _adapt(self, hashes, limit, matched, cached)
    cpdef _match(self, root, tb, n_full)
    cpdef _chain_from(self, m, root, tb)
    cpdef _catch_up_tuner(self)
    cpdef _duel_tails(self, candidate, victim)
    cpdef _set_targets(self, window_blocks)
    cpdef _reserve_from(self, m, root, tokens, tb, end, sightings, forced=*)
    cpdef _end_reservation(self, res)
    cpdef _check_hit(self, hit)
    cpdef _check_reservation(self, res)
