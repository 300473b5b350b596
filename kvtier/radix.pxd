# Types for the compiled build of radix.py (Cython's augmenting .pxd): the index is an
# extension type, so its methods read and write its attributes as struct fields
# instead of through Python attribute lookup. The .py stays plain Python; every
# attribute stays a Python object, so the values and decisions are those of the .py.
cdef class PrefixIndex:
    cdef public object block_size, block_token_bytes, policy, clock
    cdef public dict _roots
    cdef public object _window
    cdef public list _heap
    cdef public object _seq
    cdef public list region_blocks
    cdef public object window_target, hot_budget, on_evict
    cdef public object num_blocks, dead_blocks, hot_blocks, num_nodes
    cdef public dict tenant_blocks, tenant_evictions
