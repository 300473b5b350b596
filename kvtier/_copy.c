/* kvtier._copy: many equal-sized memory pieces copied with non-temporal stores.
 *
 * KV loads and saves move hundreds of MB as pieces of ~100 KiB (one block's layer),
 * each into memory nobody reads again soon. glibc's memcpy uses ordinary stores below
 * its non-temporal threshold (several MiB), so every destination line is first read
 * into the cache (read-for-ownership) and later written back: about 1.5x the memory
 * traffic of the copy itself. Streaming stores write whole lines straight to memory,
 * which is what memcpy does for one big copy; this does it per piece.
 *
 * copy_pieces(dst_addrs, src_addrs, piece_bytes, stream=True) -> None
 *     dst_addrs, src_addrs: buffers of int64 addresses, one per piece, same length.
 *     The caller (kvtier.memcopy) derives them from arrays it holds, so every piece is
 *     inside memory it owns. The GIL is released while copying. stream=False copies
 *     every piece with memcpy (a copy small enough to stay in the cache is faster so).
 *
 * Built by setup.py (optional: kvtier.memcopy falls back to numpy's copy without it).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define KVTIER_X86 1
#endif

/* Below this a piece is copied by memcpy: the fence and the alignment prologue cost
 * more than the read-for-ownership they save. */
#define STREAM_MIN_BYTES 4096

#ifdef KVTIER_X86
static int have_avx2 = 0;

__attribute__((target("avx2"))) static void stream_avx2(char *dst, const char *src, size_t n) {
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + i + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + i + 96));
        _mm256_stream_si256((__m256i *)(dst + i), a);
        _mm256_stream_si256((__m256i *)(dst + i + 32), b);
        _mm256_stream_si256((__m256i *)(dst + i + 64), c);
        _mm256_stream_si256((__m256i *)(dst + i + 96), d);
    }
    for (; i + 32 <= n; i += 32)
        _mm256_stream_si256((__m256i *)(dst + i), _mm256_loadu_si256((const __m256i *)(src + i)));
    if (i < n)
        memcpy(dst + i, src + i, n - i);
}

static void stream_sse2(char *dst, const char *src, size_t n) {
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    for (; i + 16 <= n; i += 16)
        _mm_stream_si128((__m128i *)(dst + i), _mm_loadu_si128((const __m128i *)(src + i)));
    if (i < n)
        memcpy(dst + i, src + i, n - i);
}

static void copy_one(char *dst, const char *src, size_t n, int stream) {
    if (!stream || n < STREAM_MIN_BYTES) {
        memcpy(dst, src, n);
        return;
    }
    size_t head = (size_t)(-(uintptr_t)dst) & 31; /* streaming stores need aligned dst */
    if (head) {
        memcpy(dst, src, head);
        dst += head, src += head, n -= head;
    }
    if (have_avx2)
        stream_avx2(dst, src, n);
    else
        stream_sse2(dst, src, n);
}
#else
static void copy_one(char *dst, const char *src, size_t n, int stream) { (void)stream; memcpy(dst, src, n); }
#endif

static int int64_buffer(PyObject *obj, Py_buffer *view, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (view->itemsize != 8 || view->format == NULL || strchr("qlQL", view->format[0]) == NULL ||
        view->format[1] != '\0') {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous buffer of 64-bit integers", what);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *copy_pieces(PyObject *self, PyObject *args) {
    PyObject *dst_obj, *src_obj;
    Py_ssize_t piece_bytes;
    int stream = 1;
    if (!PyArg_ParseTuple(args, "OOn|p:copy_pieces", &dst_obj, &src_obj, &piece_bytes, &stream))
        return NULL;
    if (piece_bytes < 0) {
        PyErr_SetString(PyExc_ValueError, "piece_bytes must be >= 0");
        return NULL;
    }
    Py_buffer dst, src;
    if (int64_buffer(dst_obj, &dst, "dst_addrs") < 0)
        return NULL;
    if (int64_buffer(src_obj, &src, "src_addrs") < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    if (dst.len != src.len) {
        PyErr_SetString(PyExc_ValueError, "dst_addrs and src_addrs differ in length");
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return NULL;
    }
    const uint64_t *d = (const uint64_t *)dst.buf, *s = (const uint64_t *)src.buf;
    Py_ssize_t count = dst.len / 8;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++)
        copy_one((char *)(uintptr_t)d[i], (const char *)(uintptr_t)s[i], (size_t)piece_bytes, stream);
#ifdef KVTIER_X86
    _mm_sfence(); /* streaming stores are visible to other threads after this */
#endif
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_pieces", copy_pieces, METH_VARARGS,
     "copy_pieces(dst_addrs, src_addrs, piece_bytes, stream=True): copy piece_bytes from each src "
     "address to the matching dst address, with non-temporal stores for pieces of 4 KiB and more "
     "when stream is true."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvtier._copy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__copy(void) {
#ifdef KVTIER_X86
    __builtin_cpu_init();
    have_avx2 = __builtin_cpu_supports("avx2");
#endif
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "STREAM_MIN_BYTES", STREAM_MIN_BYTES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
