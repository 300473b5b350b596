# Types for the compiled build of fleet.py (see kvtier/radix.pxd): the fleet as an
# extension type, its per-replica columns typed lists and its maps dicts, so the event
# loop's two calls per request (advance, serve) read them as struct fields.
cdef class Fleet:
    cdef public object spec, _hbm_tokens, _next_ready_s
    cdef public list names, live, alive, version, prefill_free_at, active_kv_tokens, in_flight, load_s, _events
    cdef public dict occupancy_by_name, _gated
