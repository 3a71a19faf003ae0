/* `resolve()` of a compiled lane's handle, for the op it started: its wait and completion in C.
 *
 * What `CollectiveTensor.resolve` and `Engine.wait` do for a posted op when nothing is
 * queued on any group and no stepped op is in flight (so no peer waits for this rank to
 * post or step): wait inside MPI, take the op out of the engine's posted ops, run its
 * finish, and mark it complete, under the engine's lock. The request is tested a few times
 * first; if it is still in flight, it is tested with the GIL released where the context
 * has no timeout, and where it has one the Python resolve takes over (it waits with the
 * timeout, the diagnosis and the progress of other groups); `resolve(None)` is `resolve()`.
 * An op already complete gives its value at once. Every other case (a timeout argument, an
 * op failed or still checking, protections from `assume_resolved`, a closed context, a call
 * from a signal handler that interrupted the engine) is the Python resolve's from the start.
 *
 * The wait is not one blocking MPI_Wait, which would hold Ctrl-C until the peers arrive:
 * every SLICE_NS the engine's lock is let go and Python runs the handlers of the signals
 * that came meanwhile. One that raises (KeyboardInterrupt) ends resolve() with that error,
 * the op still posted and tracked by the engine: a later resolve() waits for it again.
 */
#include "native.h"

#include "idle.h"

/* Tests before waiting in MPI_Wait (or handing over to the Python resolve): a few microseconds
 * where each rank has a core (a small message usually completes meanwhile, and MPI_Wait then
 * costs the release of the GIL); one where ranks outnumber cores, where spinning on MPI_Test
 * measured slower than MPI_Wait's own wait (MPICH, 4 ranks on 2 cores: 31.8 us against
 * 14.6 us for 8 bytes). */
#define SPINS 64
#define OVERSUBSCRIBED_SPINS 1
/* The longest stretch of a wait without a look at the signals that came: Ctrl-C ends it
 * within about this long. Where ranks outnumber cores, the core is yielded between tests. */
#define SLICE_NS 1000000LL
/* Where each rank has a core, a wait spins this long before it yields between tests. */
#define SPIN_NS 50000LL

static PyObject *general(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *call[3] = {NULL, self, NULL};
    Py_ssize_t given = nargs + (kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames));
    if (given > 1) {
        PyErr_SetString(PyExc_TypeError, "resolve() takes at most one argument (timeout)");
        return NULL;
    }
    if (given == 1) call[2] = args[0];
    return PyObject_Vectorcall(consts.base_resolve, call + 1, (size_t)(1 + nargs) | PY_VECTORCALL_ARGUMENTS_OFFSET,
                               kwnames);
}

static long state_of(PyObject *op) {
    PyObject *state = OP(op)->state;
    return state != NULL && PyLong_CheckExact(state) ? PyLong_AsLong(state) : -1;
}

/* 1 if `value` (a record's field) is a container with something in it, a nonzero int or True; -1 on error. */
static int nonempty(PyObject *value) {
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "a record's field is not set");
        return -1;
    }
    return PyObject_IsTrue(value);
}

/* Take `op` out of the engine's posted ops; 0 also where it is not there (a Python wait that
 * was interrupted after taking it out), -1 on error. */
static int remove_posted(PyObject *engine, PyObject *op) {
    PyObject *posted = ENGINE(engine)->posted;
    int found = 0;
    if (posted != NULL && PyList_Check(posted))
        for (Py_ssize_t i = PyList_GET_SIZE(posted) - 1; i >= 0; i--)
            if (PyList_GET_ITEM(posted, i) == op) {
                found = PyList_SetSlice(posted, i, i + 1, NULL);
                break;
            }
    return found;
}

/* What `Engine._complete` does for an op without protections or stepper: 0, or -1 with the op failed. */
static int complete(PyObject *op) {
    if (field_steal(&OP(op)->requests, PyList_New(0)) < 0) return -1;
    field_set(&OP(op)->keep, consts.empty_tuple);
    PyObject *finish = OP(op)->finish;
    if (finish != NULL && finish != Py_None) {
        PyObject *result = PyObject_CallNoArgs(finish);
        if (result == NULL) {
            PyObject *type, *value, *traceback;
            PyErr_Fetch(&type, &value, &traceback);
            PyErr_NormalizeException(&type, &value, &traceback);
            field_set(&OP(op)->error, value);
            field_set(&OP(op)->state, consts.states[FAILED]);
            PyErr_Restore(type, value, traceback);
            return -1;
        }
        field_steal(&OP(op)->result, result);
    }
    field_set(&OP(op)->state, consts.states[COMPLETE]);
    trace_mark(op, RING_COMPLETE);
    return 0;
}

/* Test the request until it completes or SLICE_NS pass; MPI's error code (call without the GIL).
 * Between tests the core is given back (`yield`: where ranks outnumber cores, at once; else once
 * the slice has spun SPIN_NS, as idle.h says): a peer that is late needs a core, which on a busy
 * machine (other programs, oversubscribed test ranks) may be this one; on a quiet one a yield
 * costs a system call and returns at once. */
static IdleState idle_state;

static int wait_slice(void *slot, int *flag, int yield) {
    long long start = idle_now();
    for (;;) {
        int code = mpi_test(slot, flag);
        if (code != 0 || *flag) return code;
        long long spent = idle_now() - start;
        if (spent >= SLICE_NS) return 0;
        if (yield || spent >= SPIN_NS) idle_pause(&idle_state, yield);
    }
}

/* Whether nothing but this op's request is awaited: no group's queue waits to post, no op to
 * step (no peer then waits for this rank to post or step); 1 yes, 0 no, -1 error. */
static int alone(PyObject *engine) {
    int waiting = nonempty(ENGINE(engine)->waiting_groups);
    if (waiting != 0) return waiting < 0 ? -1 : 0;
    int stepping = nonempty(ENGINE(engine)->stepping);
    return stepping < 0 ? -1 : !stepping;
}

/* Wait for the op's one request under the engine's lock; 1 done, 0 left to the Python resolve,
 * -1 error. Between slices of the wait the lock is let go while signal handlers run; *locked
 * says whether it is held on return (not where a handler raised, or taking it back failed). */
static int wait_posted(PyObject *op, PyObject *engine, int may_block, int spins, int *locked) {
    PyObject *requests = OP(op)->requests, *protections = OP(op)->protections;
    if (state_of(op) != POSTED || requests == NULL || !PyList_CheckExact(requests) ||
        PyList_GET_SIZE(requests) != 1 || protections != consts.empty_tuple)
        return 0;
    int ready = alone(engine);
    if (ready <= 0) return ready;
    /* Both kept while the lock is let go: the op's list is compared with them afterwards. */
    Py_INCREF(requests);
    PyObject *request = Py_NewRef(PyList_GET_ITEM(requests, 0));
    int result = 1, flag = 0, code = 0;
    void *slot = mpi_request_slot(request);
    if (slot == NULL) result = -1;
    for (int spin = 0; result > 0 && spin < spins && !flag && code == 0; spin++) code = mpi_test(slot, &flag);
    while (result > 0 && !flag && code == 0) {
        if (!may_block) {
            result = 0;
            break;
        }
        int yield = spins == OVERSUBSCRIBED_SPINS;
        Py_BEGIN_ALLOW_THREADS
        code = wait_slice(slot, &flag, yield);
        Py_END_ALLOW_THREADS
        if (flag || code != 0) break;
        /* Python's handlers of the signals that came run here, with the engine's lock let go
         * (the op is posted and tracked: the engine's state is whole), so that a handler may
         * use the context. One that raises ends the wait with its error. */
        engine_unlock(engine);
        *locked = 0;
        if (PyErr_CheckSignals() < 0 || engine_lock(engine) < 0) {
            result = -1;
            break;
        }
        *locked = 1;
        /* Meanwhile a handler, the progress thread or another thread's resolve() may have
         * completed the op, or posted calls that need this rank's progress. */
        if (state_of(op) != POSTED || OP(op)->requests != requests) result = 0;
        else result = alone(engine);
    }
    if (result > 0 && code != 0) {
        mpi_failed(engine, code, op, OP(op)->name);
        result = -1;
    }
    if (result > 0 && (remove_posted(engine, op) < 0 || complete(op) < 0)) result = -1;
    Py_DECREF(request);
    Py_DECREF(requests);
    return result;
}

/* Whether this thread holds the engine's lock: only a signal handler (or a finalizer) that
 * interrupted the engine's bookkeeping calls in then; 1 yes, 0 no, -1 error. */
int lock_held_here(PyObject *engine) {
    PyObject *owned = PyObject_CallNoArgs(ENGINE(engine)->lock_owned);
    if (owned == NULL) return -1;
    int truth = PyObject_IsTrue(owned);
    Py_DECREF(owned);
    return truth;
}

/* How many times to test before waiting: `SPINS`, or `OVERSUBSCRIBED_SPINS` where the engine
 * waits as on a node with more ranks than cores. */
static int spins_for(PyObject *engine) {
    PyObject *pauses = ENGINE(engine)->spin_pauses;
    long value = pauses == NULL ? -1 : PyLong_AsLong(pauses);
    PyErr_Clear();
    return value >= 0 && value < consts.spin_pauses ? OVERSUBSCRIBED_SPINS : SPINS;
}

/* The handle resolved: its value, settled first where it is a `Later` (the result given back
 * in another library's kind), as `CollectiveTensor.resolve` does. */
static PyObject *resolved_value(PyObject *self, PyObject *op) {
    PyObject *value = HANDLE(self)->value;
    if (PyObject_TypeCheck(value, (PyTypeObject *)consts.later_type)) {
        PyObject *settled = PyObject_CallFunctionObjArgs(consts.settle, value, OP(op)->result, NULL);
        if (field_steal(&HANDLE(self)->value, settled) < 0) return NULL;
        value = settled;
    }
    field_set(&HANDLE(self)->resolved, Py_True);
    trace_mark(op, RING_RESOLVED);
    return Py_NewRef(value);
}

static PyObject *resolve(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *op = HANDLE(self)->op, *value = HANDLE(self)->value;
    PyObject *ctx = HANDLE(self)->ctx, *resolved = HANDLE(self)->resolved;
    /* The op's fields are read in its record: anything else (a handle's op replaced by hand;
     * LaneTensor() refuses one at construction) is refused before any is read. */
    if (op != NULL && !PyObject_TypeCheck(op, types.op_record)) {
        PyErr_Format(PyExc_TypeError, "a LaneTensor is the handle of an engine Op, got %.100s", Py_TYPE(op)->tp_name);
        return NULL;
    }
    /* resolve(None) is resolve(): the context's timeout (the Python resolve's own default). */
    int no_timeout = (nargs == 0 || (nargs == 1 && args[0] == Py_None)) && kwnames == NULL;
    if (!no_timeout || op == NULL || value == NULL || ctx == NULL || resolved == NULL ||
        !PyObject_TypeCheck(ctx, types.context_record) || CONTEXT(ctx)->engine == NULL ||
        !PyObject_TypeCheck(CONTEXT(ctx)->engine, types.engine_record))
        return general(self, args, nargs, kwnames);
    long state = state_of(op);
    int closed = nonempty(CONTEXT(ctx)->closed);
    if (closed < 0) return NULL;
    if (state == COMPLETE && (resolved == Py_True || !closed)) return resolved_value(self, op);
    if (state != POSTED || closed) return general(self, args, nargs, kwnames);
    /* Held for the call: Python code runs meanwhile (the lock's methods, signal handlers). */
    PyObject *engine = Py_XNewRef(CONTEXT(ctx)->engine), *timeout = Py_XNewRef(CONTEXT(ctx)->timeout);
    int stepping = engine == NULL || timeout == NULL ? -1 : nonempty(ENGINE(engine)->stepping), done = -1;
    if (stepping == 0) {
        /* Held by this thread: a signal handler interrupted the engine, and the Python
         * resolve refuses it (Engine.reentered) without touching the engine. */
        int held = lock_held_here(engine);
        if (held > 0) {
            done = 0;
        } else if (held == 0 && engine_lock(engine) == 0) {
            int spins = spins_for(engine), locked = 1;
            done = wait_posted(op, engine, timeout == Py_None, spins, &locked);
            if (locked) engine_unlock(engine); /* keeps wait_posted's error, if it failed */
        }
    } else if (stepping > 0) {
        done = 0;
    }
    Py_XDECREF(engine);
    Py_XDECREF(timeout);
    if (done < 0) return NULL;
    if (done == 0) return general(self, args, nargs, kwnames);
    return resolved_value(self, op);
}

PyObject *handle_resolve(PyObject *handle) { return resolve(handle, NULL, 0, NULL); }

PyMethodDef handle_resolve_def = {
    "resolve", (PyCFunction)(void (*)(void))resolve, METH_FASTCALL | METH_KEYWORDS,
    "resolve($self, /, timeout=None)\n--\n\n"
    "Wait for the collective, finish it, and return its result (see CollectiveTensor.resolve).\n\n"
    "Compiled for the ops a lane starts; every case but a posted op's plain wait is the\n"
    "general resolve's.",
};
