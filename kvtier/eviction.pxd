# Types for the compiled build of eviction.py (see radix.pxd): the frequency policy, the
# window tuners and the miniatures as extension types (subclasses in Python, such as
# the simulator's ablation tuners, keep working: they add their own slots and may
# override the cpdef methods). A tuner's catch-up calls its miniatures and shadow
# directly.
import cython

cdef class DecayedFrequencyPolicy:
    cdef public object half_life_s

cdef class WindowTuner:
    cdef public object capacity, window_target, adjustments

    cpdef catch_up(self)

cdef class ShadowLru:
    cdef public object capacity, _blocks, evictions

    cpdef access(self, hashes, limit)

cdef class MiniatureCache:
    cdef public object capacity, window_cap, main_cap, window, main, hits

    cpdef serve(self, blocks, counts, min_sightings)

cdef class MiniatureTuner(WindowTuner):
    cdef public object windows, minis, min_sightings, scores, counts, shadow, last_ours, last_lru
    cdef public object _mask, _shadow_sampled, _sightings, _reset_at, _pending, _pending_blocks, _looked, _ours, _lru

    @cython.locals(mini=MiniatureCache, shadow=ShadowLru)
    cpdef catch_up(self)
