/* The idle rule inside Open MPI's blocking calls (see mpitensor/_core/idle.py and idle.h).
 *
 * Open MPI's progress loop calls the functions registered with `opal_progress_register` on
 * each round, also inside its blocking calls. `progress` is one: while one of mpitensor's
 * blocking calls is waiting (`arm`), once it has spun ARMED_SPIN_NS (at once where the core
 * is contested) it pauses each round as idle.h says, so a blocking MPI_Allreduce gives its core
 * to a program that wants it without costing a quiet machine anything; at other times it
 * returns at once. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdbool.h>

#include "idle.h"

/* An armed blocking call spins this long before it pauses where the core is free: longer than
 * other waits, as a quiet machine's larger calls mostly end within it. Where the core is
 * contested it pauses at once: a peer that shares the core could not run while it spun (a 332
 * KiB all-reduce beside a CPU hog per core took 1.0-1.6 ms in half the jobs spinning first,
 * 0.7-0.85 ms in every job pausing at once). */
#define ARMED_SPIN_NS (4 * IDLE_SPIN_NS)

static long long armed_at; /* when the waiting blocking call began; 0: none waits */
static int oversubscribed; /* the node runs more of the job's ranks than it has cores */
static IdleState state;

/* Open MPI's progress callback: pause where an armed blocking call has spun; no events. */
static int progress(void) {
    long long at = __atomic_load_n(&armed_at, __ATOMIC_RELAXED);
    if (at == 0 || (idle_now() - at < ARMED_SPIN_NS && !idle_contested(&state))) return 0;
    idle_pause(&state, __atomic_load_n(&oversubscribed, __ATOMIC_RELAXED));
    return 0;
}

/* Arm (`on`) before a blocking call, disarm after; the previous setting, as Open MPI's own
 * `opal_progress_set_yield_when_idle` returns it. */
static bool arm(bool on) {
    long long previous = __atomic_exchange_n(&armed_at, on ? idle_now() : 0, __ATOMIC_RELAXED);
    return previous != 0;
}

/* Whether the core is contested now, as the armed calls' pauses found it (idle.h); never where
 * the job's ranks outnumber the node's cores (there the core goes to a peer of the job). The
 * held all-reduces of 2 ranks tell it to their peer in the check (_transport/mpi/all_reduce.py). */
static int contested(void) {
    return !__atomic_load_n(&oversubscribed, __ATOMIC_RELAXED) && idle_contested(&state);
}

static PyObject *addresses(PyObject *self, PyObject *unused) {
    return Py_BuildValue("(NNN)", PyLong_FromVoidPtr((void *)(uintptr_t)progress),
                         PyLong_FromVoidPtr((void *)(uintptr_t)arm), PyLong_FromVoidPtr((void *)(uintptr_t)contested));
}

static PyObject *contested_now(PyObject *self, PyObject *unused) { return PyBool_FromLong(contested()); }

static PyObject *contest_for(PyObject *self, PyObject *seconds) {
    double span = PyFloat_AsDouble(seconds);
    if (span == -1.0 && PyErr_Occurred()) return NULL;
    long long until = span > 0 ? idle_now() + (long long)(span * 1e9) : 0;
    __atomic_store_n(&state.contested_until, until, __ATOMIC_RELAXED);
    Py_RETURN_NONE;
}

static PyObject *set_oversubscribed(PyObject *self, PyObject *flag) {
    int value = PyObject_IsTrue(flag);
    if (value < 0) return NULL;
    __atomic_store_n(&oversubscribed, value, __ATOMIC_RELAXED);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"set_oversubscribed", set_oversubscribed, METH_O,
     "set_oversubscribed(flag)\n--\n\n"
     "Whether the node runs more of the job's ranks than it has cores: then an armed call's\n"
     "pauses only yield."},
    {"addresses", addresses, METH_NOARGS,
     "addresses()\n--\n\n"
     "The addresses of ``int progress(void)``, for ``opal_progress_register``, and of\n"
     "``bool arm(bool)``, which a blocking call sets around itself (it returns the previous\n"
     "setting), and of ``int contested(void)`` (`contested`)."},
    {"contested", contested_now, METH_NOARGS,
     "contested()\n--\n\n"
     "Whether the core is contested now, as the armed calls' pauses found it (never where the\n"
     "job's ranks outnumber the node's cores)."},
    {"contest_for", contest_for, METH_O,
     "contest_for(seconds)\n--\n\n"
     "Take the core as contested for `seconds` from now, as a few late yields would (0: no longer)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_idle", "The idle rule inside Open MPI's blocking calls.", -1, methods,
};

PyMODINIT_FUNC PyInit__idle(void) { return PyModule_Create(&module); }
