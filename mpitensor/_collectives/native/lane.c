/* The compiled lane: what `CopyLane.start` and `CheckLane.start` do, in one C call.
 *
 * A lane is made by `lane.keep_lane` beside the Python lane of the same kind, with
 * everything a call of that kind needs: the context, its full group and engine, the MPI
 * handles, the dtype and shape, the check's record and agreement hash. A call on it
 *
 * - `COPY` (up to 64 KiB): copies the input and posts MPI_Iallreduce in place on the copy,
 *   registering the op with the engine's posted ops as `Engine.submit` does for an op with
 *   nothing before it (the group's queue empty, no held op). With the check on (2-8
 *   ranks), the check's row (the agreement hash, no payload) goes first, as
 *   `Engine._post_check` posts it; when every row agrees within the spin (the usual case),
 *   the data is posted at once, as `Engine._pump` would post it;
 * - `CHECK` (check on, up to 64 bytes, 2-8 ranks): the check's row carries the input; when
 *   every row agrees within the spin, the rows are reduced as `reduce_carried` does and
 *   the call completes at once;
 * - `HELD` (check on, 2-8 ranks; `all_reduce_held`): the caller holds the input and the
 *   result buffer (one array, or two); when every row agrees within the spin, MPI's
 *   blocking all-reduce reduces one into the other, the GIL released, as the `Held`
 *   transport does once the engine has seen the check agree, and the call completes at once.
 *   A HELD lane of a broadcast, all-gather, all-to-all, gather or reduce (`held.py`) does the
 *   same with MPI's blocking call (of bytes, but for the reduce) from the caller's input into
 *   its result buffer; off the root, a gather's and a reduce's result is the input.
 *
 * For MAX/MIN of float32 and float64 (`keys`), MPI reduces OrderedKeys, as on the general
 * path: a `COPY` lane's copy is made of the input's keys, and its op's finish decodes them;
 * a `CHECK` lane reduces the rows through keys, and a queued op of it (whose post leaves
 * keys, `reduce_carried_keys`) decodes them in its finish too.
 *
 * A check that does not agree within the spin (a late peer, or rows that differ) queues its
 * op on the group as `Engine._queue` does, under the same hold of the engine's lock as the
 * check's post, and the call goes on in `Engine.await_queued_check`: from there on the op is
 * the Python engine's, exactly as if `Engine.submit` had posted that check. No Python code
 * runs from the check's post to the op's place in the queue (so no signal handler, which
 * could leave the check without its op): see `queue_op`.
 *
 * Whenever the engine is not idle for the group, or a step fails before anything is
 * posted, the call is declined (None): the Python lane, then the general path, take it.
 */
#include "native.h"

#include <limits.h>
#include <pythread.h>
#include <string.h>
#include <structmember.h>

#include "idle.h"

enum { LANE_COPY = 0, LANE_CHECK = 1, LANE_HELD = 2 };
enum { RECORD_CODE = 4, RECORD_PAYLOAD = 5 }; /* the words of a large group's check record */
enum { KEYS_NONE = 0, KEYS_MAX = 1, KEYS_MIN = 2 };
/* The collective a lane's calls are. */
enum { OF_ALL_REDUCE = 0, OF_BROADCAST = 1, OF_ALL_GATHER = 2, OF_ALL_TO_ALL = 3, OF_GATHER = 4, OF_REDUCE = 5 };

typedef struct {
    PyObject_HEAD
    int kind;
    PyObject *ctx, *engine, *group, *op_key, *device, *record, *done_op, *nbytes_obj;
    PyObject *post_start, *post_comm, *post_plan; /* a queued op's post: partial(start, comm, out, [payload,] plan) */
    PyArray_Descr *descr;
    int ndim;
    npy_intp dims[NPY_MAXDIMS];
    npy_intp count, nbytes;
    mpi_handle comm, check_comm, datatype, mpi_op;
    int size, spins, divide, rows_kind, type_num;
    int keys; /* MPI reduces MAX/MIN keys of floats: 0 none, else KEYS_MAX or KEYS_MIN */
    int into; /* HELD: the result lands in the caller's other array (1), or in the input (0) */
    /* A HELD all-reduce of 2 ranks: its per-rank value says whether this rank's core is contested
     * (consts.contested), and where a rank's is, the data moves in one exchange (`exchange_once`,
     * as _transport/mpi/all_reduce.py `held_all_reduce` does); `once`: the last agreed check said so. */
    int contests, once;
    long long exchanged; /* calls whose data this lane moved in one exchange */
    void *scratch; /* what one exchange receives into where it cannot be the result buffer (NULL: none yet) */
    /* The last agreed one exchange's way: through the group's shared pair (1, `pair` set), none
     * set up yet (0: the Python path sets it up), or MPI's (-1; pair.h `find`). */
    int shared;
    Pair *pair;
    /* Whether the group's checks gather rows; else (a large group) they all-reduce one record of
     * consts.check_words int64 with mpitensor's op (check.c), `code` saying what a CHECK call carries. */
    int gathers;
    long long code;
    mpi_handle check_datatype, check_op;
    int collective, root, me; /* OF_*; a rooted call's root and this rank, in the group's communicator */
    PyObject *name;           /* the collective's name: its ops', and MPI's errors' */
    unsigned long owner;
    long long value, per_rank;
    PyObject *send, *recv, *request; /* the check's buffers and request, reused while no op holds them */
    PyObject *ring;                   /* the context's trace ring, or NULL where it does not trace */
    int32_t trace_kind;
    int64_t trace_group;
} Lane;

/* ---- helpers ------------------------------------------------------------------------------ */

int engine_lock(PyObject *engine) {
    PyObject *got = PyObject_CallNoArgs(ENGINE(engine)->lock_acquire);
    if (got == NULL) return -1;
    Py_DECREF(got);
    return 0;
}

void engine_unlock(PyObject *engine) {
    Pending pending = pending_take(); /* the caller's error, if it is on an error path */
    PyObject *release = ENGINE(engine)->lock_release;
    PyObject *got = PyObject_CallNoArgs(release);
    if (got == NULL) PyErr_WriteUnraisable(release);
    Py_XDECREF(got);
    pending_restore(pending);
}

/* A new object of a class derived from a record, its fields empty (filled by the caller). */
static PyObject *alloc(PyTypeObject *type) { return type->tp_alloc(type, 0); }

PyObject *make_tensor(PyObject *array, PyObject *device) {
    PyObject *tensor = alloc(types.tensor_type);
    if (tensor == NULL) return NULL;
    field_set(&TENSOR(tensor)->array, array);
    field_set(&TENSOR(tensor)->device, device);
    return tensor;
}

PyObject *make_handle(PyObject *op, PyObject *value, PyObject *ctx) {
    PyObject *handle = alloc(types.handle_type);
    if (handle == NULL) return NULL;
    field_set(&HANDLE(handle)->op, op);
    field_set(&HANDLE(handle)->value, value);
    field_set(&HANDLE(handle)->ctx, ctx);
    field_set(&HANDLE(handle)->resolved, Py_False);
    return handle;
}

/* An op of this lane in `state`, with the fields every op has (as `Op.__init__` sets them). */
static PyObject *make_op(Lane *lane, int state, PyObject *record, PyObject *finish) {
    PyObject *op = alloc(types.op_type);
    if (op == NULL) return NULL;
    OpRecord *o = OP(op);
    field_set(&o->name, lane->name);
    field_set(&o->group, lane->group);
    field_set(&o->nbytes, lane->nbytes_obj);
    field_set(&o->post, Py_None);
    field_set(&o->finish, finish);
    field_set(&o->record, record);
    field_set(&o->keep, consts.empty_tuple);
    field_set(&o->protections, consts.empty_tuple);
    field_set(&o->exchange, Py_False);
    field_set(&o->compare, record == Py_None ? Py_False : Py_True);
    field_set(&o->payload, Py_None);
    field_set(&o->stepper, Py_None);
    field_set(&o->state, consts.states[state]);
    field_set(&o->result, Py_None);
    field_set(&o->error, Py_None);
    field_set(&o->trace, Py_None);
    if (field_steal(&o->requests, PyList_New(0)) < 0) {
        Py_DECREF(op);
        return NULL;
    }
    return op;
}

/* What `result` needs once reduced, as a callable the engine's `_complete` runs: MEAN's
 * division, or MAX/MIN keys decoded; None for every other op. */
static PyObject *finisher(Lane *lane, PyObject *result) {
    if (lane->keys != KEYS_NONE) return PyObject_CallOneArg((PyObject *)&DecodeType, result);
    if (!lane->divide) return Py_NewRef(Py_None);
    return PyObject_CallFunction((PyObject *)&DivideType, "Oi", result, lane->size);
}

/* Whether the engine may take an op of this group now with nothing before it; -1 on error. */
static int group_idle(Lane *lane, int check) {
    GroupRecord *group = GROUP(lane->group);
    if (group->queue == NULL || group->holder == NULL) {
        PyErr_SetString(PyExc_AttributeError, "a group's queue and holder are not set");
        return -1;
    }
    Py_ssize_t queued = PyObject_Length(group->queue);
    if (queued < 0) return -1;
    int idle = queued == 0 && group->holder == Py_None;
    if (!idle || !check) return idle;
    PyObject *stepping = ENGINE(lane->engine)->stepping;
    return stepping != NULL && PyLong_Check(stepping) && PyLong_AsLong(stepping) == 0;
}

/* The context may run a collective from this thread (else the general path says why not). */
static int usable_here(Lane *lane) {
    return CONTEXT(lane->ctx)->usable == Py_True && PyThread_get_thread_ident() == lane->owner;
}

/* ---- the check ---------------------------------------------------------------------------- */

/* The check's send row, receive rows and request for this call: the lane's own when no op
 * holds them (the usual case: the last call's check agreed at once), else new ones. */
static int take_buffers(Lane *lane, PyObject **send, PyObject **recv, PyObject **request) {
    if (lane->send == NULL || Py_REFCNT(lane->send) > 1 || Py_REFCNT(lane->recv) > 1 ||
        Py_REFCNT(lane->request) > 1) {
        Py_CLEAR(lane->send);
        Py_CLEAR(lane->recv);
        Py_CLEAR(lane->request);
        Py_ssize_t sent = lane->gathers ? consts.row_bytes : (Py_ssize_t)consts.check_words * 8;
        lane->send = PyByteArray_FromStringAndSize(NULL, sent);
        if (lane->send != NULL)
            lane->recv = PyByteArray_FromStringAndSize(NULL, lane->gathers ? sent * lane->size : sent);
        if (lane->recv != NULL) lane->request = mpi_new_request();
        if (lane->request == NULL) {
            Py_CLEAR(lane->send);
            Py_CLEAR(lane->recv);
            Py_CLEAR(lane->request);
            return -1;
        }
    }
    *send = lane->send;
    *recv = lane->recv;
    *request = lane->request;
    return 0;
}

/* The row: the agreement hash and the per-rank value (the engine's "=qq" header), then the
 * input where the check carries it, zeros otherwise. */
static void fill_row(Lane *lane, char *row, PyArrayObject *array) {
    Py_ssize_t carried = lane->kind == LANE_CHECK ? (Py_ssize_t)lane->nbytes : 0;
    if (!lane->gathers) {
        /* A large group's record (_transport/reduced_check.py): h, -h, v, -v, code, payload. */
        int64_t *words = (int64_t *)row;
        memset(row, 0, (size_t)consts.check_words * 8);
        words[0] = lane->value;
        words[1] = -lane->value;
        words[2] = lane->per_rank;
        words[3] = -lane->per_rank;
        words[RECORD_CODE] = carried ? lane->code : 0;
        if (carried) memcpy(words + RECORD_PAYLOAD, PyArray_DATA(array), (size_t)carried);
        return;
    }
    int64_t per_rank = lane->contests ? consts.contested != NULL && consts.contested() : lane->per_rank;
    int64_t header[2] = {(int64_t)lane->value, per_rank};
    memcpy(row, header, sizeof header);
    if (carried) memcpy(row + consts.header_bytes, PyArray_DATA(array), (size_t)carried);
    memset(row + consts.header_bytes + carried, 0, (size_t)(consts.payload_bytes - carried));
}

/* Add one to the int in a record's `field`; its old value in *old (a new reference; if old is not NULL). */
static int increment(PyObject **field, PyObject **old) {
    PyObject *value = *field;
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "a record's counter is not set");
        return -1;
    }
    PyObject *next = PyNumber_Add(value, consts.one);
    if (next == NULL) return -1;
    if (old != NULL) *old = Py_NewRef(value);
    field_steal(field, next);
    return 0;
}

/* Where ranks outnumber cores (or the thread waits for a late peer's check at the call), the
 * peers a check waits for may need this core: give it back between tests, for at most
 * YIELD_NS, as the Python engine's wait for a check does (`Backoff`): a yield where ranks
 * outnumber cores, else idle.h's pause (a yield, or a short sleep where another program
 * contends for the core). Only a check still in flight after that goes to the Python engine.
 * The GIL is released while pausing; the engine's lock stays held, which only keeps other
 * threads' resolve() and test() out for that long (nothing else may post meanwhile: only this
 * thread calls collectives). */
#define SPINS_WITH_A_CORE 64
#define YIELD_NS 2000000

static IdleState idle_state;

static int yield_until_done(void *slot, int *flag, int oversubscribed) {
    long long start = idle_now();
    int code = 0;
    do {
        Py_BEGIN_ALLOW_THREADS
        idle_pause(&idle_state, oversubscribed);
        Py_END_ALLOW_THREADS
        code = mpi_test(slot, flag);
    } while (code == 0 && !*flag && idle_now() - start < YIELD_NS);
    return code;
}

/* A late check of a 2-rank group whose ranks share a pair, on a contested core: sleep until the
 * peer posted its check (pair.h `doze`), then test it, for at most YIELD_NS, rather than queue
 * it for the Python engine's waits, which look again every few microseconds. */
#define DOZE_NS 500000L

static int dozes(Lane *lane) {
    return lane->size == 2 && consts.pair != NULL && consts.contested != NULL && consts.contested();
}

static int doze_until_done(Lane *lane, void *slot, int *flag, uint32_t checks) {
    long long start = idle_now();
    int code = 0, dozed;
    do {
        Py_BEGIN_ALLOW_THREADS
        dozed = consts.pair->doze(lane->comm, checks, DOZE_NS);
        if (dozed > 0) idle_pause(&idle_state, 0); /* posted: MPI's test has yet to find it */
        Py_END_ALLOW_THREADS
        if (dozed < 0) return 0; /* no pair: queued as before */
        code = mpi_test(slot, flag);
    } while (code == 0 && !*flag && idle_now() - start < YIELD_NS);
    return code;
}

/* Whether this thread's calls wait for a late peer's check here, yielding the core between tests
 * as where ranks outnumber cores, rather than queue it at once: set by a caller that waits for
 * the result right away (`wait_at_call`: a collective inside a compiled program). Queued, the
 * call would wait as well, in the Python engine's slower steps. */
static _Thread_local int waiting_at_call;

const char wait_at_call_doc[] =
"wait_at_call(flag)\n--\n\n"
"Have this thread's calls wait for a late peer's check in C, yielding the core between tests\n"
"(for up to 2 ms), before they queue it (flag true), or queue it after the lane's few tests\n"
"(false, the default). Returns the previous setting.";

PyObject *wait_at_call(PyObject *module, PyObject *flag) {
    (void)module;
    int value = PyObject_IsTrue(flag);
    if (value < 0) return NULL;
    int previous = waiting_at_call;
    waiting_at_call = value;
    return PyBool_FromLong(previous);
}

/* Whether this lane can move an agreed one exchange itself: through the group's shared pair, or
 * through MPI where none will be and the lane has a buffer to receive into. Else the engine
 * moves it: the Python path sets the pair up (both ranks are in the call), or `call_run` makes
 * the buffer (a quiet machine's lanes never hold one). */
static int exchange_ready(Lane *lane) {
    lane->pair = NULL;
    lane->shared = consts.pair == NULL ? -1 : consts.pair->find(lane->comm, (size_t)lane->nbytes, &lane->pair);
    return lane->shared > 0 || (lane->shared < 0 && lane->scratch != NULL);
}

/* Post the check's all-gather of `row` into `rows` as `Engine._post_check` does (the group's
 * check number in *seq), then spin on it. 1: every row says what this rank's says (the same
 * call, and for a carried call each row carrying its input): agreed at once. 0: posted, not
 * agreed yet (late, or rows that differ: the engine finds out which). -1: MPI failed to post
 * it (the context is broken; the error is set). Call with the engine's lock held. */
static int check_at_once(Lane *lane, const char *row, char *rows, void *slot, PyObject **seq) {
    lane->once = 0;
    if (increment(&GROUP(lane->group)->check_seq, seq) < 0) return -1;
    if (increment(&ENGINE(lane->engine)->checks_posted, NULL) < 0) {
        Py_CLEAR(*seq);
        return -1;
    }
    int code = lane->gathers ? mpi_iallgather_bytes(row, rows, consts.row_bytes, lane->check_comm, slot)
                             : mpi_iallreduce(row, rows, 1, lane->check_datatype, lane->check_op, lane->check_comm, slot);
    if (code != 0) {
        Py_CLEAR(*seq);
        mpi_failed(lane->engine, code, Py_None, lane->name);
        return -1;
    }
    /* The group's checks this rank has posted, this one's included. */
    uint32_t checks = (uint32_t)PyLong_AsUnsignedLongLongMask(*seq) + 1;
    if (lane->size == 2 && consts.pair != NULL) consts.pair->ring(lane->comm, checks);
    int flag = 0;
    for (int spin = 0; spin < lane->spins && !flag; spin++)
        if (mpi_test(slot, &flag) != 0) return 0; /* the Python engine tests it again and reports */
    int oversubscribed = lane->spins < SPINS_WITH_A_CORE;
    if (!flag && (oversubscribed || waiting_at_call) && yield_until_done(slot, &flag, oversubscribed) != 0)
        return 0;
    if (!flag && dozes(lane) && doze_until_done(lane, slot, &flag, checks) != 0) return 0;
    if (!flag) return 0;
    if (!lane->gathers) /* every member said what this rank says, and carried what it carries */
        return memcmp(rows, row, 4 * sizeof(int64_t)) == 0 &&
               ((const int64_t *)rows)[RECORD_CODE] == ((const int64_t *)row)[RECORD_CODE];
    /* Every member's row says what this rank's says; a contesting lane's per-rank values may
     * differ (whether each core is contested), and any one set makes the data move in one exchange. */
    size_t compared = lane->contests ? sizeof(int64_t) : (size_t)consts.header_bytes;
    int once = 0;
    for (int member = 0; member < lane->size; member++) {
        const char *said = rows + (size_t)member * consts.row_bytes;
        if (memcmp(said, row, compared) != 0) return 0;
        once |= lane->contests && ((const int64_t *)said)[1] != 0;
    }
    lane->once = once;
    return !once || exchange_ready(lane);
}

/* Make `op` an op whose check is posted and not yet agreed, and queue it on the group as
 * `Engine._queue` does (at the head of the idle group's queue, the group waiting; its check is
 * pumped later, by `Engine._wait_check`); the Python engine posts its data once the check
 * agrees, through the post made here (`reduce_carried` or `in_place` on `out`). Call with the
 * engine's lock held, right after the check's post, and with the collector off: nothing here
 * runs Python code (field stores of fresh values, a bytes object, functools' C partial, a
 * deque's += of a tuple and a set's add of an object hashed by identity, none of which can call out),
 * so no signal handler or finalizer can run between the check and its op. 0, or -1 with an
 * error set. */
static int queue_op(Lane *lane, PyObject *op, PyObject *seq, PyObject *send, PyObject *recv, PyObject *request,
                    PyObject *source, PyObject *out) {
    PyObject *payload = Py_None;
    if (lane->kind == LANE_CHECK) {
        const char *carried = PyByteArray_AS_STRING(send) + (lane->gathers ? consts.header_bytes
                                                                               : RECORD_PAYLOAD * (int)sizeof(int64_t));
        payload = PyBytes_FromStringAndSize(carried, consts.payload_bytes);
        if (payload == NULL) return -1;
    }
    /* partial(start, comm, out, [payload,] plan), or for HELD partial(start, comm, source, out, plan) */
    PyObject *args[5] = {lane->post_start, lane->post_comm, out, payload, lane->post_plan};
    if (lane->kind == LANE_HELD) {
        args[2] = source;
        args[3] = out;
    } else if (lane->kind != LANE_CHECK) {
        args[3] = lane->post_plan;
    }
    PyObject *post = PyObject_Vectorcall(consts.partial, args, lane->kind == LANE_COPY ? 4 : 5, NULL);
    PyObject *stage = post == NULL ? NULL : PyLong_FromLong(consts.agree_stage);
    OpRecord *o = OP(op);
    int failed = stage == NULL || PyList_SetSlice(o->requests, 0, PyList_GET_SIZE(o->requests), NULL) < 0;
    if (!failed) {
        field_set(&o->state, consts.states[CHECKING]);
        field_set(&o->payload, payload);
        field_set(&o->seq, seq);
        field_set(&o->check_send, send);
        field_set(&o->check_recv, recv);
        field_set(&o->check_req, request);
        field_steal(&o->post, post);
        field_steal(&o->check_stage, stage);
        if (lane->contests) field_set(&o->exchange, Py_True); /* its post takes each rank's contested state */
        post = stage = NULL;
    }
    if (payload != Py_None) Py_DECREF(payload);
    Py_XDECREF(post);
    Py_XDECREF(stage);
    if (failed) return -1;
    /* The deque's += (its sequence protocol) appends the op: no method looked up by name. */
    PyObject *one = PyTuple_Pack(1, op);
    PyObject *appended = one == NULL ? NULL : PySequence_InPlaceConcat(GROUP(lane->group)->queue, one);
    PyObject *waiting = ENGINE(lane->engine)->waiting_groups;
    int added = appended == NULL || waiting == NULL || !PySet_Check(waiting) ? -1 : PySet_Add(waiting, lane->group);
    if (appended != NULL && added < 0 && !PyErr_Occurred())
        PyErr_SetString(PyExc_TypeError, "the engine's waiting groups are not a set");
    Py_XDECREF(one);
    Py_XDECREF(appended);
    return added;
}

/* A check was posted and its op could not be queued (memory ran out): the group's sequence
 * of checks has one the engine does not know of, so the context is broken. Keeps the error. */
static void lost_check(Lane *lane) {
    Pending pending = pending_take();
    PyObject *why = PyUnicode_FromString(
        "the compiled lane posted an all_reduce's check and could not queue its op (out of memory): this "
        "rank's checks no longer pair with its peers'");
    PyObject *done = why == NULL ? NULL : PyObject_CallOneArg(ENGINE(lane->engine)->mark_broken, why);
    if (done == NULL) PyErr_WriteUnraisable(lane->ctx);
    Py_XDECREF(done);
    Py_XDECREF(why);
    pending_restore(pending);
}

/* ---- a call ------------------------------------------------------------------------------ */

/* What a call holds: made before anything is posted, so that once MPI has the call only the
 * engine's bookkeeping is left to do. */
typedef struct {
    PyObject *out;       /* the result array: the copy MPI reduces in place, or where rows are reduced */
    PyObject *op;        /* the call's op (in state POSTED until told otherwise) */
    PyObject *handle;    /* the CollectiveTensor returned */
    PyObject *request;   /* the data's request (inside the op's requests) */
    PyObject *send, *recv, *check_request; /* the check's, when the call is checked (borrowed from the lane) */
    PyObject *source;    /* HELD: the caller's input (borrowed) */
} Call;

/* Where the context traces: a call of this lane called at `called` gets its span (the op's
 * `trace`); 0, or -1 with an error set (memory ran out). */
static int trace_begin(Lane *lane, Call *call, int64_t called) {
    if (lane->ring == NULL) return 0;
    PyObject *span = ring_api->begin(lane->ring, lane->trace_kind, lane->trace_group, lane->nbytes, lane->type_num,
                                     called);
    return field_steal(&OP(call->op)->trace, span);
}

/* Record that the call's data was posted now by MPI, or (`carried`) came in its check, which agreed now. */
static void trace_posted(Lane *lane, Call *call, int64_t called, int carried) {
    if (lane->ring == NULL) return;
    if (carried) {
        /* No span: the handle shares the done op, and nothing is left to record. */
        if (ring_api->carried_event(lane->ring, lane->trace_kind, lane->trace_group, lane->nbytes, lane->type_num,
                                    called) < 0)
            PyErr_Clear(); /* memory ran out: the call went through, only its record is lost */
        return;
    }
    ring_api->posted(OP(call->op)->trace, RING_MPI);
}

static void call_clear(Call *call) {
    Py_CLEAR(call->out);
    Py_CLEAR(call->op);
    Py_CLEAR(call->handle);
    Py_CLEAR(call->request);
}

/* The call's objects; 0, or -1 when one could not be made (nothing is posted: the call is declined). */
static int call_prepare(Lane *lane, Call *call, PyObject *device, PyArrayObject *array, PyObject *held_out) {
    memset(call, 0, sizeof *call);
    if (held_out != NULL && lane->kind != LANE_HELD) {
        /* A COPY or CHECK call into the caller's buffer (`start_into`): MPI reduces there in place
         * (the input copied in first, as keys where MPI reduces keys), or the rows are reduced there. */
        void *data = PyArray_DATA((PyArrayObject *)held_out);
        if (lane->kind == LANE_COPY && lane->keys != KEYS_NONE)
            keys_encode(lane->type_num, lane->keys == KEYS_MAX, PyArray_DATA(array), data, lane->count);
        else if (lane->kind == LANE_COPY && held_out != (PyObject *)array)
            memcpy(data, PyArray_DATA(array), (size_t)lane->nbytes);
        call->out = Py_NewRef(held_out);
    } else if (lane->kind == LANE_COPY && lane->keys != KEYS_NONE) {
        /* MPI reduces the keys: the copy is made of them. */
        Py_INCREF(lane->descr);
        call->out = PyArray_Empty(lane->ndim, lane->dims, lane->descr, 0);
        if (call->out != NULL)
            keys_encode(lane->type_num, lane->keys == KEYS_MAX, PyArray_DATA(array),
                        PyArray_DATA((PyArrayObject *)call->out), lane->count);
    } else if (lane->kind == LANE_COPY) {
        call->out = PyArray_NewCopy(array, NPY_CORDER);
    } else if (lane->kind == LANE_HELD) {
        call->out = Py_NewRef(held_out);
        call->source = (PyObject *)array;
    } else {
        Py_INCREF(lane->descr);
        call->out = PyArray_Empty(lane->ndim, lane->dims, lane->descr, 0);
    }
    if (call->out == NULL) return -1;
    /* A carried call that agrees at once shares the lane's done op; its own op is made all the
     * same, before the check is posted, so that nothing left to make can fail once it is. */
    PyObject *finish = finisher(lane, call->out);
    if (finish == NULL) return -1;
    call->op = make_op(lane, POSTED, lane->record, finish);
    Py_DECREF(finish);
    if (call->op == NULL) return -1;
    PyObject *result = make_tensor(call->out, device);
    if (result == NULL) return -1;
    call->handle = make_handle(call->op, result, lane->ctx);
    Py_DECREF(result);
    if (call->handle == NULL) return -1;
    if (lane->kind == LANE_COPY) {
        PyObject *keep = PyTuple_Pack(1, call->out); /* MPI writes the copy until the op completes */
        if (keep != NULL) call->request = mpi_new_request();
        if (call->request == NULL || PyList_Append(OP(call->op)->requests, call->request) < 0) {
            Py_XDECREF(keep);
            return -1;
        }
        field_steal(&OP(call->op)->keep, keep);
    }
    if (lane->record != Py_None) {
        if (take_buffers(lane, &call->send, &call->recv, &call->check_request) < 0) return -1;
        fill_row(lane, PyByteArray_AS_STRING(call->send), array);
    }
    return 0;
}

/* Post the copy's MPI_Iallreduce and register the op with the engine's posted ops (lock held).
 * 1 posted; 0 not posted, and MPI's error is the op's (a checked call's peers wait for its
 * data: it fails as the engine's `_post_data` fails it, and resolve() raises); -1 error. */
static int post_data(Lane *lane, Call *call, PyObject *posted) {
    int code = mpi_iallreduce_in_place(PyArray_DATA((PyArrayObject *)call->out), (int)lane->count, lane->datatype,
                                       lane->mpi_op, lane->comm, mpi_request_slot(call->request));
    if (code != 0) {
        mpi_failed(lane->engine, code, call->op, lane->name);
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        PyErr_NormalizeException(&type, &value, &traceback);
        field_set(&OP(call->op)->error, value);
        field_set(&OP(call->op)->state, consts.states[FAILED]);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(traceback);
        return 0;
    }
    return PyList_Append(posted, call->op) < 0 ? -1 : 1;
}

/* The HELD call's MPI call from `source` (NULL: in place) into `out`: blocking where `request` is
 * NULL, else nonblocking into `request`. Buffers never overlap where there are two (start_held
 * declines those). */
static int held_post(Lane *lane, const void *source, void *out, void *request) {
    int at_root = lane->me == lane->root, bytes = (int)lane->nbytes, count = (int)lane->count;
    void *root_out = at_root ? out : NULL;
    switch (lane->collective) {
    case OF_ALL_GATHER:
        return request ? mpi_iallgather_bytes(source, out, bytes, lane->comm, request)
                       : mpi_allgather_bytes(source, out, bytes, lane->comm);
    case OF_ALL_TO_ALL:
        bytes = (int)(lane->nbytes / lane->size);
        return request ? mpi_ialltoall_bytes(source, out, bytes, lane->comm, request)
                       : mpi_alltoall_bytes(source, out, bytes, lane->comm);
    case OF_BROADCAST:
        return request ? mpi_ibcast_bytes(out, bytes, lane->root, lane->comm, request)
                       : mpi_bcast_bytes(out, bytes, lane->root, lane->comm);
    case OF_GATHER:
        return request ? mpi_igather_bytes(source, root_out, bytes, lane->root, lane->comm, request)
                       : mpi_gather_bytes(source, root_out, bytes, lane->root, lane->comm);
    case OF_REDUCE:
        return request ? mpi_ireduce(source, root_out, count, lane->datatype, lane->mpi_op, lane->root, lane->comm,
                                     request)
                       : mpi_reduce(source, root_out, count, lane->datatype, lane->mpi_op, lane->root, lane->comm);
    default:
        return request ? mpi_iallreduce(source, out, count, lane->datatype, lane->mpi_op, lane->comm, request)
                       : mpi_allreduce(source, out, count, lane->datatype, lane->mpi_op, lane->comm);
    }
}

/* Test `request` until it completes, pausing between tests once IDLE_SPIN_NS passed (idle.h).
 * Where ranks outnumber cores, MPI's own wait: its loop polls many times between yields, as its
 * blocking calls do, where a yield after each test made a held all-reduce of 16 ranks on 2 cores
 * slower. */
static int wait_idle(void *request, int oversubscribed) {
    if (oversubscribed) return mpi_wait(request);
    long long start = idle_now();
    int flag = 0;
    for (;;) {
        int code = mpi_test(request, &flag);
        if (code != 0 || flag) return code;
        if (idle_now() - start >= IDLE_SPIN_NS) idle_pause(&idle_state, 0);
    }
}

/* A contesting lane's all-reduce in one exchange, from `source` (NULL: in place) into `out`: each
 * rank sends its whole input and reduces rank 0's op rank 1's, so both get the same bits (a sum
 * of two NaNs keeps the first one's payload). As _transport/mpi/all_reduce.py `exchange_once`,
 * with which a peer on the Python path pairs; rank 0 receives into `out` where its input is
 * elsewhere. Through the group's shared pair where one is set up (`exchange_shared`), else a
 * blocking MPI_Sendrecv on every MPI (only Open MPI's waits take a core as contested). Call
 * without the GIL, the pair found or `lane->scratch` made (`check_at_once` agrees only then). */
static int exchange_shared(Lane *lane, const void *source, void *out);

static int exchange_once(Lane *lane, const void *source, void *out) {
    if (lane->pair != NULL) return exchange_shared(lane, source, out);
    const void *send = source != NULL ? source : out;
    int first = lane->me == 0, count = (int)lane->count;
    void *received = first && source != NULL ? out : lane->scratch;
    int code = mpi_sendrecv(send, received, count, lane->datatype, 1 - lane->me, consts.exchange_tag, lane->comm);
    if (code != 0) return code;
    if (!first) {
        if (source != NULL) memcpy(out, source, (size_t)lane->nbytes);
        return mpi_reduce_local(received, out, count, lane->datatype, lane->mpi_op);
    }
    code = mpi_reduce_local(send, received, count, lane->datatype, lane->mpi_op);
    if (code == 0 && received != out) memcpy(out, received, (size_t)lane->nbytes);
    return code;
}

/* `exchange_once` through the group's shared pair (both ranks on one node): each rank writes its
 * input into its slot and sleeps on a futex until the peer's is in the peer's (pair.h), then
 * reduces rank 0's op rank 1's, as _transport/mpi/pair.py `exchange_through_pair`, with which a
 * peer on the Python path pairs. Where the peer's process ended meanwhile, MPI's zero-byte
 * exchange with it reports the failure as MPI's own exchange would have. */
static int exchange_shared(Lane *lane, const void *source, void *out) {
    const PairApi *api = consts.pair;
    const void *send = source != NULL ? source : out, *peer = NULL;
    size_t nbytes = (size_t)lane->nbytes;
    if (api->post(lane->pair, send, nbytes) == 0) peer = api->await_peer(lane->pair);
    if (peer == NULL) {
        char none = 0;
        /* The tag after the exchange's: the pair's own (pair.py PAIR_TAG). */
        int code = mpi_sendrecv(&none, &none, 0, lane->datatype, 1 - lane->me, consts.exchange_tag + 1, lane->comm);
        return code != 0 ? code : mpi_error_other();
    }
    int code;
    if (lane->me == 0) {
        memcpy(out, peer, nbytes);
        code = mpi_reduce_local(api->own(lane->pair), out, (int)lane->count, lane->datatype, lane->mpi_op);
    } else {
        if (source != NULL) memcpy(out, source, nbytes);
        code = mpi_reduce_local(peer, out, (int)lane->count, lane->datatype, lane->mpi_op);
    }
    api->done(lane->pair);
    return code;
}

/* The HELD call's data from `source` (NULL: in place) into `out`; call without the GIL. MPI's
 * blocking call where its wait can be made to pause (`consts.arm_idle` around it: Open MPI),
 * else its nonblocking call waited by `wait_idle`: a rank that waits for a peer gives its core
 * back either way (see _core/idle.py). Every rank of a job takes the same one. */
static int held_mpi(Lane *lane, const void *source, void *out) {
    int at_root = lane->me == lane->root, code;
    if (lane->collective == OF_BROADCAST && at_root) memcpy(out, source, (size_t)lane->nbytes);
    if (consts.held_blocking || lane->once) {
        _Bool armed = consts.arm_idle != NULL ? consts.arm_idle(1) : 0;
        code = lane->once ? exchange_once(lane, source, out) : held_post(lane, source, out, NULL);
        lane->exchanged += lane->once;
        if (consts.arm_idle != NULL) consts.arm_idle(armed);
    } else {
        intptr_t request = 0; /* an MPI_Request: an int or a pointer */
        code = held_post(lane, source, out, &request);
        if (code == 0) code = wait_idle(&request, lane->spins < SPINS_WITH_A_CORE);
    }
    /* Off the root, a gather's and a reduce's result is the input (_collectives/held.py). */
    if (code == 0 && !at_root && (lane->collective == OF_GATHER || lane->collective == OF_REDUCE))
        memcpy(out, source, (size_t)lane->nbytes);
    return code;
}

/* A HELD call whose check agreed: MPI's blocking all-reduce (or the lane's other collective,
 * `held_mpi`) from the caller's input into its result buffer (in place where they are one),
 * the GIL released, then MEAN's division; the handle then shares the lane's done op. 1 done; 0 MPI failed, and
 * its error is the op's (resolve() raises it, as the engine's `_post_data` leaves it); -1 error. */
static int held_reduce(Lane *lane, Call *call) {
    void *out = PyArray_DATA((PyArrayObject *)call->out);
    const void *source = lane->into ? PyArray_DATA((PyArrayObject *)call->source) : NULL;
    int code;
    Py_BEGIN_ALLOW_THREADS
    code = held_mpi(lane, source, out);
    Py_END_ALLOW_THREADS
    if (code != 0) {
        mpi_failed(lane->engine, code, call->op, lane->name);
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        PyErr_NormalizeException(&type, &value, &traceback);
        field_set(&OP(call->op)->error, value);
        field_set(&OP(call->op)->state, consts.states[FAILED]);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(traceback);
        return 0;
    }
    if (lane->divide) divide_in_place(lane->type_num, out, lane->count, lane->size);
    field_set(&HANDLE(call->handle)->op, lane->done_op); /* nothing is left to do */
    return 1;
}

/* The call, once its objects are made: the handle, None (declined: nothing posted) or NULL. */
static PyObject *call_run(Lane *lane, Call *call) {
    PyObject *posted = NULL, *seq = NULL;
    int checked = lane->record != Py_None, agreed = 1, queued = 0;
    /* Held by this thread: a signal handler interrupted the engine; declined, and the Python
     * path refuses the call (Engine.reentered) before anything is posted. */
    int held = lock_held_here(lane->engine);
    if (held != 0) {
        if (held < 0) return NULL;
        Py_RETURN_NONE;
    }
    if (engine_lock(lane->engine) < 0) return NULL;
    posted = Py_XNewRef(ENGINE(lane->engine)->posted);
    int idle = posted == NULL ? -1 : group_idle(lane, checked);
    /* Beyond `reap_after` ops in flight the Python path reaps the oldest (and holds back). */
    if (idle > 0 && (!PyList_Check(posted) || PyList_GET_SIZE(posted) >= consts.reap_after)) idle = 0;
    int64_t called = lane->ring == NULL ? 0 : ring_api->now();
    /* A carried call gets its span only if it is queued: at once, its record is written whole. */
    if (idle > 0 && lane->kind == LANE_COPY && trace_begin(lane, call, called) < 0)
        idle = -1; /* out of memory: nothing is posted */
    if (idle > 0 && checked) {
        /* From the check's post to its op's place in the queue, no collection: a finalizer it
         * ran would be Python code, in which a signal handler could run. */
        int collecting = PyGC_Disable();
        agreed = check_at_once(lane, PyByteArray_AS_STRING(call->send), PyByteArray_AS_STRING(call->recv),
                               mpi_request_slot(call->check_request), &seq);
        if (agreed >= 0) field_set(&OP(call->op)->seq, seq);
        if (agreed > 0 && lane->kind == LANE_COPY) trace_mark(call->op, RING_AGREED);
        if (agreed == 0 && lane->kind == LANE_CHECK && trace_begin(lane, call, called) < 0)
            PyErr_Clear(); /* memory ran out: the call goes on, unrecorded (its check is posted) */
        if (agreed == 0) {
            queued = queue_op(lane, call->op, seq, call->send, call->recv, call->check_request, call->source,
                              call->out) < 0 ? -1 : 1;
            if (queued < 0) lost_check(lane);
            /* NULL (memory ran out): the lane's one exchanges keep going to the engine. */
            if (lane->once && lane->shared < 0 && lane->scratch == NULL)
                lane->scratch = PyMem_RawMalloc((size_t)lane->nbytes);
        }
        if (collecting) PyGC_Enable();
    }
    int done = idle;
    if (idle > 0 && agreed > 0 && lane->kind == LANE_HELD) {
        done = held_reduce(lane, call);
    } else if (idle > 0 && agreed > 0 && lane->kind == LANE_COPY) {
        done = post_data(lane, call, posted);
        if (done > 0) trace_posted(lane, call, called, 0);
    } else if (idle > 0 && agreed > 0) {
        trace_posted(lane, call, called, 1);
        if (lane->gathers)
            rows_reduce(lane->rows_kind, PyArray_DATA((PyArrayObject *)call->out), PyByteArray_AS_STRING(call->recv),
                        lane->size, consts.row_bytes, consts.header_bytes, lane->count);
        else /* the check's reduction reduced every payload */
            memcpy(PyArray_DATA((PyArrayObject *)call->out),
                   (const int64_t *)PyByteArray_AS_STRING(call->recv) + RECORD_PAYLOAD, (size_t)lane->nbytes);
        if (lane->divide)
            divide_in_place(lane->type_num, PyArray_DATA((PyArrayObject *)call->out), lane->count, lane->size);
        field_set(&HANDLE(call->handle)->op, lane->done_op); /* nothing is left to do */
    }
    engine_unlock(lane->engine);
    Py_XDECREF(posted);
    Py_XDECREF(seq);
    if (queued > 0) {
        /* Queued: the op is the engine's now, and the call waits for its check as any other. */
        PyObject *awaited = PyObject_CallFunctionObjArgs(ENGINE(lane->engine)->await_check, call->op, Py_True, NULL);
        Py_XDECREF(awaited);
        done = awaited == NULL ? -1 : 1;
    }
    if (idle < 0 || agreed < 0 || queued < 0 || done < 0) return NULL;
    if (idle == 0) Py_RETURN_NONE; /* something is queued or stepping: the Python lane goes behind it */
    return Py_NewRef(call->handle);
}

static PyObject *start(Lane *lane, PyObject *device, PyArrayObject *array, PyObject *held_out) {
    Call call;
    if (call_prepare(lane, &call, device, array, held_out) < 0) {
        call_clear(&call);
        PyErr_Clear(); /* nothing is posted: the general path takes the call and reports what failed */
        Py_RETURN_NONE;
    }
    PyObject *handle = call_run(lane, &call);
    call_clear(&call);
    return handle;
}

/* ---- the lane object ------------------------------------------------------------------------ */

PyObject *lane_start(PyObject *self, PyObject *tensor, PyObject *array) {
    Lane *lane = (Lane *)self;
    if (lane->kind == LANE_HELD) Py_RETURN_NONE; /* its calls come through start_held */
    int ok = usable_here(lane);
    if (ok <= 0) {
        if (ok < 0) return NULL;
        Py_RETURN_NONE;
    }
    PyObject *device = tensor == Py_None ? lane->device : TENSOR(tensor)->device;
    if (device == NULL) Py_RETURN_NONE;
    lane_cache_insert(self);
    return start(lane, device, (PyArrayObject *)array, NULL);
}

PyObject *lane_context(PyObject *self) { return ((Lane *)self)->ctx; }

/* Whether `array` is an exact, C-contiguous ndarray of the lane's dtype object and shape. */
static int of_lane(Lane *lane, PyObject *array) {
    if (!PyArray_CheckExact(array)) return 0;
    PyArrayObject *a = (PyArrayObject *)array;
    if (!PyArray_IS_C_CONTIGUOUS(a) || PyArray_DESCR(a) != lane->descr || PyArray_NDIM(a) != lane->ndim) return 0;
    for (int axis = 0; axis < lane->ndim; axis++)
        if (PyArray_DIMS(a)[axis] != lane->dims[axis]) return 0;
    return 1;
}

int lane_matches(PyObject *self, PyObject *ctx, PyArrayObject *array, PyObject *op) {
    Lane *lane = (Lane *)self;
    return lane->ctx == ctx && lane->op_key == op && of_lane(lane, (PyObject *)array);
}

PyDoc_STRVAR(Lane_start_doc,
"start(tensor, array)\n--\n\n"
"Start the all-reduce of `array` (the data of `tensor`, or of None for a bare array) on this lane.\n\n"
"`array` must be a C-contiguous ndarray of the lane's dtype and shape (the Python lane's\n"
"lookup found this lane for it). Returns the handle, or None when the call is declined\n"
"(the context unusable or used from another thread, the engine busy with the group, or a\n"
"step failing before anything was posted): the Python lane then takes the call.");

static PyObject *Lane_start(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Lane *lane = (Lane *)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "start(tensor, array) takes 2 arguments");
        return NULL;
    }
    PyObject *tensor = args[0], *array = args[1];
    if (lane->kind == LANE_HELD || !PyArray_CheckExact(array) || !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)array) ||
        PyArray_NBYTES((PyArrayObject *)array) != lane->nbytes ||
        PyArray_ITEMSIZE((PyArrayObject *)array) != PyDataType_ELSIZE(lane->descr) ||
        (tensor != Py_None && !Py_IS_TYPE(tensor, types.tensor_type))) {
        PyErr_SetString(PyExc_TypeError, "a lane starts calls of its own kind only");
        return NULL;
    }
    return lane_start(self, tensor, array);
}

static const char *lane_keywords[] = {
    "kind", "ctx", "group", "op_key", "template", "datatype", "mpi_op", "divide", "record", "value", "per_rank",
    "rows", "spins", "queued_post", "done_op", "trace", "keys", "into", "collective", "root", "comm", "check_comm",
    "device", "check_reduction", "code", NULL};

/* Where `queued_post` is (start, comm, plan); 0, or -1 with an error set. */
static int take_post(Lane *lane, PyObject *queued_post) {
    if (!PyTuple_CheckExact(queued_post) || PyTuple_GET_SIZE(queued_post) != 3) {
        PyErr_SetString(PyExc_TypeError, "queued_post is (start, comm, plan)");
        return -1;
    }
    lane->post_start = Py_NewRef(PyTuple_GET_ITEM(queued_post, 0));
    lane->post_comm = Py_NewRef(PyTuple_GET_ITEM(queued_post, 1));
    lane->post_plan = Py_NewRef(PyTuple_GET_ITEM(queued_post, 2));
    return 0;
}

/* Where `trace` is (ring, kind code, group key) of the context's compiled ring, or None; 0, or -1 with an error. */
static int take_trace(Lane *lane, PyObject *trace) {
    if (trace == Py_None) return 0;
    if (!PyTuple_CheckExact(trace) || PyTuple_GET_SIZE(trace) != 3) {
        PyErr_SetString(PyExc_TypeError, "trace is (ring, kind, group) or None");
        return -1;
    }
    if (ring_api_load() < 0) return -1;
    PyObject *ring = PyTuple_GET_ITEM(trace, 0);
    if (!Py_IS_TYPE(ring, ring_api->ring_type)) {
        PyErr_SetString(PyExc_TypeError, "a lane records in the compiled trace ring only");
        return -1;
    }
    long long kind = PyLong_AsLongLong(PyTuple_GET_ITEM(trace, 1));
    long long group = kind == -1 && PyErr_Occurred() ? -1 : PyLong_AsLongLong(PyTuple_GET_ITEM(trace, 2));
    if (PyErr_Occurred()) return -1;
    lane->trace_kind = (int32_t)kind;
    lane->trace_group = group;
    lane->ring = Py_NewRef(ring);
    return 0;
}

/* The lane's collective's name (its ops', as `Op` names them); 0, or -1 with an error set. */
static int lane_name(Lane *lane) {
    static const char *names_of[] = {"all_reduce", "broadcast", "all_gather", "all_to_all", "gather", "reduce"};
    lane->name = PyUnicode_InternFromString(names_of[lane->collective]);
    return lane->name == NULL ? -1 : 0;
}

static int Lane_init(PyObject *self, PyObject *args, PyObject *kwargs) {
    Lane *lane = (Lane *)self;
    PyObject *ctx, *group, *op_key, *template, *datatype, *mpi_op, *record, *queued_post, *done_op, *trace = Py_None;
    PyObject *comm, *check_comm, *device, *check_reduction = Py_None;
    int divide;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "$iOOOO!OOpOLLiiOOOipiiOOOOL", (char **)lane_keywords, &lane->kind,
                                     &ctx, &group, &op_key, &PyArray_Type, &template, &datatype, &mpi_op,
                                     &divide, &record, &lane->value, &lane->per_rank, &lane->rows_kind,
                                     &lane->spins, &queued_post, &done_op, &trace, &lane->keys, &lane->into,
                                     &lane->collective, &lane->root, &comm, &check_comm, &device, &check_reduction,
                                     &lane->code))
        return -1;
    if (lane->ctx != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a lane is made once");
        return -1;
    }
    if (take_trace(lane, trace) < 0) return -1;
    if (!consts.bound || (lane->kind != LANE_COPY && lane->kind != LANE_CHECK && lane->kind != LANE_HELD)) {
        PyErr_SetString(PyExc_RuntimeError, "the native module is not bound, or the lane's kind is unknown");
        return -1;
    }
    PyArrayObject *array = (PyArrayObject *)template;
    lane->ndim = PyArray_NDIM(array);
    /* A 0-d template has no dims (NumPy's pointer may be NULL, which memcpy may not take). */
    if (lane->ndim > 0) memcpy(lane->dims, PyArray_DIMS(array), sizeof(npy_intp) * (size_t)lane->ndim);
    lane->count = PyArray_SIZE(array);
    lane->nbytes = PyArray_NBYTES(array);
    lane->type_num = PyArray_TYPE(array);
    lane->divide = divide;
    if (lane->kind == LANE_CHECK && (lane->nbytes > consts.payload_bytes || lane->rows_kind < 0 || record == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "a carried lane has a record, at most the check's payload, and a loop");
        return -1;
    }
    if (lane->kind == LANE_HELD &&
        (record == Py_None || lane->keys != KEYS_NONE || lane->ring != NULL || lane->count > INT_MAX)) {
        PyErr_SetString(PyExc_ValueError, "a held lane is checked, has no MAX/MIN keys, does not trace, and fits an int count");
        return -1;
    }
    if (lane->collective != OF_ALL_REDUCE &&
        (lane->collective < 0 || lane->collective > OF_REDUCE || lane->kind != LANE_HELD || !lane->into ||
         divide || lane->nbytes > INT_MAX)) {
        PyErr_SetString(PyExc_ValueError, "a lane of another collective than the all-reduce is HELD, into another "
                                          "array, of at most 2**31 - 1 bytes, without MEAN");
        return -1;
    }
    if (lane->keys != KEYS_NONE && (lane->keys > KEYS_MIN || divide || !keys_supported(lane->type_num))) {
        PyErr_SetString(PyExc_ValueError, "MAX/MIN keys are compiled for float32 and float64 only, without MEAN");
        return -1;
    }
    if (divide && divide_in_place(lane->type_num, NULL, 0, 1) < 0) {
        PyErr_SetString(PyExc_ValueError, "MEAN's division is compiled for float32 and float64 only");
        return -1;
    }
    /* The context's record gives its engine and owner; the group's its size (through its communicator). */
    if (!PyObject_TypeCheck(ctx, types.context_record) || !PyObject_TypeCheck(group, types.group_record) ||
        CONTEXT(ctx)->engine == NULL || !PyObject_TypeCheck(CONTEXT(ctx)->engine, types.engine_record) ||
        CONTEXT(ctx)->owner_thread == NULL || GROUP(group)->queue == NULL) {
        PyErr_SetString(PyExc_TypeError, "a lane's ctx is a set-up DistributedContext and its group a Group");
        return -1;
    }
    PyObject *engine = CONTEXT(ctx)->engine;
    int ok = 1;
    if (ok) ok = (lane->comm = mpi_comm_of(comm)) != -1 || !PyErr_Occurred();
    if (ok) ok = (lane->check_comm = mpi_comm_of(check_comm)) != -1 || !PyErr_Occurred();
    if (ok) ok = (lane->datatype = mpi_datatype_of(datatype)) != -1 || !PyErr_Occurred();
    if (ok) ok = (lane->mpi_op = mpi_op_of(mpi_op)) != -1 || !PyErr_Occurred();
    if (ok) ok = (lane->owner = PyLong_AsUnsignedLong(CONTEXT(ctx)->owner_thread)) != (unsigned long)-1 ||
                 !PyErr_Occurred();
    if (ok) ok = mpi_comm_size(lane->comm, &lane->size) == 0;
    lane->gathers = lane->size <= consts.gathered_ranks;
    lane->contests = lane->kind == LANE_HELD && lane->collective == OF_ALL_REDUCE && lane->size == 2;
    /* A large group's check: the (datatype, op) of its records (_transport/reduced_check.py). */
    if (ok && !lane->gathers && record != Py_None) {
        ok = PyTuple_CheckExact(check_reduction) && PyTuple_GET_SIZE(check_reduction) == 2 && consts.check_words > 0;
        if (!ok) PyErr_SetString(PyExc_TypeError, "a large group's checked lane takes check_reduction=(datatype, op)");
        if (ok) ok = (lane->check_datatype = mpi_datatype_of(PyTuple_GET_ITEM(check_reduction, 0))) != -1 ||
                     !PyErr_Occurred();
        if (ok) ok = (lane->check_op = mpi_op_of(PyTuple_GET_ITEM(check_reduction, 1))) != -1 || !PyErr_Occurred();
    }
    if (ok) ok = lane_name(lane) == 0;
    if (ok) ok = take_post(lane, queued_post) == 0;
    if (ok) ok = (lane->nbytes_obj = PyLong_FromSsize_t((Py_ssize_t)lane->nbytes)) != NULL;
    /* A carried call reduces at least two; a held call's check gathers rows; a large group's carried call a code. */
    if (ok && record != Py_None && (lane->size < 2 || (lane->kind == LANE_HELD && !lane->gathers) ||
                                    (lane->kind == LANE_CHECK && !lane->gathers && lane->code <= 0))) {
        PyErr_SetString(PyExc_ValueError, "a checked lane needs 2 ranks or more (a held one a group whose checks gather "
                                          "rows, a carried one in a large group its payload's code)");
        ok = 0;
    }
    int rooted = lane->collective == OF_BROADCAST || lane->collective == OF_GATHER || lane->collective == OF_REDUCE;
    if (ok && rooted && (lane->root < 0 || lane->root >= lane->size)) {
        PyErr_SetString(PyExc_ValueError, "a rooted call's lane has a root in its group");
        ok = 0;
    }
    if (ok && lane->collective == OF_ALL_TO_ALL && lane->nbytes % lane->size != 0) {
        PyErr_SetString(PyExc_ValueError, "an all-to-all's lane has an input of one equal block per rank");
        ok = 0;
    }
    if (ok && mpi_comm_rank(lane->comm, &lane->me) != 0) {
        PyErr_SetString(PyExc_RuntimeError, "MPI_Comm_rank failed on a lane's communicator");
        ok = 0;
    }
    if (!ok) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "MPI failed on a lane's communicator");
        return -1;
    }
    lane->engine = Py_NewRef(engine);
    lane->device = Py_NewRef(device);
    lane->ctx = Py_NewRef(ctx);
    lane->group = Py_NewRef(group);
    lane->op_key = Py_NewRef(op_key);
    lane->record = Py_NewRef(record);
    lane->done_op = Py_NewRef(done_op);
    lane->descr = (PyArray_Descr *)Py_NewRef((PyObject *)PyArray_DESCR(array));
    return 0;
}

static int Lane_traverse(PyObject *self, visitproc visit, void *arg) {
    Lane *lane = (Lane *)self;
    Py_VISIT(lane->ctx);
    Py_VISIT(lane->engine);
    Py_VISIT(lane->group);
    Py_VISIT(lane->op_key);
    Py_VISIT(lane->device);
    Py_VISIT(lane->record);
    Py_VISIT(lane->post_start);
    Py_VISIT(lane->post_comm);
    Py_VISIT(lane->post_plan);
    Py_VISIT(lane->done_op);
    Py_VISIT(lane->request);
    Py_VISIT(lane->ring);
    return 0;
}

static int Lane_clear(PyObject *self) {
    Lane *lane = (Lane *)self;
    Py_CLEAR(lane->ctx);
    Py_CLEAR(lane->engine);
    Py_CLEAR(lane->group);
    Py_CLEAR(lane->op_key);
    Py_CLEAR(lane->device);
    Py_CLEAR(lane->record);
    Py_CLEAR(lane->post_start);
    Py_CLEAR(lane->post_comm);
    Py_CLEAR(lane->post_plan);
    Py_CLEAR(lane->done_op);
    Py_CLEAR(lane->nbytes_obj);
    Py_CLEAR(lane->descr);
    Py_CLEAR(lane->send);
    Py_CLEAR(lane->recv);
    Py_CLEAR(lane->request);
    Py_CLEAR(lane->ring);
    Py_CLEAR(lane->name);
    return 0;
}

static void Lane_dealloc(PyObject *self) {
    PyObject_GC_UnTrack(self);
    Lane_clear(self);
    PyMem_RawFree(((Lane *)self)->scratch);
    Py_TYPE(self)->tp_free(self);
}

/* Whether two C-contiguous arrays share memory (MPI takes no overlapping send and receive
 * buffers; `all_reduce_held` then says what is wrong). */
static int overlap(PyObject *a, PyObject *b) {
    char *x = PyArray_BYTES((PyArrayObject *)a), *y = PyArray_BYTES((PyArrayObject *)b);
    npy_intp x_bytes = PyArray_NBYTES((PyArrayObject *)a), y_bytes = PyArray_NBYTES((PyArrayObject *)b);
    return x_bytes > 0 && y_bytes > 0 && x < y + y_bytes && y < x + x_bytes;
}

/* Whether `out` is a result buffer of this lane's calls: of its dtype and shape, or for an
 * all-gather (a gather, at the root) an exact C-contiguous ndarray of its dtype holding every
 * rank's input. */
static int out_of_lane(Lane *lane, PyObject *out) {
    if (lane->collective != OF_ALL_GATHER && (lane->collective != OF_GATHER || lane->me != lane->root))
        return of_lane(lane, out);
    if (!PyArray_CheckExact(out)) return 0;
    PyArrayObject *a = (PyArrayObject *)out;
    return PyArray_IS_C_CONTIGUOUS(a) && PyArray_DESCR(a) == lane->descr &&
           PyArray_NBYTES(a) == lane->nbytes * lane->size;
}

PyDoc_STRVAR(Lane_start_held_doc,
"start_held(array, out)\n--\n\n"
"Start the held all-reduce of `array` into `out` (`array` itself for a lane in place) on this\n"
"HELD lane. Both C-contiguous ndarrays of the lane's dtype and shape, `out` writable, and\n"
"`all_reduce_held`'s promise kept: nobody writes `array` or reads `out` until it is resolved.\n"
"Returns the handle, or None when the call is declined (another thread, the context\n"
"unusable, the engine busy with the group, arrays not of the lane or overlapping): the Python path\n"
"then takes the call.");

static PyObject *Lane_start_held(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Lane *lane = (Lane *)self;
    if (lane->kind != LANE_HELD || nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "start_held(array, out) is a HELD lane's, with 2 arguments");
        return NULL;
    }
    PyObject *array = args[0], *out = args[1];
    if (!of_lane(lane, array) || !out_of_lane(lane, out) || (out == array) == lane->into ||
        !PyArray_ISWRITEABLE((PyArrayObject *)out) || (lane->into && overlap(array, out)))
        Py_RETURN_NONE;
    int ok = usable_here(lane);
    if (ok <= 0) {
        if (ok < 0) return NULL;
        Py_RETURN_NONE;
    }
    return start(lane, lane->device, (PyArrayObject *)array, out);
}

PyDoc_STRVAR(Lane_start_into_doc,
"start_into(array, out)\n--\n\n"
"Start the all-reduce of `array` on this COPY or CHECK lane with its result in `out` (`array`\n"
"itself: in place), for a caller that holds both until the result is resolved (a held call MPI\n"
"reduces as an ordinary one: small, in place or into a buffer). A COPY call copies the input\n"
"into `out` (unless it is the input) and MPI reduces it there in place; a CHECK call reduces\n"
"the carried rows into `out`. Both C-contiguous ndarrays of the lane's dtype and shape, `out`\n"
"writable and not overlapping `array` unless it is `array`. Returns the handle, or None when\n"
"the call is declined (buffers not of the lane, another thread, the context unusable, the engine\n"
"busy with the group): the Python path then takes the call.");

static PyObject *Lane_start_into(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Lane *lane = (Lane *)self;
    if (lane->kind == LANE_HELD || nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "start_into(array, out) is a COPY or CHECK lane's, with 2 arguments");
        return NULL;
    }
    PyObject *array = args[0], *out = args[1];
    if (!of_lane(lane, array) || !of_lane(lane, out) || !PyArray_ISWRITEABLE((PyArrayObject *)out) ||
        (out != array && overlap(array, out)))
        Py_RETURN_NONE;
    int ok = usable_here(lane);
    if (ok <= 0) {
        if (ok < 0) return NULL;
        Py_RETURN_NONE;
    }
    return start(lane, lane->device, (PyArrayObject *)array, out);
}

int lane_held_in_place(PyObject *self) {
    if (!Py_IS_TYPE(self, &LaneType)) return 0;
    Lane *lane = (Lane *)self;
    return lane->collective == OF_ALL_REDUCE && (lane->kind != LANE_HELD || !lane->into);
}

PyObject *lane_start_in_place(PyObject *self, PyObject *array) {
    PyObject *args[2] = {array, array};
    return ((Lane *)self)->kind == LANE_HELD ? Lane_start_held(self, args, 2) : Lane_start_into(self, args, 2);
}

PyDoc_STRVAR(Lane_run_held_doc,
"run_held(array, out)\n--\n\n"
"`start_held(array, out)` waiting at the call (`wait_at_call`), then the result resolved: for\n"
"a caller that needs the result at once (a collective inside a compiled program, called by\n"
"its handler with no Python around it). True once `out` (or `array`, in place) holds the\n"
"result; None where `start_held` declines the call (nothing was posted).\n\n"
"Raises:\n    What `start_held` and the handle's resolve raise.");

/* The handle's compiled resolve(), the handle's reference taken: its result, or NULL with the error set. */
static PyObject *resolved(PyObject *handle) {
    PyObject *result = handle_resolve(handle);
    Py_DECREF(handle);
    return result;
}

static PyObject *Lane_run_held(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int previous = waiting_at_call;
    waiting_at_call = 1;
    PyObject *handle = Lane_start_held(self, args, nargs);
    waiting_at_call = previous;
    if (handle == NULL || handle == Py_None) return handle;
    PyObject *result = resolved(handle);
    if (result == NULL) return NULL;
    Py_DECREF(result);
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(Lane_run_into_doc,
"run_into(array, out)\n--\n\n"
"`start_into(array, out)` waiting at the call (`wait_at_call`), then the result resolved (in\n"
"`out`, writable, not overlapping `array` unless it is `array`; both C-contiguous ndarrays of the\n"
"lane's dtype and shape): for a caller that needs the result at once in a buffer of its own\n"
"(a collective inside a compiled program, called by its handler with no Python around it).\n"
"True once `out` holds the result; None where the lane declines the call (nothing was posted).\n\n"
"Raises:\n    What the call and the handle's resolve raise.");

static PyObject *Lane_run_into(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Lane *lane = (Lane *)self;
    if (lane->kind == LANE_HELD || nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "run_into(array, out) is a COPY or CHECK lane's, with 2 arguments");
        return NULL;
    }
    int previous = waiting_at_call;
    waiting_at_call = 1;
    PyObject *handle = Lane_start_into(self, args, nargs);
    waiting_at_call = previous;
    if (handle == NULL || handle == Py_None) return handle;
    PyObject *result = resolved(handle);
    if (result == NULL) return NULL;
    Py_DECREF(result);
    Py_RETURN_TRUE;
}

static PyMethodDef Lane_methods[] = {
    {"start", (PyCFunction)(void (*)(void))Lane_start, METH_FASTCALL, Lane_start_doc},
    {"start_held", (PyCFunction)(void (*)(void))Lane_start_held, METH_FASTCALL, Lane_start_held_doc},
    {"run_held", (PyCFunction)(void (*)(void))Lane_run_held, METH_FASTCALL, Lane_run_held_doc},
    {"run_into", (PyCFunction)(void (*)(void))Lane_run_into, METH_FASTCALL, Lane_run_into_doc},
    {"start_into", (PyCFunction)(void (*)(void))Lane_start_into, METH_FASTCALL, Lane_start_into_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(Lane_doc,
"Lane(*, kind, ctx, group, op_key, template, datatype, mpi_op, divide, record, value, per_rank, rows,\n"
"     spins, queued_post, done_op, trace, keys, into, collective, root)\n--\n\n"
"The compiled lane of one kind of all-reduce (see native/__init__.py's `compiled_lane`), or of\n"
"a held broadcast, all-gather, all-to-all, gather or reduce (`compiled_held_data_lane`).\n\n"
"kind: COPY (MPI in place on a copy, after the check where there is a record), CHECK (the\n"
"input carried in the check) or HELD (`start_held`: MPI's blocking all-reduce from the caller's\n"
"input into its buffer, `into`, or in place, once the check agreed). template: an array of the kind's dtype and shape. datatype,\n"
"mpi_op: the plan's MPI handles. divide: MEAN's division at the end. record, value, per_rank:\n"
"the check's record (None: no check), agreement hash and per-rank value. rows: the loop that\n"
"reduces carried rows (`rows_kind`). spins: tests of a check before it is queued.\n"
"queued_post: (start, comm, plan), the op's post when its check is queued being\n"
"partial(start, comm, out, [payload,] plan) (`reduce_carried` or `in_place`), or for HELD\n"
"partial(start, comm, input, out, plan) (`held_all_reduce`, or the other collectives'\n"
"`_transport.mpi.held` function, `plan` then their root or (root, plan)). done_op: the completed op\n"
"that carried calls completed at the call share. trace: (ring, kind code, group key) where the\n"
"context traces (each call is recorded in that compiled ring), else None. collective:\n"
"ALL_REDUCE, or for a HELD lane into another array MPI's blocking call of it: BROADCAST,\n"
"ALL_GATHER (into a result buffer of every rank's input), ALL_TO_ALL, GATHER (every rank's\n"
"input at the root, the input elsewhere) of the input's bytes, or REDUCE (`datatype` and\n"
"`mpi_op`, the result at the root, the input elsewhere). root: a rooted call's root, its\n"
"index in the group; -1 otherwise.");

static PyMemberDef Lane_members[] = {
    {"exchanged", T_LONGLONG, offsetof(Lane, exchanged), READONLY,
     "The calls whose data this lane moved in one exchange (a held all-reduce of 2 ranks, a core contested)."},
    {NULL, 0, 0, 0, NULL},
};

PyTypeObject LaneType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpitensor._collectives.native._lanes.Lane",
    .tp_basicsize = sizeof(Lane),
    .tp_dealloc = Lane_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = Lane_doc,
    .tp_traverse = Lane_traverse,
    .tp_clear = Lane_clear,
    .tp_methods = Lane_methods,
    .tp_members = Lane_members,
    .tp_init = Lane_init,
    .tp_new = PyType_GenericNew,
};
