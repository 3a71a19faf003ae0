/* The module `mpitensor._runtime.tracing._ring`: the per-rank record of collectives.
 *
 * A `Ring` holds one fixed-size event per collective, in the order they were called: the
 * last `capacity` of them (older ones are overwritten), or every one when it keeps all.
 * `begin` hands out a `Span`, through which the later moments of the call are written in
 * place (a moment of an event overwritten meanwhile is dropped). Recording is a clock read
 * and a store: no allocation but the span's, no Python call, so that a traced call costs
 * almost what an untraced one does. The compiled lane uses the same functions through the
 * capsule `_C_API` (ring_api.h).
 *
 * Each event also gets its group's ordinal (`seq`): the n-th collective recorded on a group
 * is the n-th on every member, which matches a collective's events across ranks.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>
#include <time.h>

#include "ring_api.h"

typedef struct {
    int64_t id, called, agreed, posted, complete, resolved, nbytes, group, seq;
    int32_t kind, dtype, transport, flags;
} Event;

typedef struct {
    int64_t key, count;
    int used;
} Counter;

typedef struct {
    PyObject_HEAD
    Event *events;
    int64_t capacity, next;
    int keep_all;
    Counter *counters;
    int64_t counters_size, counters_used;
} Ring;

typedef struct {
    PyObject_HEAD
    Ring *ring;
    int64_t id;
} Span;

static PyTypeObject RingType, SpanType;

static int64_t now_ns(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int64_t)now.tv_sec * 1000000000LL + now.tv_nsec;
}

/* ---- the per-group ordinals: an open-addressing table keyed by the group's hash ---------- */

static int counters_grow(Ring *ring) {
    int64_t size = ring->counters_size ? ring->counters_size * 2 : 64;
    Counter *table = PyMem_Calloc((size_t)size, sizeof(Counter));
    if (table == NULL) return -1;
    for (int64_t i = 0; i < ring->counters_size; i++) {
        Counter *old = &ring->counters[i];
        if (!old->used) continue;
        int64_t at = (int64_t)((uint64_t)old->key % (uint64_t)size);
        while (table[at].used) at = (at + 1) % size;
        table[at] = *old;
    }
    PyMem_Free(ring->counters);
    ring->counters = table;
    ring->counters_size = size;
    return 0;
}

/* The next ordinal of `group`; -1 when memory ran out. */
static int64_t next_seq(Ring *ring, int64_t group) {
    if (2 * (ring->counters_used + 1) > ring->counters_size && counters_grow(ring) < 0) return -1;
    int64_t size = ring->counters_size, at = (int64_t)((uint64_t)group % (uint64_t)size);
    while (ring->counters[at].used && ring->counters[at].key != group) at = (at + 1) % size;
    Counter *counter = &ring->counters[at];
    if (!counter->used) {
        counter->used = 1;
        counter->key = group;
        ring->counters_used++;
    }
    return counter->count++;
}

/* ---- events ------------------------------------------------------------------------------ */

/* Where event `id` is kept; NULL once it was overwritten. */
static Event *slot_of(Ring *ring, int64_t id) {
    Event *event = &ring->events[ring->keep_all ? id : id % ring->capacity];
    return id < ring->next && event->id == id ? event : NULL;
}

static int make_room(Ring *ring) {
    if (!ring->keep_all || ring->next < ring->capacity) return 0;
    Event *grown = PyMem_Realloc(ring->events, sizeof(Event) * (size_t)ring->capacity * 2);
    if (grown == NULL) return -1;
    ring->events = grown;
    ring->capacity *= 2;
    return 0;
}

/* Write a new event; NULL when memory ran out (nothing is written, no error is set). */
static Event *new_event(Ring *ring, int32_t kind, int64_t group, int64_t nbytes, int32_t dtype, int64_t called) {
    int64_t seq = next_seq(ring, group);
    if (seq < 0 || make_room(ring) < 0) return NULL;
    int64_t id = ring->next++;
    Event *event = &ring->events[ring->keep_all ? id : id % ring->capacity];
    memset(event, 0, sizeof *event);
    event->id = id;
    event->called = called ? called : now_ns();
    event->nbytes = nbytes;
    event->group = group;
    event->seq = seq;
    event->kind = kind;
    event->dtype = dtype;
    return event;
}

static PyObject *ring_begin(PyObject *self, int32_t kind, int64_t group, int64_t nbytes, int32_t dtype,
                            int64_t called) {
    Ring *ring = (Ring *)self;
    Event *event = new_event(ring, kind, group, nbytes, dtype, called);
    if (event == NULL) return PyErr_NoMemory();
    Span *span = PyObject_New(Span, &SpanType);
    if (span == NULL) return NULL;
    span->ring = (Ring *)Py_NewRef(self);
    span->id = event->id;
    return (PyObject *)span;
}

static int ring_carried_event(PyObject *self, int32_t kind, int64_t group, int64_t nbytes, int32_t dtype,
                              int64_t called) {
    Event *event = new_event((Ring *)self, kind, group, nbytes, dtype, called);
    if (event == NULL) return -1;
    event->agreed = event->posted = event->complete = now_ns();
    event->transport = RING_CHECK;
    return 0;
}

static void span_mark(PyObject *self, int field) {
    Span *span = (Span *)self;
    Event *event = slot_of(span->ring, span->id);
    if (event == NULL) return;
    int64_t now = now_ns();
    switch (field) {
    case RING_AGREED: event->agreed = now; break;
    case RING_POSTED: event->posted = now; break;
    case RING_COMPLETE: event->complete = now; break;
    case RING_RESOLVED: if (event->resolved == 0) event->resolved = now; break;
    default: break;
    }
}

static void span_posted(PyObject *self, int32_t transport) {
    Span *span = (Span *)self;
    Event *event = slot_of(span->ring, span->id);
    if (event == NULL) return;
    event->posted = now_ns();
    event->transport = transport;
}



/* ---- Ring -------------------------------------------------------------------------------- */

static int Ring_init(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"capacity", "keep_all", NULL};
    Ring *ring = (Ring *)self;
    long long capacity;
    int keep_all = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "L|p", keywords, &capacity, &keep_all)) return -1;
    if (capacity < 1 || capacity > (1LL << 32)) {
        PyErr_Format(PyExc_ValueError, "a ring holds 1 to 2**32 events, not %lld", capacity);
        return -1;
    }
    if (ring->events != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a ring is made once");
        return -1;
    }
    ring->events = PyMem_Calloc((size_t)capacity, sizeof(Event));
    if (ring->events == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    ring->capacity = capacity;
    ring->keep_all = keep_all;
    return 0;
}

static void Ring_dealloc(PyObject *self) {
    Ring *ring = (Ring *)self;
    PyMem_Free(ring->events);
    PyMem_Free(ring->counters);
    Py_TYPE(self)->tp_free(self);
}

static int64_t as_int64(PyObject *value, int *failed) {
    long long result = PyLong_AsLongLong(value);
    if (result == -1 && PyErr_Occurred()) *failed = 1;
    return result;
}

static PyObject *Ring_begin(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "begin(kind, group, nbytes, dtype) takes 4 arguments");
        return NULL;
    }
    int failed = 0;
    int64_t kind = as_int64(args[0], &failed), group = as_int64(args[1], &failed);
    int64_t nbytes = as_int64(args[2], &failed), dtype = as_int64(args[3], &failed);
    if (failed) return NULL;
    return ring_begin(self, (int32_t)kind, group, nbytes, (int32_t)dtype, 0);
}

static PyObject *Ring_export(PyObject *self, PyObject *unused) {
    (void)unused;
    Ring *ring = (Ring *)self;
    int64_t kept = ring->keep_all || ring->next < ring->capacity ? ring->next : ring->capacity;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(kept * (int64_t)sizeof(Event)));
    if (out == NULL) return NULL;
    char *to = PyBytes_AS_STRING(out);
    for (int64_t id = ring->next - kept; id < ring->next; id++, to += sizeof(Event))
        memcpy(to, slot_of(ring, id), sizeof(Event));
    return out;
}

static PyObject *Ring_get_recorded(PyObject *self, void *closure) {
    (void)closure;
    return PyLong_FromLongLong(((Ring *)self)->next);
}

static PyObject *Ring_get_capacity(PyObject *self, void *closure) {
    (void)closure;
    Ring *ring = (Ring *)self;
    return PyLong_FromLongLong(ring->keep_all ? 0 : ring->capacity);
}

static PyMethodDef Ring_methods[] = {
    {"begin", (PyCFunction)(void (*)(void))Ring_begin, METH_FASTCALL,
     "begin(kind, group, nbytes, dtype)\n--\n\nRecord a collective called now; returns its Span."},
    {"export", Ring_export, METH_NOARGS,
     "export()\n--\n\nThe events kept, oldest first, as bytes (`ring.EVENT` records)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Ring_getset[] = {
    {"recorded", Ring_get_recorded, NULL, "Events recorded so far (kept or not).", NULL},
    {"capacity", Ring_get_capacity, NULL, "The events kept at most; 0 when every one is kept.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpitensor._runtime.tracing._ring.Ring",
    .tp_basicsize = sizeof(Ring),
    .tp_dealloc = Ring_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Ring(capacity, keep_all=False)\n--\n\nThe record of the last `capacity` collectives "
              "(every one, the storage growing, with keep_all).",
    .tp_methods = Ring_methods,
    .tp_getset = Ring_getset,
    .tp_init = Ring_init,
    .tp_new = PyType_GenericNew,
};

/* ---- Span -------------------------------------------------------------------------------- */

static void Span_dealloc(PyObject *self) {
    Py_XDECREF(((Span *)self)->ring);
    PyObject_Free(self);
}

static PyObject *Span_mark(PyObject *self, PyObject *field) {
    long value = PyLong_AsLong(field);
    if (value == -1 && PyErr_Occurred()) return NULL;
    span_mark(self, (int)value);
    Py_RETURN_NONE;
}

static PyObject *Span_posted(PyObject *self, PyObject *transport) {
    long value = PyLong_AsLong(transport);
    if (value == -1 && PyErr_Occurred()) return NULL;
    span_posted(self, (int32_t)value);
    Py_RETURN_NONE;
}

static PyObject *Span_get_id(PyObject *self, void *closure) {
    (void)closure;
    return PyLong_FromLongLong(((Span *)self)->id);
}

static PyMethodDef Span_methods[] = {
    {"mark", Span_mark, METH_O, "mark(field)\n--\n\nRecord moment `field` (AGREED .. RESOLVED) as now."},
    {"posted", Span_posted, METH_O, "posted(transport)\n--\n\nRecord that the data was posted now, and how it travels."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Span_getset[] = {
    {"id", Span_get_id, NULL, "The event's number in its ring.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject SpanType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpitensor._runtime.tracing._ring.Span",
    .tp_basicsize = sizeof(Span),
    .tp_dealloc = Span_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One recorded collective, whose later moments are written through it (Ring.begin makes it).",
    .tp_methods = Span_methods,
    .tp_getset = Span_getset,
};

/* ---- the module -------------------------------------------------------------------------- */

static RingApi api = {&RingType, now_ns, ring_begin, ring_carried_event, span_mark, span_posted};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "mpitensor._runtime.tracing._ring",
    "The per-rank record of collectives (see mpitensor/_runtime/tracing/ring.py).", -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__ring(void) {
    if (PyType_Ready(&RingType) < 0 || PyType_Ready(&SpanType) < 0) return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) return NULL;
    PyObject *capsule = PyCapsule_New(&api, "mpitensor._runtime.tracing._ring._C_API", NULL);
    int failed = capsule == NULL || PyModule_AddObjectRef(module, "_C_API", capsule) < 0 ||
                 PyModule_AddObjectRef(module, "Ring", (PyObject *)&RingType) < 0 ||
                 PyModule_AddObjectRef(module, "Span", (PyObject *)&SpanType) < 0 ||
                 PyModule_AddIntConstant(module, "EVENT_BYTES", (long)sizeof(Event)) < 0;
    Py_XDECREF(capsule);
    if (failed) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
