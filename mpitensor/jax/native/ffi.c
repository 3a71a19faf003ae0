/* The module `mpitensor.jax._ffi`: one XLA FFI handler that runs mpitensor's collectives
 * inside compiled JAX programs.
 *
 * XLA calls the handler with its own buffers. The handler views them as NumPy arrays (the
 * inputs read-only, the results writable, no copy) and hands them to the Python runner with
 * the call site's number; the runner calls the eager collective with the result as `out=`,
 * so a compiled call gets the consistency check, the timeouts and the fail-fast of every
 * other call. A Python exception becomes an XLA error carrying its type and message, which
 * JAX raises on the calling rank. A runner may hand back a fast path for its site (an
 * all-reduce: its compiled lane's `run_into` or `run_held`): later calls go straight to it,
 * with no Python frame, while the context it belongs to is the innermost open one.
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
static PyObject *open_contexts; /* mpitensor's stack of open contexts (a list) */

/* A call site's fast path, where its runner gave one: `run(input, result)` with no Python
 * around it (True: done; None: declined, the runner takes the call), while `ctx` is the
 * innermost open context. */
typedef struct {
    PyObject *ctx, *run;
} Fast;

static Fast *fasts;
static int64_t fast_count;

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

/* The bytes of one element; 0 for the types XLA packs several to a byte. */
static size_t element_bytes(XLA_FFI_DataType dtype) {
    switch (dtype) {
    case XLA_FFI_DataType_S1: case XLA_FFI_DataType_S2: case XLA_FFI_DataType_S4:
    case XLA_FFI_DataType_U1: case XLA_FFI_DataType_U2: case XLA_FFI_DataType_U4:
    case XLA_FFI_DataType_F4E2M1FN: return 0;
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
    if (nbytes == 0) {
        /* The collectives refuse these types as they are traced (mpitensor/jax/_dtypes.py):
         * a view of one byte per element would reach past XLA's buffer. */
        PyErr_Format(PyExc_TypeError, "mpitensor.jax: XLA data type %d is packed several values to a byte, "
                     "which no collective moves", (int)buffer->dtype);
        return NULL;
    }
    for (int64_t i = 0; i < buffer->rank; i++) nbytes *= (npy_intp)buffer->dims[i];
    return PyArray_New(&PyArray_Type, 1, &nbytes, NPY_UINT8, NULL, buffer->data, 0, flags, NULL);
}

/* The buffers of a call's arguments or results, tokens left out, as a tuple of views. */
static PyObject *views(int64_t size, void **items, int writable) {
    Py_ssize_t count = 0;
    for (int64_t i = 0; i < size; i++)
        if (((const XLA_FFI_Buffer *)items[i])->dtype != XLA_FFI_DataType_TOKEN) count++;
    PyObject *tuple = PyTuple_New(count);
    if (tuple == NULL) return NULL;
    Py_ssize_t at = 0;
    for (int64_t i = 0; i < size; i++) {
        const XLA_FFI_Buffer *buffer = (const XLA_FFI_Buffer *)items[i];
        if (buffer->dtype == XLA_FFI_DataType_TOKEN) continue;
        PyObject *array = view(buffer, writable);
        if (array == NULL) {
            Py_DECREF(tuple);
            return NULL;
        }
        PyTuple_SET_ITEM(tuple, at++, array);
    }
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

/* The call on its site's fast path: 1 done, 0 not taken (no fast path, another context, or
 * declined), -1 failed with the Python error set. */
static int run_fast(const XLA_FFI_CallFrame *frame, int64_t site) {
    if (site >= fast_count || fasts[site].run == NULL) return 0;
    Py_ssize_t open = PyList_GET_SIZE(open_contexts);
    if (open == 0 || PyList_GET_ITEM(open_contexts, open - 1) != fasts[site].ctx) {
        /* Its context is closed or another is open: the runner finds the lane of that one. */
        Py_CLEAR(fasts[site].ctx);
        Py_CLEAR(fasts[site].run);
        return 0;
    }
    PyObject *inputs = views(frame->args.size, frame->args.args, 0);
    PyObject *results = inputs == NULL ? NULL : views(frame->rets.size, frame->rets.rets, 1);
    int taken = results == NULL ? -1 : 0;
    if (taken == 0 && PyTuple_GET_SIZE(inputs) == 1 && PyTuple_GET_SIZE(results) == 1) {
        PyObject *args[2] = {PyTuple_GET_ITEM(inputs, 0), PyTuple_GET_ITEM(results, 0)};
        /* Its own reference: a context closed meanwhile (a failure) drops the path. */
        PyObject *call = Py_NewRef(fasts[site].run);
        PyObject *done = PyObject_Vectorcall(call, args, 2, NULL);
        Py_DECREF(call);
        taken = done == NULL ? -1 : done != Py_None;
        Py_XDECREF(done);
    }
    Py_XDECREF(inputs);
    Py_XDECREF(results);
    return taken;
}

static PyObject *run(const XLA_FFI_CallFrame *frame, int64_t site) {
    PyObject *inputs = views(frame->args.size, frame->args.args, 0);
    PyObject *results = inputs == NULL ? NULL : views(frame->rets.size, frame->rets.rets, 1);
    PyObject *number = results == NULL ? NULL : PyLong_FromLongLong((long long)site);
    PyObject *done = NULL;
    if (number != NULL) {
        PyObject *args[3] = {number, inputs, results};
        done = PyObject_Vectorcall(runner, args, 3, NULL);
    }
    Py_XDECREF(number);
    Py_XDECREF(inputs);
    Py_XDECREF(results);
    return done;
}

/* XLA calls the handler on threads of its own, which Python does not know. PyGILState_Ensure
 * gives such a thread a thread state, and the matching Release deletes it again, with every
 * threading.local of that thread: a few microseconds per call, and state the runner keeps
 * per thread lost. So the first call on a thread takes one more reference that is never
 * released: the thread state lives as long as the thread (or the interpreter). */
static _Thread_local int pinned;

static void pin_thread_state(void) {
    if (pinned) return;
    PyGILState_STATE gil = PyGILState_Ensure();
    if (gil == PyGILState_UNLOCKED) {
        /* Keep the reference, give the GIL back: the later Ensure/Release pairs take it. */
        PyGILState_Ensure();
        PyGILState_Release(gil);
    }
    pinned = 1;
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
    pin_thread_state();
    PyGILState_STATE gil = PyGILState_Ensure();
    int fast = run_fast(frame, site);
    PyObject *done = fast == 0 ? run(frame, site) : NULL;
    XLA_FFI_Error *error = fast < 0 || (fast == 0 && done == NULL) ? error_from_python(frame) : NULL;
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
"set_runner(runner, open_contexts)\n--\n\n"
"Set the callable the handler calls, runner(site: int, inputs: tuple, results: tuple), and\n"
"the list of open contexts (innermost last) that fast paths are checked against.");

static PyObject *set_runner(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2 || !PyCallable_Check(args[0]) || !PyList_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "set_runner(runner, open_contexts) needs a callable and a list");
        return NULL;
    }
    Py_XSETREF(runner, Py_NewRef(args[0]));
    Py_XSETREF(open_contexts, Py_NewRef(args[1]));
    Py_RETURN_NONE;
}

PyDoc_STRVAR(set_fast_doc,
"set_fast(site, ctx, run)\n--\n\n"
"Give call site `site` a fast path: while `ctx` is the innermost open context, the handler\n"
"calls run(input, result) on the call's one input and one result, without the runner; True\n"
"means done, None declined (the runner takes the call). The path is dropped once another\n"
"context is innermost, or by forget(ctx).");

static PyObject *set_fast(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    int64_t site = nargs == 3 ? PyLong_AsLongLong(args[0]) : -1;
    if (site < 0 || !PyCallable_Check(args[2])) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "set_fast(site, ctx, run) needs a site number and a callable");
        return NULL;
    }
    if (site >= fast_count) {
        int64_t count = site + 16;
        Fast *grown = PyMem_Realloc(fasts, (size_t)count * sizeof(Fast));
        if (grown == NULL) return PyErr_NoMemory();
        memset(grown + fast_count, 0, (size_t)(count - fast_count) * sizeof(Fast));
        fasts = grown;
        fast_count = count;
    }
    Py_XSETREF(fasts[site].ctx, Py_NewRef(args[1]));
    Py_XSETREF(fasts[site].run, Py_NewRef(args[2]));
    Py_RETURN_NONE;
}

PyDoc_STRVAR(forget_doc,
"forget(ctx)\n--\n\n"
"Drop the fast paths of context `ctx` (it is closing), so that they do not keep it alive.");

static PyObject *forget(PyObject *module, PyObject *ctx) {
    (void)module;
    for (int64_t site = 0; site < fast_count; site++)
        if (fasts[site].ctx == ctx) {
            Py_CLEAR(fasts[site].ctx);
            Py_CLEAR(fasts[site].run);
        }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"capsule", capsule, METH_NOARGS, capsule_doc},
    {"set_runner", (PyCFunction)(void (*)(void))set_runner, METH_FASTCALL, set_runner_doc},
    {"set_fast", (PyCFunction)(void (*)(void))set_fast, METH_FASTCALL, set_fast_doc},
    {"forget", forget, METH_O, forget_doc},
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
