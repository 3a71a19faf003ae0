/* The record types of `records.h`, as the module `mpitensor._core._records`.
 *
 * Base classes with the fields compiled code reads (member descriptors, like __slots__),
 * garbage-collected, subclassable; the Python classes derive from them. `_core/records.py`
 * has the same classes in Python where this module was not built.
 */
#include "records.h"

#include <stddef.h>
#include <structmember.h>

/* Every record is PyObject_HEAD followed by `count` object fields. */
static PyObject **fields_of(PyObject *self) { return (PyObject **)((char *)self + sizeof(PyObject)); }

static int record_traverse(PyObject *self, visitproc visit, void *arg, Py_ssize_t count) {
    PyObject **fields = fields_of(self);
    for (Py_ssize_t i = 0; i < count; i++) Py_VISIT(fields[i]);
    return 0;
}

static int record_clear(PyObject *self, Py_ssize_t count) {
    PyObject **fields = fields_of(self);
    for (Py_ssize_t i = 0; i < count; i++) Py_CLEAR(fields[i]);
    return 0;
}

#define COUNT(type) ((Py_ssize_t)((sizeof(type) - sizeof(PyObject)) / sizeof(PyObject *)))

#define RECORD_FUNCTIONS(type)                                                                \
    static int type##_traverse(PyObject *self, visitproc visit, void *arg) {                  \
        return record_traverse(self, visit, arg, COUNT(type));                                \
    }                                                                                         \
    static int type##_clear(PyObject *self) { return record_clear(self, COUNT(type)); }        \
    static void type##_dealloc(PyObject *self) {                                              \
        PyTypeObject *tp = Py_TYPE(self);                                                     \
        PyObject_GC_UnTrack(self);                                                            \
        type##_clear(self);                                                                   \
        tp->tp_free(self);                                                                    \
    }

#define MEMBER(type, field, name) {name, T_OBJECT_EX, offsetof(type, field), 0, NULL}

RECORD_FUNCTIONS(TensorRecord)
RECORD_FUNCTIONS(HandleRecord)
RECORD_FUNCTIONS(OpRecord)
RECORD_FUNCTIONS(GroupRecord)
RECORD_FUNCTIONS(EngineRecord)
RECORD_FUNCTIONS(ContextRecord)

static PyMemberDef tensor_members[] = {
    MEMBER(TensorRecord, array, "_array"),
    MEMBER(TensorRecord, device, "_device"),
    {NULL, 0, 0, 0, NULL},
};

static PyMemberDef handle_members[] = {
    MEMBER(HandleRecord, op, "_op"),
    MEMBER(HandleRecord, value, "_value"),
    MEMBER(HandleRecord, ctx, "_ctx"),
    MEMBER(HandleRecord, resolved, "_resolved"),
    {NULL, 0, 0, 0, NULL},
};

static PyMemberDef op_members[] = {
    MEMBER(OpRecord, name, "name"),
    MEMBER(OpRecord, group, "group"),
    MEMBER(OpRecord, nbytes, "nbytes"),
    MEMBER(OpRecord, post, "post"),
    MEMBER(OpRecord, finish, "finish"),
    MEMBER(OpRecord, record, "record"),
    MEMBER(OpRecord, keep, "keep"),
    MEMBER(OpRecord, protections, "protections"),
    MEMBER(OpRecord, exchange, "exchange"),
    MEMBER(OpRecord, compare, "compare"),
    MEMBER(OpRecord, payload, "payload"),
    MEMBER(OpRecord, requests, "requests"),
    MEMBER(OpRecord, stepper, "stepper"),
    MEMBER(OpRecord, state, "state"),
    MEMBER(OpRecord, result, "result"),
    MEMBER(OpRecord, error, "error"),
    MEMBER(OpRecord, check_req, "check_req"),
    MEMBER(OpRecord, check_send, "check_send"),
    MEMBER(OpRecord, check_recv, "check_recv"),
    MEMBER(OpRecord, check_stage, "check_stage"),
    MEMBER(OpRecord, seq, "seq"),
    MEMBER(OpRecord, gathered, "gathered"),
    MEMBER(OpRecord, check_sizes, "check_sizes"),
    MEMBER(OpRecord, trace, "trace"),
    {NULL, 0, 0, 0, NULL},
};

static PyMemberDef group_members[] = {
    MEMBER(GroupRecord, queue, "queue"),
    MEMBER(GroupRecord, holder, "holder"),
    MEMBER(GroupRecord, check_seq, "check_seq"),
    {NULL, 0, 0, 0, NULL},
};

static PyMemberDef engine_members[] = {
    MEMBER(EngineRecord, posted, "posted"),
    MEMBER(EngineRecord, waiting_groups, "waiting_groups"),
    MEMBER(EngineRecord, stepping, "stepping"),
    MEMBER(EngineRecord, checks_posted, "checks_posted"),
    MEMBER(EngineRecord, spin_pauses, "spin_pauses"),
    MEMBER(EngineRecord, lock, "lock"),
    MEMBER(EngineRecord, lock_acquire, "lock_acquire"),
    MEMBER(EngineRecord, lock_release, "lock_release"),
    MEMBER(EngineRecord, lock_owned, "lock_owned"),
    MEMBER(EngineRecord, await_check, "await_check"),
    MEMBER(EngineRecord, mpi_failed, "mpi_failed_hook"),
    MEMBER(EngineRecord, mark_broken, "mark_broken_hook"),
    {NULL, 0, 0, 0, NULL},
};

static PyMemberDef context_members[] = {
    MEMBER(ContextRecord, engine, "engine"),
    MEMBER(ContextRecord, usable, "usable"),
    MEMBER(ContextRecord, closed, "closed"),
    MEMBER(ContextRecord, owner_thread, "owner_thread"),
    MEMBER(ContextRecord, timeout, "timeout"),
    {NULL, 0, 0, 0, NULL},
};

#define RECORD_TYPE(type, pyname, members, doc)                                        \
    static PyTypeObject type##Type = {                                               \
        PyVarObject_HEAD_INIT(NULL, 0)                                               \
        .tp_name = "mpitensor._core._records." pyname,                               \
        .tp_basicsize = sizeof(type),                                                \
        .tp_dealloc = type##_dealloc,                                                \
        .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,   \
        .tp_doc = doc,                                                               \
        .tp_traverse = type##_traverse,                                              \
        .tp_clear = type##_clear,                                                    \
        .tp_members = members,                                                       \
        .tp_new = PyType_GenericNew,                                                 \
    };

RECORD_TYPE(TensorRecord, "TensorRecord", tensor_members, "The fields of a Tensor that compiled code reads (records.h).")
RECORD_TYPE(HandleRecord, "HandleRecord", handle_members,
            "The fields of a CollectiveTensor that compiled code reads (records.h).")
RECORD_TYPE(OpRecord, "OpRecord", op_members, "The fields of an engine Op (records.h).")
RECORD_TYPE(GroupRecord, "GroupRecord", group_members,
            "The fields of a Group that compiled code reads: queue, holder, check_seq (records.h).")
RECORD_TYPE(EngineRecord, "EngineRecord", engine_members,
            "The engine's state and functions that compiled code uses (records.h).")
RECORD_TYPE(ContextRecord, "ContextRecord", context_members,
            "The fields of a DistributedContext that compiled code reads (records.h).")

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "mpitensor._core._records",
    "The record types of mpitensor's runtime objects, whose fields compiled code reads (records.h).", -1,
    NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__records(void) {
    PyTypeObject *types[] = {&TensorRecordType, &HandleRecordType, &OpRecordType, &GroupRecordType,
                             &EngineRecordType, &ContextRecordType};
    const char *names[] = {"TensorRecord", "HandleRecord", "OpRecord", "GroupRecord", "EngineRecord",
                           "ContextRecord"};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
        if (PyType_Ready(types[i]) < 0) return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) return NULL;
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
        if (PyModule_AddObjectRef(module, names[i], (PyObject *)types[i]) < 0) {
            Py_DECREF(module);
            return NULL;
        }
    return module;
}
