/* MEAN's division of a lane's result, as the callable an op's `finish` is.
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
