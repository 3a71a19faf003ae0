/* The module `mpitensor._core.kernels._keys`: MAX/MIN keys of float32 and float64 (keys.h)
 * for NumPy arrays, in one pass where NumPy's code takes several: `OrderedKeys` encodes and
 * decodes with it, and `Extremum` combines with it. Each function returns False, writing
 * nothing, for arrays it does not take (NumPy's code then does the same, to the same bits).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_23_API_VERSION
#include <numpy/arrayobject.h>

#include "keys.h"

/* A C-contiguous, aligned, native float32 or float64 array (writable if asked) of `size`
 * elements and type `type` (-1: any of the two); its type, or -1. */
static int float_array(PyObject *object, int type, npy_intp size, int writable) {
    if (!PyArray_Check(object)) return -1;
    PyArrayObject *array = (PyArrayObject *)object;
    int found = PyArray_TYPE(array);
    if ((found != NPY_FLOAT && found != NPY_DOUBLE) || (type >= 0 && found != type)) return -1;
    if (!PyArray_IS_C_CONTIGUOUS(array) || !PyArray_ISALIGNED(array) || !PyArray_ISNOTSWAPPED(array)) return -1;
    if ((size >= 0 && PyArray_SIZE(array) != size) || (writable && !PyArray_ISWRITEABLE(array))) return -1;
    return found;
}

static int flag(PyObject *object, int *value) {
    int truth = PyObject_IsTrue(object);
    if (truth < 0) return -1;
    *value = truth;
    return 0;
}

PyDoc_STRVAR(encode_doc,
"encode(source, out, maximum)\n--\n\n"
"out[:] = the MAX (maximum true) or MIN keys of the floats `source`, as OrderedKeys.encode;\n"
"True if done. Both C-contiguous native float32 or float64 arrays of one dtype and size, out\n"
"writable (it may be source); anything else returns False and writes nothing.");

static PyObject *encode(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    int maximum;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "encode(source, out, maximum)");
        return NULL;
    }
    if (flag(args[2], &maximum) < 0) return NULL;
    int type = float_array(args[0], -1, -1, 0);
    npy_intp size = type < 0 ? 0 : PyArray_SIZE((PyArrayObject *)args[0]);
    if (type < 0 || float_array(args[1], type, size, 1) < 0) Py_RETURN_FALSE;
    keys_encode_loop(type == NPY_DOUBLE, maximum, PyArray_DATA((PyArrayObject *)args[0]),
                     PyArray_DATA((PyArrayObject *)args[1]), (int64_t)size);
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(decode_doc,
"decode(array)\n--\n\n"
"The keys in `array` turned back into floats, in place, as OrderedKeys.decode; True if done\n"
"(a writable C-contiguous native float32 or float64 array), else False.");

static PyObject *decode(PyObject *module, PyObject *array) {
    (void)module;
    int type = float_array(array, -1, -1, 1);
    if (type < 0) Py_RETURN_FALSE;
    keys_decode_loop(type == NPY_DOUBLE, PyArray_DATA((PyArrayObject *)array),
                     (int64_t)PyArray_SIZE((PyArrayObject *)array));
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(extremum_doc,
"extremum(a, b, out, maximum)\n--\n\n"
"out[:] = the MAX (maximum true) or MIN of a and b element by element, as Extremum: the float\n"
"whose key is the larger (smaller), so NaN gives the canonical NaN and +0.0 wins MAX, -0.0\n"
"MIN; True if done. C-contiguous native float32 or float64 arrays of one dtype and size, out\n"
"writable (it may be a or b); anything else returns False and writes nothing.");

static PyObject *extremum(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    int maximum;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "extremum(a, b, out, maximum)");
        return NULL;
    }
    if (flag(args[3], &maximum) < 0) return NULL;
    int type = float_array(args[0], -1, -1, 0);
    npy_intp size = type < 0 ? 0 : PyArray_SIZE((PyArrayObject *)args[0]);
    if (type < 0 || float_array(args[1], type, size, 0) < 0 || float_array(args[2], type, size, 1) < 0)
        Py_RETURN_FALSE;
    keys_extremum_loop(type == NPY_DOUBLE, maximum, PyArray_DATA((PyArrayObject *)args[0]),
                       PyArray_DATA((PyArrayObject *)args[1]), PyArray_DATA((PyArrayObject *)args[2]),
                       (int64_t)size);
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"encode", (PyCFunction)(void (*)(void))encode, METH_FASTCALL, encode_doc},
    {"decode", decode, METH_O, decode_doc},
    {"extremum", (PyCFunction)(void (*)(void))extremum, METH_FASTCALL, extremum_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "mpitensor._core.kernels._keys",
    "MAX/MIN keys of float32 and float64 in one pass (see keys.h).", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__keys(void) {
    import_array();
    return PyModule_Create(&module_def);
}
