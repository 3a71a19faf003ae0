/* The per-leaf work of a fused all-reduce, in C loops: its hundreds of leaves cost microseconds.
 *
 * `fused.py` unwraps the leaves (Tensors to their arrays), checks that each is a
 * C-contiguous host array of a dtype MPI carries as it is, packs them into a bucket, and
 * gives back a Tensor per leaf viewing the bucket's result. In NumPy that is about a
 * microsecond per leaf (a concatenate, a view and a Tensor each); here each leaf is a few
 * pointer reads, a memcpy and two allocations. Only the usual case is handled (every leaf
 * of one dtype, one bucket); `fused.py` does every other in NumPy.
 */
#include "native.h"

const char plain_leaves_doc[] =
"plain_leaves(values, host, plain)\n--\n\n"
"The arrays and devices of `values` when every one is a C-contiguous NumPy array (bare, or in\n"
"a Tensor) of one dtype found in the set `plain`; else None.\n\n"
"A bare array's device is `host`, a Tensor's its own. Returns (arrays, devices), two lists.";

PyObject *plain_leaves(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3 || !PyList_Check(args[0]) || !PyAnySet_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "plain_leaves(values: list, host, plain: set)");
        return NULL;
    }
    if (!consts.bound) Py_RETURN_NONE;
    PyObject *values = args[0], *host = args[1];
    Py_ssize_t count = PyList_GET_SIZE(values);
    PyObject *arrays = PyList_New(count), *devices = arrays == NULL ? NULL : PyList_New(count);
    if (devices == NULL) goto fail;
    PyArray_Descr *kind = NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *value = PyList_GET_ITEM(values, i), *array = value, *device = host;
        if (Py_IS_TYPE(value, types.tensor_type)) {
            array = TENSOR(value)->array;
            device = TENSOR(value)->device;
        }
        if (array == NULL || device == NULL || !PyArray_CheckExact(array) ||
            !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)array))
            goto other;
        PyArray_Descr *descr = PyArray_DESCR((PyArrayObject *)array);
        if (kind == NULL) {
            int known = PySet_Contains(args[2], (PyObject *)descr);
            if (known < 0) goto fail;
            if (!known) goto other;
            kind = descr;
        } else if (descr != kind) {
            goto other; /* mixed dtypes: fused.py plans a bucket per kind */
        }
        PyList_SET_ITEM(arrays, i, Py_NewRef(array));
        PyList_SET_ITEM(devices, i, Py_NewRef(device));
    }
    PyObject *pair = PyTuple_Pack(2, arrays, devices);
    Py_DECREF(arrays);
    Py_DECREF(devices);
    return pair;
other:
    Py_DECREF(arrays);
    Py_DECREF(devices);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(arrays);
    Py_XDECREF(devices);
    return NULL;
}

/* `out` is a C-contiguous 1-D array holding exactly the arrays' elements, all of its dtype. */
static int fits(PyObject *arrays, PyObject *out) {
    if (!PyList_Check(arrays) || !PyArray_Check(out) || PyArray_NDIM((PyArrayObject *)out) != 1 ||
        !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)out)) {
        PyErr_SetString(PyExc_TypeError, "a list of arrays and a 1-D C-contiguous array");
        return 0;
    }
    PyArray_Descr *descr = PyArray_DESCR((PyArrayObject *)out);
    npy_intp total = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(arrays); i++) {
        PyObject *array = PyList_GET_ITEM(arrays, i);
        if (!PyArray_Check(array) || !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)array) ||
            !PyArray_EquivTypes(PyArray_DESCR((PyArrayObject *)array), descr)) {
            PyErr_Format(PyExc_TypeError, "leaf %zd is not a C-contiguous array of the bucket's dtype", i);
            return 0;
        }
        total += PyArray_SIZE((PyArrayObject *)array);
    }
    if (total != PyArray_SIZE((PyArrayObject *)out)) {
        PyErr_SetString(PyExc_ValueError, "the bucket's size is not the leaves' total");
        return 0;
    }
    return 1;
}

const char pack_doc[] =
"pack(arrays, out)\n--\n\n"
"Copy `arrays` (C-contiguous, of `out`'s dtype) one after the other into `out` (1-D, holding\n"
"exactly their elements): numpy.concatenate(arrays, axis=None, out=out) for one dtype.\n\n"
"Raises:\n    TypeError, ValueError: the arrays do not fit `out`.";

PyObject *pack_leaves(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2 || !fits(args[0], args[1])) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "pack(arrays, out)");
        return NULL;
    }
    char *target = PyArray_BYTES((PyArrayObject *)args[1]);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(args[0]); i++) {
        PyArrayObject *array = (PyArrayObject *)PyList_GET_ITEM(args[0], i);
        size_t nbytes = (size_t)PyArray_NBYTES(array);
        memcpy(target, PyArray_DATA(array), nbytes);
        target += nbytes;
    }
    Py_RETURN_NONE;
}

/* A view of `out` from `data` on, in the shape of `like`. */
static PyObject *view_of(PyObject *out, PyArrayObject *like, char *data) {
    PyArray_Descr *descr = PyArray_DESCR((PyArrayObject *)out);
    Py_INCREF(descr);
    PyObject *view = PyArray_NewFromDescr(&PyArray_Type, descr, PyArray_NDIM(like), PyArray_DIMS(like), NULL, data,
                                          PyArray_FLAGS((PyArrayObject *)out) & NPY_ARRAY_WRITEABLE, NULL);
    if (view == NULL) return NULL;
    if (PyArray_SetBaseObject((PyArrayObject *)view, Py_NewRef(out)) < 0) {
        Py_DECREF(view);
        return NULL;
    }
    return view;
}

const char unpack_doc[] =
"unpack(out, arrays, devices)\n--\n\n"
"Tensors on `devices` viewing `out` (a packed bucket, see `pack`) in the shapes of `arrays`,\n"
"one after the other: the fused all-reduce's result tensors. Returns a list.";

PyObject *unpack_leaves(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3 || !fits(args[1], args[0]) || !PyList_Check(args[2]) ||
        PyList_GET_SIZE(args[2]) != PyList_GET_SIZE(args[1]) || !consts.bound) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "unpack(out, arrays, devices) of a bound module");
        return NULL;
    }
    PyObject *out = args[0];
    Py_ssize_t count = PyList_GET_SIZE(args[1]);
    PyObject *tensors = PyList_New(count);
    if (tensors == NULL) return NULL;
    char *data = PyArray_BYTES((PyArrayObject *)out);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyArrayObject *like = (PyArrayObject *)PyList_GET_ITEM(args[1], i);
        PyObject *view = view_of(out, like, data);
        PyObject *tensor = view == NULL ? NULL : make_tensor(view, PyList_GET_ITEM(args[2], i));
        Py_XDECREF(view);
        if (tensor == NULL) {
            Py_DECREF(tensors);
            return NULL;
        }
        PyList_SET_ITEM(tensors, i, tensor);
        data += PyArray_NBYTES(like);
    }
    return tensors;
}
