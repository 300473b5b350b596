# Types for the compiled build of eviction.py (see radix.pxd): the frequency policy, the
# window tuners and the miniatures as extension types (subclasses in Python, such as
# the simulator's ablation tuners, keep working: they add their own slots and may
# override the cpdef methods). A tuner's catch-up calls its miniatures and shadow
# directly; their block counts and hit tallies are C integers (a sample's counters
# are bumped per lookup and per sampled block).
import cython

cdef class DecayedFrequencyPolicy:
    cdef public object half_life_s

cdef class WindowTuner:
    cdef public object capacity, window_target, adjustments

    cpdef catch_up(self)

cdef class ShadowLru:
    cdef public Py_ssize_t capacity, evictions
    cdef public object _blocks

    @cython.locals(hit=Py_ssize_t, over=Py_ssize_t)
    cpdef access(self, hashes, limit)

cdef class MiniatureCache:
    cdef public Py_ssize_t capacity, window_cap, main_cap, hits
    cdef public object window, main

    @cython.locals(window_cap=Py_ssize_t, main_cap=Py_ssize_t, chained=bint, hits=Py_ssize_t)
    cpdef serve(self, blocks, counts, min_sightings)

cdef class MiniatureTuner(WindowTuner):
    cdef public object windows, minis, min_sightings, scores, counts, shadow
    cdef public Py_ssize_t last_ours, last_lru, _sightings, _reset_at, _pending_blocks, _looked, _ours, _lru
    cdef public object _mask, _shadow_sampled, _pending

    @cython.locals(mini=MiniatureCache, shadow=ShadowLru)
    cpdef catch_up(self)
