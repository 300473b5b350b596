# Types for the compiled build of blockpool.py (see radix.pxd): the pool as an extension type.
cdef class BlockPool:
    cdef public object num_slots
    cdef public list _free
    cdef public bytearray _is_free
