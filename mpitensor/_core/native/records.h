/* The records of mpitensor's runtime objects that compiled code reads and writes.
 *
 * A collective's objects (its `Op`, its result `Tensor`, its handle, the group's sequence of
 * checks, the engine's in-flight state, the context's state) are Python objects whose classes
 * derive from these record types (`mpitensor._core._records`, `_core/records.py`): the fields
 * below are their only state that compiled code touches, at the offsets this header gives, in
 * structs their own module defines. The Python classes add methods (and fields no compiled
 * code reads); their code reads and writes the same fields by name, through the records' member
 * descriptors. Without a C compiler the records are Python classes with the same names.
 *
 * The engine's record also holds the engine's interface for compiled code: its lock's methods
 * and the engine's own functions that compiled code calls where a call leaves the plan (a check
 * that did not agree at once, MPI's error, a check posted but lost).
 *
 * Every field holds a reference (never NULL once its object is set up by its class).
 */
#ifndef MPITENSOR_RECORDS_H
#define MPITENSOR_RECORDS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Tensor: `_array` (a NumPy or CuPy array), `_device`. */
typedef struct {
    PyObject_HEAD
    PyObject *array, *device;
} TensorRecord;

/* CollectiveTensor: `_op` (its OpRecord), `_value` (the result, or a Later), `_ctx` (a
 * ContextRecord), `_resolved` (a bool). */
typedef struct {
    PyObject_HEAD
    PyObject *op, *value, *ctx, *resolved;
} HandleRecord;

/* Op: what the engine holds of one collective (see `_runtime/engine.py`'s Op). */
typedef struct {
    PyObject_HEAD
    PyObject *name, *group, *nbytes, *post, *finish, *record, *keep, *protections, *exchange, *compare, *payload,
        *requests, *stepper, *state, *result, *error, *check_req, *check_send, *check_recv, *check_stage, *seq,
        *gathered, *check_sizes, *trace;
} OpRecord;

/* Group: its queue of ops (a deque), the op holding it (or None), the checks posted (an int). */
typedef struct {
    PyObject_HEAD
    PyObject *queue, *holder, *check_seq;
} GroupRecord;

/* Engine: its ops in flight (a list), the groups whose queues wait (a set), stepped ops and
 * checks posted (ints), spin_pauses (an int); its lock (an RLock) and that lock's acquire,
 * release and _is_owned; and the engine's functions compiled code calls: `await_check(op,
 * spun)` (Engine.await_queued_check), `mpi_failed(exception, op, what)` (Engine.mpi_failed),
 * `mark_broken(why)` (the context's). */
typedef struct {
    PyObject_HEAD
    PyObject *posted, *waiting_groups, *stepping, *checks_posted, *spin_pauses, *lock, *lock_acquire, *lock_release,
        *lock_owned, *await_check, *mpi_failed, *mark_broken;
} EngineRecord;

/* DistributedContext: `engine` (its EngineRecord), `usable` and `closed` (bools),
 * `owner_thread` (the thread id, an int), `timeout` (a float or None). */
typedef struct {
    PyObject_HEAD
    PyObject *engine, *usable, *closed, *owner_thread, *timeout;
} ContextRecord;

#define RECORD(type, object) ((type *)(object))

#endif
