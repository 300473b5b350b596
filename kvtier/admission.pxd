# Types for the compiled build of admission.py (Cython's augmenting .pxd): the
# sketch's two inner loops as typed C; the .py stays plain Python.
import cython

@cython.locals(m=cython.ulonglong, i=Py_ssize_t, est=cython.uint, v=cython.uint)
cpdef unsigned int _estimate_cells(const unsigned int[::1] flat, const unsigned char[::1] door,
                                   unsigned long long lo, unsigned long long hi, unsigned long long width,
                                   Py_ssize_t depth, unsigned long long door_mask)

@cython.locals(m=cython.ulonglong, j=Py_ssize_t, i=Py_ssize_t, k=Py_ssize_t, lo=cython.ulonglong, hi=cython.ulonglong,
               c=Py_ssize_t, p=cython.p_uchar)
cpdef _sight_hashes(unsigned int[::1] flat, unsigned char[::1] door, unsigned int[::1] stamp, list hashes,
                    Py_ssize_t n, unsigned long long width, Py_ssize_t depth, unsigned long long door_mask,
                    unsigned int epoch)

cpdef unsigned int[::1] _u32_view(unsigned int[::1] a)
cpdef unsigned char[::1] _u8_view(unsigned char[::1] a)

# The sketch and the filter as extension types (see radix.pxd).
cdef class CountMinSketch:
    cdef public object width, depth, table, additions, sample_size, resets, _mask, _coef, _row_base, _table_flat
    cdef public object _flat, door, _door_flat, _door_mask, _door_mask_i64, _stamp, _epoch, _views

cdef class FrequencyFilter:
    cdef public object sketch, min_sightings, rejects, admits
