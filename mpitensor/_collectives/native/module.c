/* The module `mpitensor._collectives.native._lanes`: its types, `bind` and `rows_kind`. */
#define MPITENSOR_NATIVE_MODULE
#include "native.h"

Constants consts;
Types types;
const RingApi *ring_api;

/* The trace ring's functions, from its module's capsule; 0, or -1 with an error set. */
int ring_api_load(void) {
    if (ring_api == NULL) ring_api = PyCapsule_Import("mpitensor._runtime.tracing._ring._C_API", 0);
    return ring_api == NULL ? -1 : 0;
}

/* Whether `cls` is a class derived from record type `name` of mpitensor._core._records (the
 * compiled records: the Python ones have no structs to read). 1 yes; 0 no, with an error set. */
static int derives(PyObject *records, PyObject *cls, const char *name, PyTypeObject **record) {
    PyObject *base = PyObject_GetAttrString(records, name);
    if (base == NULL) return 0;
    int ok = PyType_Check(base) && PyType_Check(cls) && PyType_IsSubtype((PyTypeObject *)cls, (PyTypeObject *)base);
    if (!ok) PyErr_Format(PyExc_TypeError, "bind() takes a class derived from the compiled %s", name);
    else if (record != NULL) *record = (PyTypeObject *)base;
    Py_DECREF(base);
    return ok;
}

int types_bind(PyObject *op_class, PyObject *tensor_class, PyObject *handle_class) {
    PyObject *records = PyImport_ImportModule("mpitensor._core._records");
    if (records == NULL) return -1;
    PyTypeObject *op_record = NULL;
    PyObject *context_record = PyObject_GetAttrString(records, "ContextRecord");
    PyObject *engine_record = context_record == NULL ? NULL : PyObject_GetAttrString(records, "EngineRecord");
    PyObject *group_record = engine_record == NULL ? NULL : PyObject_GetAttrString(records, "GroupRecord");
    int ok = group_record != NULL && PyType_Check(context_record) && PyType_Check(engine_record) &&
             PyType_Check(group_record) &&
             derives(records, op_class, "OpRecord", &op_record) &&
             derives(records, tensor_class, "TensorRecord", NULL) && derives(records, handle_class, "HandleRecord", NULL);
    Py_DECREF(records);
    if (!ok) {
        Py_XDECREF(context_record);
        Py_XDECREF(engine_record);
        Py_XDECREF(group_record);
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "mpitensor._core._records lacks its record types");
        return -1;
    }
    types.context_record = (PyTypeObject *)context_record;
    types.engine_record = (PyTypeObject *)engine_record;
    types.group_record = (PyTypeObject *)group_record;
    types.op_type = (PyTypeObject *)Py_NewRef(op_class);
    types.tensor_type = (PyTypeObject *)Py_NewRef(tensor_class);
    types.handle_type = (PyTypeObject *)Py_NewRef(handle_class);
    types.op_record = (PyTypeObject *)Py_NewRef((PyObject *)op_record);
    return 0;
}

static const char *bind_keywords[] = {
    "mpi", "pointer_handles", "op_class", "tensor_class", "handle_class",
    "open_contexts", "states", "later", "settle", "base_resolve", "agree_stage", "header_bytes", "payload_bytes",
    "row_bytes", "reap_after", "gathered_ranks", "spin_pauses", "take_quickly", "small_bytes", "convert",
    "idle_arm", "held_blocking", "idle_contested", "exchange_tag", "pair_api", NULL};

PyDoc_STRVAR(bind_doc,
"bind(*, mpi, pointer_handles, op_class, tensor_class, handle_class,\n"
"     open_contexts, states, later, settle, base_resolve, agree_stage, header_bytes, payload_bytes,\n"
"     row_bytes, reap_after, gathered_ranks, spin_pauses, take_quickly, small_bytes, convert,\n"
"     idle_arm=0, held_blocking=1, idle_contested=0, exchange_tag, pair_api=0)\n--\n\n"
"Bind the module to the running MPI and to the Python classes it works with (once).\n\n"
"mpi: the mpi4py.MPI module; pointer_handles: whether MPI's handles are pointers. op_class,\n"
"tensor_class, handle_class: the engine's Op, Tensor and the lane handle class, derived from the\n"
"compiled records OpRecord, TensorRecord and HandleRecord (records.h), whose fields are what\n"
"the module reads and writes. open_contexts: the stack of open contexts. states: the op states\n"
"CHECKING .. FAILED. later: the class of values settled by the Python resolve, settle its\n"
"settle(value, result), base_resolve that resolve. The rest: the check's first stage and the\n"
"row layout, the\n"
"count of posted ops beyond which the Python path reaps, the largest group whose checks gather\n"
"rows (a checked lane's group has 2 to gathered_ranks ranks), and the engine's spin_pauses where\n"
"each rank has a core (fewer: more ranks than cores). take_quickly(value, small_bytes): a\n"
"number's or CPU torch tensor's array and converter back, which `convert(value, back)` hangs\n"
"on its handle. idle_arm: the address of the switch the held calls set around their blocking\n"
"MPI call so that it gives the core back while it waits (`_core.idle.arm_address`; 0: none).\n"
"held_blocking: whether held calls move their data in MPI's blocking calls (else nonblocking\n"
"ones, waited in C; `_core.idle.blocking_waits`). idle_contested: the address of the function\n"
"that says whether the core is contested (`_core.idle.contested_address`; 0: never), which the\n"
"held all-reduces of 2 ranks carry in their check; exchange_tag: the tag of their one exchange\n"
"(`_transport.mpi.all_reduce.EXCHANGE_TAG`); pair_api: the address of the shared pairs' table\n"
"(`_transport.mpi.pair.pair_api_address`, pair.h; 0: none), through which that exchange goes\n"
"where both ranks run on one node. `resolve_for(handle_class)` then gives the\n"
"compiled resolve().\n\n"
"Raises:\n"
"    RuntimeError: MPI's functions or mpi4py's C API could not be found (the message says which).\n"
"    TypeError: a class lacks a slot the module reads.");

static PyObject *bind(PyObject *module, PyObject *args, PyObject *kwargs) {
    (void)module;
    PyObject *mpi4py, *op_class, *tensor_class, *handle_class, *contexts, *states;
    PyObject *later, *settle, *base_resolve, *take_quickly, *small_bytes, *convert;
    int pointer_handles;
    unsigned long long idle_arm = 0, idle_contested = 0, pair_api = 0;
    int held_blocking = 1;
    if (consts.bound) Py_RETURN_NONE;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "$OpOOOO!O!OOOiiiiiiiOO!OKpKiK", (char **)bind_keywords, &mpi4py,
                                     &pointer_handles, &op_class, &tensor_class, &handle_class,
                                     &PyList_Type, &contexts, &PyTuple_Type, &states, &later, &settle,
                                     &base_resolve, &consts.agree_stage, &consts.header_bytes,
                                     &consts.payload_bytes, &consts.row_bytes, &consts.reap_after, &consts.gathered_ranks,
                                     &consts.spin_pauses, &take_quickly, &PyLong_Type, &small_bytes, &convert,
                                     &idle_arm, &held_blocking, &idle_contested,
                                     &consts.exchange_tag, &pair_api))
        return NULL;
    if (PyTuple_GET_SIZE(states) != 5 || !PyType_Check(later) || !PyCallable_Check(settle) ||
        !PyCallable_Check(base_resolve) ||
        !PyCallable_Check(take_quickly) || !PyType_Check(convert) ||
        consts.header_bytes != 16 || consts.gathered_ranks < 2 || consts.row_bytes != consts.header_bytes + consts.payload_bytes) {
        PyErr_SetString(PyExc_TypeError, "bind(): five states, a class, a function and a 16-byte header");
        return NULL;
    }
    char why[200] = "";
    if (mpi_bind(mpi4py, pointer_handles, why, sizeof why) < 0) {
        PyErr_SetString(PyExc_RuntimeError, why);
        return NULL;
    }
    if (types_bind(op_class, tensor_class, handle_class) < 0) return NULL;
    PyObject *functools = PyImport_ImportModule("functools");
    consts.partial = functools == NULL ? NULL : PyObject_GetAttrString(functools, "partial");
    Py_XDECREF(functools);
    if (consts.partial == NULL) return NULL;
    for (int i = 0; i < 5; i++) consts.states[i] = Py_NewRef(PyTuple_GET_ITEM(states, i));
    consts.open_contexts = Py_NewRef(contexts);
    consts.later_type = Py_NewRef(later);
    consts.settle = Py_NewRef(settle);
    consts.base_resolve = Py_NewRef(base_resolve);
    consts.take_quickly = Py_NewRef(take_quickly);
    consts.small_bytes = Py_NewRef(small_bytes);
    consts.convert_type = Py_NewRef(convert);
    consts.arm_idle = (idle_switch)(uintptr_t)idle_arm;
    consts.held_blocking = held_blocking;
    consts.contested = (idle_probe)(uintptr_t)idle_contested;
    consts.pair = (const PairApi *)(uintptr_t)pair_api;
    consts.bound = 1;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(rows_kind_doc,
"rows_kind(type_num, op_code)\n--\n\n"
"The loop that reduces carried rows of NumPy type number `type_num` with op `op_code`\n"
"(SUM 1, PROD 2, MAX 3, MIN 4, BAND 5, BOR 6, BXOR 7), or -1 when this module has none.");

PyDoc_STRVAR(resolve_for_doc,
"resolve_for(handle_class)\n--\n\n"
"The compiled resolve() as a method of `handle_class` (the class given to bind()), for the class\n"
"to take as its `resolve`.");

static PyObject *resolve_for(PyObject *module, PyObject *cls) {
    (void)module;
    if (!consts.bound || cls != (PyObject *)types.handle_type) {
        PyErr_SetString(PyExc_TypeError, "resolve_for() takes the handle class given to bind(), once bound");
        return NULL;
    }
    return PyDescr_NewMethod(types.handle_type, &handle_resolve_def);
}

static PyObject *rows_kind_py(PyObject *module, PyObject *args) {
    (void)module;
    int type_num, op_code;
    if (!PyArg_ParseTuple(args, "ii", &type_num, &op_code)) return NULL;
    return PyLong_FromLong(rows_kind(type_num, op_code));
}

static PyMethodDef methods[] = {
    {"bind", (PyCFunction)(void (*)(void))bind, METH_VARARGS | METH_KEYWORDS, bind_doc},
    {"rows_kind", rows_kind_py, METH_VARARGS, rows_kind_doc},
    {"resolve_for", resolve_for, METH_O, resolve_for_doc},
    {"check_op", check_op, METH_O, check_op_doc},
    {"forget", lane_cache_forget, METH_O, forget_doc},
    {"keep_held", keep_held, METH_O, keep_held_doc},
    {"set_before_call", set_before_call, METH_O, set_before_call_doc},
    {"wait_at_call", wait_at_call, METH_O, wait_at_call_doc},
    {"find_lane", (PyCFunction)(void (*)(void))find_lane, METH_FASTCALL, find_lane_doc},
    {"plain_leaves", (PyCFunction)(void (*)(void))plain_leaves, METH_FASTCALL, plain_leaves_doc},
    {"pack", (PyCFunction)(void (*)(void))pack_leaves, METH_FASTCALL, pack_doc},
    {"unpack", (PyCFunction)(void (*)(void))unpack_leaves, METH_FASTCALL, unpack_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "mpitensor._collectives.native._lanes",
    "The compiled lane of repeated small all-reduces (see mpitensor/_collectives/native/__init__.py).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__lanes(void) {
    import_array();
    if ((consts.empty_tuple = PyTuple_New(0)) == NULL || (consts.one = PyLong_FromLong(1)) == NULL) return NULL;
    if (PyType_Ready(&LaneType) < 0 || PyType_Ready(&DivideType) < 0 || PyType_Ready(&DecodeType) < 0 ||
        PyType_Ready(&EntryType) < 0) return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) return NULL;
    if (PyModule_AddObjectRef(module, "Lane", (PyObject *)&LaneType) < 0 ||
        PyModule_AddObjectRef(module, "Divide", (PyObject *)&DivideType) < 0 ||
        PyModule_AddObjectRef(module, "Decode", (PyObject *)&DecodeType) < 0 ||
        PyModule_AddObjectRef(module, "Entry", (PyObject *)&EntryType) < 0 ||
        PyModule_AddIntConstant(module, "COPY", 0) < 0 || PyModule_AddIntConstant(module, "CHECK", 1) < 0 ||
        PyModule_AddIntConstant(module, "HELD", 2) < 0 || PyModule_AddIntConstant(module, "ALL_REDUCE", 0) < 0 ||
        PyModule_AddIntConstant(module, "BROADCAST", 1) < 0 || PyModule_AddIntConstant(module, "ALL_GATHER", 2) < 0 ||
        PyModule_AddIntConstant(module, "ALL_TO_ALL", 3) < 0 || PyModule_AddIntConstant(module, "GATHER", 4) < 0 ||
        PyModule_AddIntConstant(module, "REDUCE", 5) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
