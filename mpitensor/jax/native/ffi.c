/* The module `mpitensor.jax._ffi`: one XLA FFI handler that runs mpitensor's collectives
 * inside compiled JAX programs.
 *
 * XLA calls the handler with its own buffers. The handler views them as NumPy arrays (the
 * inputs read-only, the results writable, no copy) and hands them to the Python runner with
 * the call site's number; the runner calls the eager collective with the result as `out=`,
 * so a compiled call gets the consistency check, the timeouts and the fail-fast of every
 * other call. A Python exception becomes an XLA error carrying its type and message, which
 * JAX raises on the calling rank.
 *
 * Only the XLA FFI C API is used (its header ships beside this file), so the build needs
 * neither jaxlib nor a C++ compiler.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_23_API_VERSION
#include <numpy/arrayobject.h>
#include <string.h>

#include "xla_ffi_c_api.h"

static PyObject *runner; /* the Python callable: runner(site, inputs, results) */

/* XLA's data types that NumPy has; any other comes as bytes the runner views. */
static int numpy_type(XLA_FFI_DataType dtype) {
    switch (dtype) {
    case XLA_FFI_DataType_PRED: return NPY_BOOL;
    case XLA_FFI_DataType_S8: return NPY_INT8;
    case XLA_FFI_DataType_S16: return NPY_INT16;
    case XLA_FFI_DataType_S32: return NPY_INT32;
    case XLA_FFI_DataType_S64: return NPY_INT64;
    case XLA_FFI_DataType_U8: return NPY_UINT8;
    case XLA_FFI_DataType_U16: return NPY_UINT16;
    case XLA_FFI_DataType_U32: return NPY_UINT32;
    case XLA_FFI_DataType_U64: return NPY_UINT64;
    case XLA_FFI_DataType_F16: return NPY_FLOAT16;
    case XLA_FFI_DataType_F32: return NPY_FLOAT32;
    case XLA_FFI_DataType_F64: return NPY_FLOAT64;
    case XLA_FFI_DataType_C64: return NPY_COMPLEX64;
    case XLA_FFI_DataType_C128: return NPY_COMPLEX128;
    default: return -1;
    }
}

static size_t element_bytes(XLA_FFI_DataType dtype) {
    switch (dtype) {
    case XLA_FFI_DataType_BF16: case XLA_FFI_DataType_F16:
    case XLA_FFI_DataType_S16: case XLA_FFI_DataType_U16: return 2;
    case XLA_FFI_DataType_S32: case XLA_FFI_DataType_U32: case XLA_FFI_DataType_F32: return 4;
    case XLA_FFI_DataType_S64: case XLA_FFI_DataType_U64: case XLA_FFI_DataType_F64:
    case XLA_FFI_DataType_C64: return 8;
    case XLA_FFI_DataType_C128: return 16;
    default: return 1;
    }
}

/* A NumPy array over an XLA buffer, writable or not; NULL with an exception set. */
static PyObject *view(const XLA_FFI_Buffer *buffer, int writable) {
    int flags = NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED | (writable ? NPY_ARRAY_WRITEABLE : 0);
    int type = numpy_type(buffer->dtype);
    if (type >= 0) {
        npy_intp dims[NPY_MAXDIMS];
        if (buffer->rank > NPY_MAXDIMS) {
            PyErr_SetString(PyExc_ValueError, "an XLA buffer has more dimensions than NumPy allows");
            return NULL;
        }
        for (int64_t i = 0; i < buffer->rank; i++) dims[i] = (npy_intp)buffer->dims[i];
        return PyArray_New(&PyArray_Type, (int)buffer->rank, dims, type, NULL, buffer->data, 0, flags, NULL);
    }
    npy_intp nbytes = (npy_intp)element_bytes(buffer->dtype);
    for (int64_t i = 0; i < buffer->rank; i++) nbytes *= (npy_intp)buffer->dims[i];
    return PyArray_New(&PyArray_Type, 1, &nbytes, NPY_UINT8, NULL, buffer->data, 0, flags, NULL);
}

/* The buffers of a call's arguments or results, tokens left out, as a tuple of views. */
static PyObject *views(int64_t size, void **items, int writable) {
    PyObject *list = PyList_New(0);
    if (list == NULL) return NULL;
    for (int64_t i = 0; i < size; i++) {
        const XLA_FFI_Buffer *buffer = (const XLA_FFI_Buffer *)items[i];
        if (buffer->dtype == XLA_FFI_DataType_TOKEN) continue;
        PyObject *array = view(buffer, writable);
        if (array == NULL || PyList_Append(list, array) < 0) {
            Py_XDECREF(array);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(array);
    }
    PyObject *tuple = PyList_AsTuple(list);
    Py_DECREF(list);
    return tuple;
}

/* The call's int64 attribute `site`, or -1 where it has none. */
static int64_t site_of(const XLA_FFI_Attrs *attrs) {
    for (int64_t i = 0; i < attrs->size; i++) {
        const XLA_FFI_ByteSpan *name = attrs->names[i];
        if (attrs->types[i] != XLA_FFI_AttrType_SCALAR || name->len != 4 || memcmp(name->ptr, "site", 4) != 0)
            continue;
        const XLA_FFI_Scalar *scalar = (const XLA_FFI_Scalar *)attrs->attrs[i];
        if (scalar->dtype == XLA_FFI_DataType_S64) return *(const int64_t *)scalar->value;
    }
    return -1;
}

static XLA_FFI_Error *xla_error(const XLA_FFI_CallFrame *frame, const char *message) {
    XLA_FFI_Error_Create_Args args;
    memset(&args, 0, sizeof args);
    args.struct_size = XLA_FFI_Error_Create_Args_STRUCT_SIZE;
    args.message = message;
    args.errc = XLA_FFI_Error_Code_INTERNAL;
    return frame->api->XLA_FFI_Error_Create(&args);
}

/* The pending Python exception as an XLA error ("Type: message"); clears it. */
static XLA_FFI_Error *error_from_python(const XLA_FFI_CallFrame *frame) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    PyObject *text = value == NULL ? NULL : PyUnicode_FromFormat("%s: %S", Py_TYPE(value)->tp_name, value);
    const char *message = text == NULL ? NULL : PyUnicode_AsUTF8(text);
    if (message == NULL) PyErr_Clear();
    XLA_FFI_Error *error = xla_error(frame, message == NULL ? "mpitensor: a collective failed" : message);
    Py_XDECREF(text);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
    return error;
}

static PyObject *run(const XLA_FFI_CallFrame *frame, int64_t site) {
    PyObject *inputs = views(frame->args.size, frame->args.args, 0);
    PyObject *results = inputs == NULL ? NULL : views(frame->rets.size, frame->rets.rets, 1);
    PyObject *done = NULL;
    if (results != NULL) done = PyObject_CallFunction(runner, "LOO", (long long)site, inputs, results);
    Py_XDECREF(inputs);
    Py_XDECREF(results);
    return done;
}

static XLA_FFI_Error *handler(XLA_FFI_CallFrame *frame) {
    XLA_FFI_Extension_Base *extension = frame->extension_start;
    if (extension != NULL && extension->type == XLA_FFI_Extension_Metadata) {
        XLA_FFI_Metadata *metadata = ((XLA_FFI_Metadata_Extension *)extension)->metadata;
        metadata->api_version.major_version = XLA_FFI_API_MAJOR;
        metadata->api_version.minor_version = XLA_FFI_API_MINOR;
        metadata->traits = 0;
        return NULL;
    }
    if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return NULL;
    int64_t site = site_of(&frame->attrs);
    if (site < 0 || runner == NULL) return xla_error(frame, "mpitensor: a compiled collective without its call site");
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *done = run(frame, site);
    XLA_FFI_Error *error = done == NULL ? error_from_python(frame) : NULL;
    Py_XDECREF(done);
    PyGILState_Release(gil);
    return error;
}

PyDoc_STRVAR(capsule_doc,
"capsule()\n--\n\nThe handler, as the capsule `jax.ffi.register_ffi_target` takes.");

static PyObject *capsule(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    return PyCapsule_New((void *)handler, NULL, NULL);
}

PyDoc_STRVAR(set_runner_doc,
"set_runner(runner)\n--\n\n"
"Set the callable the handler calls: runner(site: int, inputs: tuple, results: tuple).");

static PyObject *set_runner(PyObject *module, PyObject *callable) {
    (void)module;
    if (!PyCallable_Check(callable)) {
        PyErr_SetString(PyExc_TypeError, "set_runner() needs a callable");
        return NULL;
    }
    Py_INCREF(callable);
    Py_XSETREF(runner, callable);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"capsule", capsule, METH_NOARGS, capsule_doc},
    {"set_runner", set_runner, METH_O, set_runner_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "mpitensor.jax._ffi",
    "The XLA FFI handler that runs mpitensor's collectives inside compiled JAX programs.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__ffi(void) {
    import_array();
    return PyModule_Create(&module_def);
}
