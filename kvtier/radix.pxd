# Types for the compiled build of radix.py (Cython's augmenting .pxd). The index and its
# nodes are extension types, so the loops that walk nodes (match, pin, unpin, insert,
# eviction) read node fields as struct fields instead of through Python attribute
# lookup. The .py stays plain Python; every field stays a Python object (a node's
# parent is a node or None), so the values and decisions are those of the .py.
import cython

cdef class Node:
    cdef public object root
    cdef public Node parent
    cdef public object tokens, slots, hashes, start_block
    cdef public dict children
    cdef public object pins, freq, last_access_s, hot, region, alive, version, queued

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

    cpdef match(self, root, token_bytes, limit_blocks)
    cpdef match_after(self, Node node, token_bytes, limit_blocks)
    @cython.locals(child=Node)
    cpdef _walk(self, Node node, within, pos, token_bytes, limit_blocks)
    @cython.locals(node=Node)
    cpdef truncate(self, m, blocks)
    @cython.locals(node=Node, n=Node)
    cpdef pin(self, m, touch=*)
    @cython.locals(n=Node)
    cpdef unpin(self, Node node)
    @cython.locals(node=Node, new=Node, n=Node)
    cpdef insert(self, root, token_bytes, first_block, slots, hashes, hot=*, main=*, after=*)
    @cython.locals(cand=Node, victim=Node, other=Node, node=Node)
    cpdef evict(self, num_blocks, duel=*, incoming=*)
    @cython.locals(n=Node, found=Node)
    cpdef _window_candidate(self)
    cpdef _to_main(self, Node n)
    @cython.locals(node=Node)
    cpdef _peek_victim(self)
    @cython.locals(parent=Node)
    cpdef _trim_tail(self, Node node, max_blocks, freed)
    @cython.locals(head=Node, parent=Node)
    cpdef _split(self, Node node, k)
    cpdef _evictable(self, Node n)
    cpdef _push(self, Node n)
    cpdef _count(self, Node n, sign)
    cpdef _count_blocks(self, Node n, delta)
