/* The finishes of a lane's result (MEAN's division; MAX/MIN keys decoded), as the callables
 * an op's `finish` is.
 *
 * The engine runs `op.finish()` when it completes an op (`Engine._complete`), and the
 * compiled resolve runs it too; for a lane it is `finish_reduction`'s division, done here
 * as NumPy's ``true_divide(result, size, out=result)`` does it for float32 and float64
 * (one correctly rounded division per element, in the array's own precision).
 */
#include "native.h"

typedef struct {
    PyObject_HEAD
    PyObject *array;
    int size;
} Divide;

static int Divide_init(PyObject *self, PyObject *args, PyObject *kwargs) {
    Divide *divide = (Divide *)self;
    PyObject *array;
    int size;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0) {
        PyErr_SetString(PyExc_TypeError, "Divide(array, size) takes no keywords");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "O!i", &PyArray_Type, &array, &size)) return -1;
    if (size < 1 || !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)array) ||
        divide_in_place(PyArray_TYPE((PyArrayObject *)array), NULL, 0, size) < 0) {
        PyErr_SetString(PyExc_ValueError, "Divide takes a C-contiguous float32 or float64 array and a size >= 1");
        return -1;
    }
    Py_XSETREF(divide->array, Py_NewRef(array));
    divide->size = size;
    return 0;
}

static PyObject *Divide_call(PyObject *self, PyObject *args, PyObject *kwargs) {
    Divide *divide = (Divide *)self;
    if (PyTuple_GET_SIZE(args) != 0 || (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0)) {
        PyErr_SetString(PyExc_TypeError, "a Divide takes no arguments");
        return NULL;
    }
    PyArrayObject *array = (PyArrayObject *)divide->array;
    divide_in_place(PyArray_TYPE(array), PyArray_DATA(array), PyArray_SIZE(array), divide->size);
    Py_RETURN_NONE;
}

static int Divide_traverse(PyObject *self, visitproc visit, void *arg) {
    Py_VISIT(((Divide *)self)->array);
    return 0;
}

static int Divide_clear(PyObject *self) {
    Py_CLEAR(((Divide *)self)->array);
    return 0;
}

static void Divide_dealloc(PyObject *self) {
    PyObject_GC_UnTrack(self);
    Divide_clear(self);
    Py_TYPE(self)->tp_free(self);
}

PyDoc_STRVAR(Divide_doc,
"Divide(array, size)\n--\n\n"
"A callable dividing `array` (float32 or float64, C-contiguous) by `size` in place: MEAN's\n"
"finish, as NumPy's true_divide(array, size, out=array).");

PyTypeObject DivideType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpitensor._collectives.native._lanes.Divide",
    .tp_basicsize = sizeof(Divide),
    .tp_dealloc = Divide_dealloc,
    .tp_call = Divide_call,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = Divide_doc,
    .tp_traverse = Divide_traverse,
    .tp_clear = Divide_clear,
    .tp_init = Divide_init,
    .tp_new = PyType_GenericNew,
};

/* MAX/MIN's finish of a lane whose MPI reduced keys: the keys turned back into floats, in
 * place, as `OrderedKeys.decode` does. */
typedef struct {
    PyObject_HEAD
    PyObject *array;
} Decode;

static int Decode_init(PyObject *self, PyObject *args, PyObject *kwargs) {
    PyObject *array;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0) {
        PyErr_SetString(PyExc_TypeError, "Decode(array) takes no keywords");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "O!", &PyArray_Type, &array)) return -1;
    if (!PyArray_IS_C_CONTIGUOUS((PyArrayObject *)array) || !keys_supported(PyArray_TYPE((PyArrayObject *)array))) {
        PyErr_SetString(PyExc_ValueError, "Decode takes a C-contiguous float32 or float64 array");
        return -1;
    }
    Py_XSETREF(((Decode *)self)->array, Py_NewRef(array));
    return 0;
}

static PyObject *Decode_call(PyObject *self, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) != 0 || (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0)) {
        PyErr_SetString(PyExc_TypeError, "a Decode takes no arguments");
        return NULL;
    }
    PyArrayObject *array = (PyArrayObject *)((Decode *)self)->array;
    keys_decode(PyArray_TYPE(array), PyArray_DATA(array), PyArray_SIZE(array));
    Py_RETURN_NONE;
}

static int Decode_traverse(PyObject *self, visitproc visit, void *arg) {
    Py_VISIT(((Decode *)self)->array);
    return 0;
}

static int Decode_clear(PyObject *self) {
    Py_CLEAR(((Decode *)self)->array);
    return 0;
}

static void Decode_dealloc(PyObject *self) {
    PyObject_GC_UnTrack(self);
    Decode_clear(self);
    Py_TYPE(self)->tp_free(self);
}

PyDoc_STRVAR(Decode_doc,
"Decode(array)\n--\n\n"
"A callable turning the MAX/MIN keys in `array` (float32 or float64, C-contiguous) back into\n"
"floats in place: the finish of a lane whose MPI reduced keys, as OrderedKeys.decode(array).");

PyTypeObject DecodeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpitensor._collectives.native._lanes.Decode",
    .tp_basicsize = sizeof(Decode),
    .tp_dealloc = Decode_dealloc,
    .tp_call = Decode_call,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = Decode_doc,
    .tp_traverse = Decode_traverse,
    .tp_clear = Decode_clear,
    .tp_init = Decode_init,
    .tp_new = PyType_GenericNew,
};
