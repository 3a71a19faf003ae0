/* The compiled lane of repeated small all-reduces: declarations shared by its files.
 *
 * The module is bound once, after MPI is initialized (`bind` in module.c): it finds MPI's
 * functions in the library mpi4py loaded (abi.c), takes the classes whose objects it builds
 * (derived from the records of `records.h`, whose fields are all it reads and writes of the
 * runtime's objects), and keeps the constants it needs. Until then every call takes the
 * Python path.
 */
#ifndef MPITENSOR_NATIVE_H
#define MPITENSOR_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* The lane relies on the GIL to keep its calls apart from other threads' Python code (the
 * engine's lock guards the rest): a build without it gets the Python lanes. */
#ifdef Py_GIL_DISABLED
#error "the compiled lane needs an interpreter with the GIL"
#endif

#define NPY_NO_DEPRECATED_API NPY_1_23_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL mpitensor_native_ARRAY_API
#ifndef MPITENSOR_NATIVE_MODULE
#define NO_IMPORT_ARRAY
#endif
#include <numpy/arrayobject.h>

/* ---- MPI, whatever its ABI (abi.c) ------------------------------------------------------
 * Handles are held as intptr_t: a pointer (Open MPI, the MPI 5 ABI) or an int (MPICH and
 * its derivatives), which `mpi_pointer_handles` tells; each call casts them back. Requests
 * live inside mpi4py Request objects, so the Python engine can test and wait on them too.
 */
typedef intptr_t mpi_handle;

int mpi_bind(PyObject *mpi4py_module, int pointer_handles, char *why, size_t why_size);
mpi_handle mpi_comm_of(PyObject *comm);      /* -1 with an exception set if not a Comm */
mpi_handle mpi_datatype_of(PyObject *datatype);
mpi_handle mpi_op_of(PyObject *op);
PyObject *mpi_new_request(void);              /* a null mpi4py Request */
void *mpi_request_slot(PyObject *request);    /* the MPI_Request inside it */
int mpi_iallreduce_in_place(void *buffer, int count, mpi_handle datatype, mpi_handle op, mpi_handle comm,
                            void *request);
int mpi_iallgather_bytes(const void *send, void *recv, int count, mpi_handle comm, void *request);
/* Blocking MPI_Allreduce from `send` (NULL: MPI_IN_PLACE) into `recv`; call without the GIL. */
int mpi_allreduce(const void *send, void *recv, int count, mpi_handle datatype, mpi_handle op, mpi_handle comm);
/* Blocking MPI_Allgather, MPI_Bcast, MPI_Alltoall and MPI_Gather of `count` bytes per rank,
 * and MPI_Reduce (`recv` NULL off the root); call without the GIL. */
int mpi_allgather_bytes(const void *send, void *recv, int count, mpi_handle comm);
int mpi_bcast_bytes(void *buffer, int count, int root, mpi_handle comm);
int mpi_alltoall_bytes(const void *send, void *recv, int count, mpi_handle comm);
int mpi_gather_bytes(const void *send, void *recv, int count, int root, mpi_handle comm);
int mpi_reduce(const void *send, void *recv, int count, mpi_handle datatype, mpi_handle op, int root, mpi_handle comm);
/* Their nonblocking forms, for MPIs whose blocking calls cannot be made to pause (`held_mpi`). */
int mpi_ibcast_bytes(void *buffer, int count, int root, mpi_handle comm, void *request);
int mpi_ialltoall_bytes(const void *send, void *recv, int count, mpi_handle comm, void *request);
int mpi_igather_bytes(const void *send, void *recv, int count, int root, mpi_handle comm, void *request);
int mpi_ireduce(const void *send, void *recv, int count, mpi_handle datatype, mpi_handle op, int root,
                mpi_handle comm, void *request);
/* Blocking MPI_Sendrecv of `count` elements with rank `peer` (sent and received under `tag`),
 * and MPI_Reduce_local (inout = in op inout); call without the GIL. */
/* MPI_ERR_OTHER: an error where MPI reported none. */
int mpi_error_other(void);
int mpi_sendrecv(const void *send, void *recv, int count, mpi_handle datatype, int peer, int tag, mpi_handle comm);
int mpi_reduce_local(const void *in, void *inout, int count, mpi_handle datatype, mpi_handle op);
int mpi_comm_rank(mpi_handle comm, int *rank);
/* Nonblocking all-reduce of `count` elements from `send` (NULL: MPI_IN_PLACE) into `recv` (a
 * large group's check; a held call's data where MPI's blocking calls cannot be made to pause). */
int mpi_iallreduce(const void *send, void *recv, int count, mpi_handle datatype, mpi_handle op, mpi_handle comm,
                   void *request);
/* A new commutative MPI op of user function `function`, as an mpi4py Op; NULL with an error set. */
PyObject *mpi_new_op(void (*function)(void *, void *, int *, void *), int commute);
int mpi_comm_size(mpi_handle comm, int *size);
int mpi_test(void *request, int *flag);
int mpi_wait(void *request);
/* Set the error the engine's `mpi_failed(MPI.Exception(code), op, name)` makes of MPI's error
 * `code` (it breaks the context; its message names `op`, or the call `name` where op is None). */
void mpi_failed(PyObject *engine, int code, PyObject *op, PyObject *name);

/* ---- the runtime's objects (records.h) --------------------------------------------------
 * Ops, tensors, handles, groups, the engine and the context are Python objects whose classes
 * derive from the record types of `mpitensor._core._records`: compiled code reads and writes
 * their fields in those records' structs, never by attribute name. The classes of the objects
 * the lane makes are given at bind time (checked to derive from their records). */
#include "pair.h"
#include "records.h"

typedef struct {
    PyTypeObject *op_type, *tensor_type, *handle_type; /* Op, Tensor and LaneTensor: made by the lane */
    PyTypeObject *op_record;                           /* OpRecord: what a handle's op must be */
    PyTypeObject *context_record, *engine_record;      /* what a handle's context and a context's engine must be */
    PyTypeObject *group_record;                        /* what a lane's group must be */
} Types;

extern Types types;
int types_bind(PyObject *op_class, PyObject *tensor_class, PyObject *handle_class);

#define OP(object) RECORD(OpRecord, object)
#define TENSOR(object) RECORD(TensorRecord, object)
#define HANDLE(object) RECORD(HandleRecord, object)
#define GROUP(object) RECORD(GroupRecord, object)
#define ENGINE(object) RECORD(EngineRecord, object)
#define CONTEXT(object) RECORD(ContextRecord, object)

/* Store `value` (a new reference is taken) in a record's field, dropping what it held. */
static inline void field_set(PyObject **field, PyObject *value) {
    PyObject *old = *field;
    Py_XINCREF(value);
    *field = value;
    Py_XDECREF(old);
}

/* Store `value`, stealing the reference; 0, or -1 if `value` is NULL (an error is set). */
static inline int field_steal(PyObject **field, PyObject *value) {
    if (value == NULL) return -1;
    PyObject *old = *field;
    *field = value;
    Py_XDECREF(old);
    return 0;
}

/* The trace ring's functions (ring_api.h), once a lane of a traced context was made; NULL before. */
#include "ring_api.h"
extern const RingApi *ring_api;
int ring_api_load(void);
/* Record moment `field` of `op` where it is traced (its `trace` field holds a span). */
static inline void trace_mark(PyObject *op, int field) {
    PyObject *span = OP(op)->trace;
    if (span != NULL && span != Py_None && ring_api != NULL) ring_api->mark(span, field);
}

/* ---- constants the Python side gives at bind time (module.c) --------------------------- */
typedef _Bool (*idle_switch)(_Bool);
typedef int (*idle_probe)(void);
typedef struct {
    PyObject *open_contexts;        /* _core.state.open_contexts, the stack of contexts */
    PyObject *states[5];            /* the engine's op states as ints: CHECKING .. FAILED */
    PyObject *empty_tuple, *one;
    PyObject *later_type;           /* common.Later: a value settled by the Python resolve */
    PyObject *settle;               /* Later.settle(later, result), the function */
    PyObject *base_resolve;         /* CollectiveTensor.resolve, the general path */
    PyObject *take_quickly;         /* interop.take_quickly: a foreign input's array and converter */
    PyObject *small_bytes;          /* the largest foreign input it views (an int) */
    PyObject *convert_type;         /* common.Convert: a result given back in the input's kind */
    PyObject *partial;              /* functools.partial: a queued op's post */
    int agree_stage;                /* the check's first stage (engine._AGREE) */
    int header_bytes, payload_bytes, row_bytes;
    int reap_after;                 /* posted ops beyond which the Python path reaps */
    int gathered_ranks;             /* the largest group whose checks gather rows */
    int check_words;                /* the int64 words of a large group's check record (check.c) */
    int spin_pauses;                /* Engine.spin_pauses where each rank has a core */
    idle_switch arm_idle;           /* set around a blocking call (_core/idle.py open_mpi_arm), or NULL */
    int held_blocking;              /* held calls move their data in MPI's blocking calls (idle.blocking_waits) */
    idle_probe contested;           /* whether the core is contested now (_core/idle.py contested), or NULL */
    int exchange_tag;               /* the tag of a contesting held lane's one exchange (EXCHANGE_TAG) */
    const PairApi *pair;            /* the shared pairs that exchange moves through on one node (pair.h), or NULL */
    int bound;
} Constants;

extern Constants consts;

enum { CHECKING = 0, QUEUED = 1, POSTED = 2, COMPLETE = 3, FAILED = 4 };

/* ---- local reductions of carried rows (rows.c) ----------------------------------------- */
/* The loop reducing `count` elements of type `type_num` with op `op_code` (a ReduceOperation
 * value), or -1 if this module has none (the Python lane then takes such calls). */
int rows_kind(int type_num, int op_code);
/* Whether loop `kind` combines two buffers as they are (not MAX/MIN of floats, which go through keys). */
int rows_pairwise(int kind);
/* out = a op b, element by element, for `count` elements of loop `kind` (`rows_pairwise`); out may be a or b. */
void rows_combine(int kind, void *out, const void *a, const void *b, Py_ssize_t count);
/* out = row[0] op row[1] op ... op row[size-1], element by element, in rank order (size >= 2). */
void rows_reduce(int kind, void *out, const char *rows, int size, int row_bytes, int header_bytes,
                 Py_ssize_t count);
/* OrderedKeys of float32/float64 (keys.c): whether `type_num` has them; the keys of `count`
 * floats of `src` into `dst` (which may be `src`), NaNs the canonical NaN's key for MAX
 * (`maximum`) or MIN; keys back into floats in place; the rows' MAX/MIN through keys. The
 * first two return 0, or -1 for a type without keys. */
int keys_supported(int type_num);
int keys_encode(int type_num, int maximum, const void *src, void *dst, Py_ssize_t count);
int keys_decode(int type_num, void *data, Py_ssize_t count);
void keys_rows_reduce(int type_num, int maximum, void *out, const char *rows, int size, int row_bytes, int header,
                      Py_ssize_t count);
/* MEAN's division, in place, as NumPy's true_divide by an int does; 0, or -1 if the dtype has none here. */
int divide_in_place(int type_num, void *data, Py_ssize_t count, int size);

/* ---- the lane (lane.c), its handle (handle.c), the entry (entry.c) --------------------- */
extern PyTypeObject LaneType;
extern PyTypeObject DivideType;
extern PyTypeObject DecodeType;
extern PyTypeObject EntryType;
PyObject *lane_start(PyObject *lane, PyObject *tensor, PyObject *array);
int lane_matches(PyObject *lane, PyObject *ctx, PyArrayObject *array, PyObject *op);
PyObject *lane_context(PyObject *lane); /* borrowed */
/* Whether `lane` is an all-reduce lane that can reduce an array in place (`lane_start_in_place`). */
int lane_held_in_place(PyObject *lane);
/* A held all-reduce of `array` in place on `lane`: a new handle, NULL with an error, or None (declined). */
PyObject *lane_start_in_place(PyObject *lane, PyObject *array);
extern const char keep_held_doc[];
PyObject *keep_held(PyObject *module, PyObject *lane);
void lane_cache_insert(PyObject *lane);
PyObject *lane_cache_find(PyObject *ctx, PyArrayObject *array, PyObject *op);
PyObject *lane_cache_forget(PyObject *module, PyObject *ctx);
extern const char find_lane_doc[];
extern const char check_op_doc[];
PyObject *check_op(PyObject *module, PyObject *words);
PyObject *find_lane(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
extern const char forget_doc[];
PyObject *set_before_call(PyObject *module, PyObject *function);
PyObject *wait_at_call(PyObject *module, PyObject *flag);
extern const char wait_at_call_doc[];
extern const char set_before_call_doc[];
extern PyMethodDef handle_resolve_def;
PyObject *handle_resolve(PyObject *handle); /* the compiled resolve() of a lane's handle, no timeout */
PyObject *make_tensor(PyObject *array, PyObject *device);

/* ---- a fused all-reduce's leaves (leaves.c) ---------------------------------------------- */
PyObject *plain_leaves(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *pack_leaves(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *unpack_leaves(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
extern const char plain_leaves_doc[], pack_doc[], unpack_doc[];

/* Take and let go the engine's lock (its record's `lock_acquire` and `lock_release`, an RLock's).
 * `engine_unlock` keeps an exception already set: the error paths release the lock with their
 * error pending, and a Python call made with an exception set would lose it (SystemError:
 * "returned NULL without setting an exception"). */
int engine_lock(PyObject *engine);
/* Whether this thread holds the engine's lock (handle.c); 1, 0, or -1 on error. */
int lock_held_here(PyObject *engine);
void engine_unlock(PyObject *engine);

/* An exception taken out of the interpreter while Python code runs, then put back. Every C
 * path that calls into Python with an error already set goes through these. */
#if PY_VERSION_HEX >= 0x030C0000
typedef struct {
    PyObject *raised;
} Pending;
static inline Pending pending_take(void) { return (Pending){PyErr_GetRaisedException()}; }
static inline void pending_restore(Pending pending) {
    if (pending.raised != NULL) PyErr_SetRaisedException(pending.raised);
}
#else
typedef struct {
    PyObject *type, *value, *traceback;
} Pending;
static inline Pending pending_take(void) {
    Pending pending;
    PyErr_Fetch(&pending.type, &pending.value, &pending.traceback);
    return pending;
}
static inline void pending_restore(Pending pending) {
    if (pending.type != NULL) PyErr_Restore(pending.type, pending.value, pending.traceback);
}
#endif

#endif
