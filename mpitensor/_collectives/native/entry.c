/* The public `all_reduce` with a compiled front: calls of a kind with a compiled lane start
 * on it without a Python frame; every other call goes to the Python function it wraps.
 *
 * Lanes are found in a small cache of the lanes started lately, matched on the exact
 * objects of the call (the current context, the dtype object, the op argument) and on the
 * shape. A call the cache does not know goes to the Python wrapper (`lane.with_lane`),
 * whose lookup of the context's lanes compares dtypes, shapes and ops by equality; a
 * compiled lane started from there enters the cache. A lane is only ever a correct lane for
 * the calls it matches, so the cache can hold any of them: entries of a context give way to
 * a newer context's. A context that closes drops its entries at once (`forget`, from the
 * lanes' `free` when the context frees its groups): the cache must not keep it alive.
 */
#include "native.h"

#include <stddef.h>
#include <string.h>

#define CACHE_SIZE 8

/* The lanes started lately, newest last (`next` the slot the next one takes). */
typedef struct {
    PyObject *lanes[CACHE_SIZE];
    int next;
} LaneCache;

/* Ordinary calls' lanes; and the lanes of held all-reduces in place on the full group (the
 * lanes of their kept plans, `keep_held`), which a call `all_reduce(array, op, held=True)` starts. */
static LaneCache ordinary, held;

static void cache_insert(LaneCache *cache, PyObject *lane) {
    for (int i = 0; i < CACHE_SIZE; i++)
        if (cache->lanes[i] == lane) return;
    /* A lane of another context than the newest entry's: the older context's entries go. */
    PyObject *last = cache->lanes[(cache->next + CACHE_SIZE - 1) % CACHE_SIZE];
    if (last != NULL && lane_context(last) != lane_context(lane))
        for (int i = 0; i < CACHE_SIZE; i++) Py_CLEAR(cache->lanes[i]);
    Py_XSETREF(cache->lanes[cache->next], Py_NewRef(lane));
    cache->next = (cache->next + 1) % CACHE_SIZE;
}

static PyObject *cache_find(LaneCache *cache, PyObject *ctx, PyArrayObject *array, PyObject *op) {
    for (int i = 0; i < CACHE_SIZE; i++)
        if (cache->lanes[i] != NULL && lane_matches(cache->lanes[i], ctx, array, op)) return cache->lanes[i];
    return NULL;
}

void lane_cache_insert(PyObject *lane) { cache_insert(&ordinary, lane); }

PyObject *lane_cache_find(PyObject *ctx, PyArrayObject *array, PyObject *op) {
    return cache_find(&ordinary, ctx, array, op);
}

const char forget_doc[] =
"forget(ctx)\n--\n\n"
"Drop the caches' lanes of context `ctx` (which is closing), and with them the caches' references to it.";

PyObject *lane_cache_forget(PyObject *module, PyObject *ctx) {
    (void)module;
    for (int i = 0; i < CACHE_SIZE; i++) {
        if (ordinary.lanes[i] != NULL && lane_context(ordinary.lanes[i]) == ctx) Py_CLEAR(ordinary.lanes[i]);
        if (held.lanes[i] != NULL && lane_context(held.lanes[i]) == ctx) Py_CLEAR(held.lanes[i]);
    }
    Py_RETURN_NONE;
}

const char keep_held_doc[] =
"keep_held(lane)\n--\n\n"
"Have the entry start calls `all_reduce(array, op, held=True)` of `lane`'s kind (its context,\n"
"op object, dtype object and shape) on `lane`: the compiled lane of the kept plan of held\n"
"all-reduces in place on the full group (a COPY or CHECK lane reducing into the input, or a\n"
"HELD lane in place), which the Python path found for such a call.\n\n"
"Raises:\n    TypeError: `lane` is not such a lane.";

PyObject *keep_held(PyObject *module, PyObject *lane) {
    (void)module;
    if (!lane_held_in_place(lane)) {
        PyErr_SetString(PyExc_TypeError, "keep_held(lane) takes an all-reduce lane that can reduce in place");
        return NULL;
    }
    cache_insert(&held, lane);
    Py_RETURN_NONE;
}

const char find_lane_doc[] =
"find_lane(ctx, array, op)\n--\n\n"
"The compiled lane the entry holds for calls all_reduce(array, op) on `ctx` (`op` as the calls\n"
"give it, the same object), or None.";

PyObject *find_lane(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "find_lane(ctx, array, op) takes 3 arguments");
        return NULL;
    }
    PyObject *lane = PyArray_CheckExact(args[1]) ? lane_cache_find(args[0], (PyArrayObject *)args[1], args[2]) : NULL;
    return Py_NewRef(lane == NULL ? Py_None : lane);
}

typedef struct {
    PyObject_HEAD
    PyObject *general;
    PyObject *dict;
    vectorcallfunc vectorcall;
} Entry;

/* input, op and devices of a call `all_reduce(input, op=None, devices=None)` (`*in_place`
 * 0), or of `all_reduce(input, op=None, devices=None, held=True)` (`*in_place` 1); 0 when the
 * call has anything else (the general path takes it). */
static int parse_call(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, PyObject **input, PyObject **op,
                      PyObject **devices, int *in_place) {
    if (nargs < 1 || nargs > 3) return 0;
    *input = args[0];
    *op = nargs >= 2 ? args[1] : Py_None;
    *devices = nargs == 3 ? args[2] : Py_None;
    *in_place = 0;
    Py_ssize_t keywords = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t i = 0; i < keywords; i++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, i), *value = args[nargs + i];
        if (nargs < 2 && PyUnicode_CompareWithASCIIString(name, "op") == 0)
            *op = value;
        else if (nargs < 3 && PyUnicode_CompareWithASCIIString(name, "devices") == 0)
            *devices = value;
        else if (value == Py_True && PyUnicode_CompareWithASCIIString(name, "held") == 0)
            *in_place = 1;
        else
            return 0;
    }
    return 1;
}

/* A Python number, NumPy scalar or CPU torch tensor: the call on the compiled lane of the
 * array `take_quickly` gives for it, its handle giving the result back in the input's kind
 * (as `follow` makes it); None where it has none. (A value whose lane the cache does not
 * hold is taken again by the Python wrapper: the first call of each kind, and values of
 * other libraries, pay `take_quickly` twice.) */
static PyObject *on_lane_of_array(PyObject *ctx, PyObject *input, PyObject *op) {
    PyObject *taken = PyObject_CallFunctionObjArgs(consts.take_quickly, input, consts.small_bytes, NULL);
    if (taken == NULL) {
        PyErr_Clear(); /* the general path takes the value again, and says what is wrong with it */
        Py_RETURN_NONE;
    }
    if (taken == Py_None) return taken;
    PyObject *array = PyTuple_GET_ITEM(taken, 0), *back = PyTuple_GET_ITEM(taken, 1);
    PyObject *lane = PyArray_CheckExact(array) && PyArray_IS_C_CONTIGUOUS((PyArrayObject *)array)
                         ? lane_cache_find(ctx, (PyArrayObject *)array, op)
                         : NULL;
    PyObject *handle = lane == NULL ? Py_NewRef(Py_None) : lane_start(lane, Py_None, array);
    if (handle != NULL && handle != Py_None) {
        PyObject *convert = PyObject_CallFunctionObjArgs(consts.convert_type, HANDLE(handle)->value, back, NULL);
        if (field_steal(&HANDLE(handle)->value, convert) < 0) Py_CLEAR(handle);
    }
    Py_DECREF(taken);
    return handle;
}

/* The call on its compiled lane: a new handle, NULL with an error, or None to go the general way. */
static PyObject *on_lane(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *input, *op, *devices;
    int in_place;
    if (!consts.bound || !parse_call(args, nargs, kwnames, &input, &op, &devices, &in_place) || devices != Py_None)
        Py_RETURN_NONE;
    Py_ssize_t open = PyList_GET_SIZE(consts.open_contexts);
    if (open == 0) Py_RETURN_NONE;
    PyObject *ctx = PyList_GET_ITEM(consts.open_contexts, open - 1), *tensor = Py_None, *array = input;
    if (in_place) {
        /* Only a bare array's calls: the kept plan's lane as the Python path would start it. */
        PyObject *lane = PyArray_CheckExact(input) ? cache_find(&held, ctx, (PyArrayObject *)input, op) : NULL;
        if (lane == NULL) Py_RETURN_NONE;
        return lane_start_in_place(lane, input);
    }
    if (Py_IS_TYPE(input, types.tensor_type)) {
        tensor = input;
        array = TENSOR(input)->array;
    } else if (!PyArray_CheckExact(input)) {
        /* Lists, tuples and dicts are fused all-reduces; anything else may have an array. */
        if (PyList_Check(input) || PyTuple_Check(input) || PyDict_Check(input)) Py_RETURN_NONE;
        return on_lane_of_array(ctx, input, op);
    }
    if (array == NULL || !PyArray_CheckExact(array)) Py_RETURN_NONE;
    PyObject *lane = lane_cache_find(ctx, (PyArrayObject *)array, op);
    if (lane == NULL) Py_RETURN_NONE;
    return lane_start(lane, tensor, array);
}

/* What every call runs first once set (`set_before_call`): the wait for compiled programs
 * whose collectives come before it (`_runtime/ordering.py`). */
static PyObject *before_call;

const char set_before_call_doc[] =
"set_before_call(function)\n--\n\n"
"Have every call run `function()` first (None: nothing), before it looks for its lane.";

PyObject *set_before_call(PyObject *module, PyObject *function) {
    (void)module;
    if (function != Py_None && !PyCallable_Check(function)) {
        PyErr_SetString(PyExc_TypeError, "set_before_call(function): function must be callable or None");
        return NULL;
    }
    Py_XSETREF(before_call, function == Py_None ? NULL : Py_NewRef(function));
    Py_RETURN_NONE;
}

static PyObject *Entry_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (before_call != NULL) {
        PyObject *done = PyObject_CallNoArgs(before_call);
        if (done == NULL) return NULL;
        Py_DECREF(done);
    }
    PyObject *handle = on_lane(args, nargs, kwnames);
    if (handle != Py_None) return handle;
    Py_DECREF(handle);
    return PyObject_Vectorcall(((Entry *)self)->general, args, nargsf, kwnames);
}

static int Entry_init(PyObject *self, PyObject *args, PyObject *kwargs) {
    PyObject *general;
    if ((kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0) || !PyArg_ParseTuple(args, "O", &general)) {
        PyErr_SetString(PyExc_TypeError, "Entry(general) takes the Python function it fronts");
        return -1;
    }
    if (!PyCallable_Check(general)) {
        PyErr_SetString(PyExc_TypeError, "Entry(general): general must be callable");
        return -1;
    }
    Py_XSETREF(((Entry *)self)->general, Py_NewRef(general));
    ((Entry *)self)->vectorcall = Entry_vectorcall;
    return 0;
}

static PyObject *Entry_call(PyObject *self, PyObject *args, PyObject *kwargs) {
    return PyVectorcall_Call(self, args, kwargs);
}

static PyObject *Entry_repr(PyObject *self) {
    return PyObject_Repr(((Entry *)self)->general);
}

static int Entry_traverse(PyObject *self, visitproc visit, void *arg) {
    Py_VISIT(((Entry *)self)->general);
    Py_VISIT(((Entry *)self)->dict);
    return 0;
}

static int Entry_clear(PyObject *self) {
    Py_CLEAR(((Entry *)self)->general);
    Py_CLEAR(((Entry *)self)->dict);
    return 0;
}

static void Entry_dealloc(PyObject *self) {
    PyObject_GC_UnTrack(self);
    Entry_clear(self);
    Py_TYPE(self)->tp_free(self);
}

static PyGetSetDef Entry_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(Entry_doc,
"Entry(general)\n--\n\n"
"A callable that starts a call on its compiled lane when it has one, else calls `general`.\n\n"
"Calls of the form all_reduce(input, op=None, devices=None) with devices None, on a NumPy\n"
"array or a Tensor of a kind whose lane the cache holds (or on a number, NumPy scalar or CPU\n"
"torch tensor whose array `take_quickly` gives is of such a kind), start there; so do calls\n"
"all_reduce(array, op=None, devices=None, held=True) of a NumPy array whose held lane the entry\n"
"keeps (`keep_held`). Every other call, and\n"
"every call the lane declines, is `general(*args, **kwargs)`. Attributes such as __doc__ and\n"
"__wrapped__ can be set on it (functools.update_wrapper).");

PyTypeObject EntryType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpitensor._collectives.native._lanes.Entry",
    .tp_basicsize = sizeof(Entry),
    .tp_dealloc = Entry_dealloc,
    .tp_vectorcall_offset = offsetof(Entry, vectorcall),
    .tp_repr = Entry_repr,
    .tp_call = Entry_call,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = Entry_doc,
    .tp_traverse = Entry_traverse,
    .tp_clear = Entry_clear,
    .tp_getset = Entry_getset,
    .tp_dictoffset = offsetof(Entry, dict),
    .tp_init = Entry_init,
    .tp_new = PyType_GenericNew,
};
