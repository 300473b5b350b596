# Types for the compiled build of blockpool.py (see radix.pxd): the pool as an extension
# type, its take and give-back callable from the cache without a Python call.
cdef class BlockPool:
    cdef public object num_slots
    cdef public list _free
    cdef public bytearray _is_free

    cpdef take(self, n)
    cpdef give_back(self, slots)
