# Types for the compiled build of routing.py (see radix.pxd): the fleet mean each
# routing decision computes, summed as a C double in the members' order (the same
# additions `sum` makes over Python floats, so the same value).
import cython

@cython.locals(total=cython.double, n=Py_ssize_t)
cpdef double _reported_mean(members, occupancy)

@cython.locals(total=cython.double, n=Py_ssize_t)
cpdef double _dict_mean(members, dict occupancy)

# The gate as an extension type: its fields read as struct fields.
cdef class _Gate:
    cdef public object _occ, _members
    cdef public double _spill, _low, _balance, _hysteresis, _balance_hot, _balance_low

    cpdef _summed(self)
    cpdef hot(self, member)
    cpdef cool(self, member)
