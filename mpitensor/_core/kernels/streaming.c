/* `mpitensor._core.kernels._streaming`: the shared-memory all-reduce's reduction of two inputs
 * into its destinations, with stores that bypass the cache.
 *
 * The shared-memory all-reduce (`_transport/shm`) reduces each piece of its slice from two
 * sources (this rank's input and a node peer's) into this rank's result, and copies it into
 * the peer's result: two writes of the whole slice into memory neither rank reads again
 * until the call is over. Ordinary stores first read each line they write (the cache must
 * own it), which doubles the memory traffic of those writes; non-temporal stores write
 * whole lines without reading them, as a large memcpy does. The sums are NumPy's own bits:
 * one IEEE addition per element, in the same order (a + b), with the floating-point mode
 * left as it is.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_23_API_VERSION
#include <numpy/arrayobject.h>

#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define VECTOR 16 /* bytes of one SSE2 vector, the alignment of a streamed store */

#if defined(__SSE2__)
/* out[i] = copy[i] = a[i] + b[i] (copy may be NULL): element by element up to the first
 * vector boundary of the destinations (which share their alignment), streamed from there,
 * and the tail element by element. */
#define ADD_LOOP(NAME, T, LANES, VTYPE, ADD, LOAD, STREAM)                               \
    static void NAME(const T *a, const T *b, T *out, T *copy, Py_ssize_t n) {            \
        Py_ssize_t i = 0;                                                                \
        for (; i < n && ((uintptr_t)(out + i) % VECTOR) != 0; i++) {                     \
            T sum = a[i] + b[i];                                                         \
            out[i] = sum;                                                                \
            if (copy) copy[i] = sum;                                                     \
        }                                                                                \
        for (; i + LANES <= n; i += LANES) {                                             \
            VTYPE sum = ADD(LOAD(a + i), LOAD(b + i));                                   \
            STREAM(out + i, sum);                                                        \
            if (copy) STREAM(copy + i, sum);                                             \
        }                                                                                \
        for (; i < n; i++) {                                                             \
            T sum = a[i] + b[i];                                                         \
            out[i] = sum;                                                                \
            if (copy) copy[i] = sum;                                                     \
        }                                                                                \
    }

ADD_LOOP(add_float, float, 4, __m128, _mm_add_ps, _mm_loadu_ps, _mm_stream_ps)
ADD_LOOP(add_double, double, 2, __m128d, _mm_add_pd, _mm_loadu_pd, _mm_stream_pd)
#endif

static int one_dimensional(PyObject *array, PyArray_Descr *descr, npy_intp size, int writable) {
    if (!PyArray_Check(array)) return 0;
    PyArrayObject *a = (PyArrayObject *)array;
    return PyArray_NDIM(a) == 1 && PyArray_IS_C_CONTIGUOUS(a) && PyArray_SIZE(a) == size &&
           PyArray_EquivTypes(PyArray_DESCR(a), descr) && PyArray_ISALIGNED(a) && PyArray_ISNOTSWAPPED(a) &&
           (!writable || PyArray_ISWRITEABLE(a));
}

PyDoc_STRVAR(add_doc,
"add(a, b, out, copy=None)\n--\n\n"
"out[:] = a + b, and copy[:] = out where given, with non-temporal stores; True if done.\n\n"
"All four are 1-D C-contiguous aligned arrays of one size and one native float32 or float64\n"
"dtype (out and copy writable, apart from a and b and from each other). Anything else returns\n"
"False and writes nothing (NumPy then reduces), as it does where the CPU has no SSE2.");

static PyObject *add(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs < 3 || nargs > 4) {
        PyErr_SetString(PyExc_TypeError, "add(a, b, out, copy=None)");
        return NULL;
    }
#if defined(__SSE2__)
    PyObject *copy = nargs == 4 && args[3] != Py_None ? args[3] : NULL;
    if (!PyArray_Check(args[0])) Py_RETURN_FALSE;
    PyArrayObject *a = (PyArrayObject *)args[0];
    PyArray_Descr *descr = PyArray_DESCR(a);
    npy_intp size = PyArray_SIZE(a);
    int type = PyArray_TYPE(a);
    if ((type != NPY_FLOAT && type != NPY_DOUBLE) || !one_dimensional(args[0], descr, size, 0) ||
        !one_dimensional(args[1], descr, size, 0) || !one_dimensional(args[2], descr, size, 1) ||
        (copy && !one_dimensional(copy, descr, size, 1)))
        Py_RETURN_FALSE;
    char *out = PyArray_BYTES((PyArrayObject *)args[2]), *second = copy ? PyArray_BYTES((PyArrayObject *)copy) : NULL;
    if (out == second || out == PyArray_BYTES(a) || out == PyArray_BYTES((PyArrayObject *)args[1])) Py_RETURN_FALSE;
    /* Destinations aligned alike stream together (shared-memory blocks are page-aligned). */
    if (second && ((uintptr_t)out % VECTOR) != ((uintptr_t)second % VECTOR)) Py_RETURN_FALSE;
    Py_BEGIN_ALLOW_THREADS
    if (type == NPY_FLOAT)
        add_float(PyArray_DATA(a), PyArray_DATA((PyArrayObject *)args[1]), (float *)out, (float *)second, size);
    else
        add_double(PyArray_DATA(a), PyArray_DATA((PyArrayObject *)args[1]), (double *)out, (double *)second, size);
    _mm_sfence(); /* the streamed lines are visible to the peers before this rank tells them anything */
    Py_END_ALLOW_THREADS
    Py_RETURN_TRUE;
#else
    Py_RETURN_FALSE;
#endif
}

static PyMethodDef methods[] = {
    {"add", (PyCFunction)(void (*)(void))add, METH_FASTCALL, add_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "mpitensor._core.kernels._streaming",
    "Reductions with non-temporal stores for the shared-memory all-reduce (see streaming.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__streaming(void) {
    import_array();
    return PyModule_Create(&module_def);
}
