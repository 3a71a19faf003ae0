/* MPI's functions, found in the library mpi4py loaded, called with either kind of handle.
 *
 * mpitensor has no MPI headers at build time: MPI implementations disagree on what a
 * handle is (an int in MPICH and its derivatives, a pointer in Open MPI and the MPI 5
 * ABI), on MPI_IN_PLACE and on MPI_Status. So the functions are looked up by name in the
 * loaded library, handles are read out of mpi4py's objects through mpi4py's own C API
 * (whose capsules give pointers to the handles), and every call is cast to the signature
 * of the ABI at hand. Statuses go to a buffer larger than any implementation's.
 */
#define _GNU_SOURCE
#include "native.h"

#include <dlfcn.h>
#include <link.h>
#include <stdio.h>
#include <string.h>

typedef int (*iallreduce_ptr)(const void *, void *, int, void *, void *, void *, void *);
typedef int (*iallreduce_int)(const void *, void *, int, int, int, int, void *);
typedef int (*allreduce_ptr)(const void *, void *, int, void *, void *, void *);
typedef int (*allreduce_int)(const void *, void *, int, int, int, int);
typedef int (*iallgather_ptr)(const void *, int, void *, void *, int, void *, void *, void *);
typedef int (*iallgather_int)(const void *, int, int, void *, int, int, int, void *);
typedef int (*allgather_ptr)(const void *, int, void *, void *, int, void *, void *);
typedef int (*allgather_int)(const void *, int, int, void *, int, int, int);
typedef int (*bcast_ptr)(void *, int, void *, int, void *);
typedef int (*bcast_int)(void *, int, int, int, int);
typedef int (*alltoall_ptr)(const void *, int, void *, void *, int, void *, void *);
typedef int (*alltoall_int)(const void *, int, int, void *, int, int, int);
typedef int (*gather_ptr)(const void *, int, void *, void *, int, void *, int, void *);
typedef int (*gather_int)(const void *, int, int, void *, int, int, int, int);
typedef int (*reduce_ptr)(const void *, void *, int, void *, void *, int, void *);
typedef int (*reduce_int)(const void *, void *, int, int, int, int, int);
typedef int (*ibcast_ptr)(void *, int, void *, int, void *, void *);
typedef int (*ibcast_int)(void *, int, int, int, int, void *);
typedef int (*ialltoall_ptr)(const void *, int, void *, void *, int, void *, void *, void *);
typedef int (*ialltoall_int)(const void *, int, int, void *, int, int, int, void *);
typedef int (*igather_ptr)(const void *, int, void *, void *, int, void *, int, void *, void *);
typedef int (*igather_int)(const void *, int, int, void *, int, int, int, int, void *);
typedef int (*ireduce_ptr)(const void *, void *, int, void *, void *, int, void *, void *);
typedef int (*ireduce_int)(const void *, void *, int, int, int, int, int, void *);
typedef int (*sendrecv_ptr)(const void *, int, void *, int, int, void *, int, void *, int, int, void *, void *);
typedef int (*sendrecv_int)(const void *, int, int, int, int, void *, int, int, int, int, int, void *);
typedef int (*reduce_local_ptr)(const void *, void *, int, void *, void *);
typedef int (*reduce_local_int)(const void *, void *, int, int, int);
typedef int (*comm_rank_ptr)(void *, int *);
typedef int (*comm_rank_int)(int, int *);
typedef int (*comm_size_ptr)(void *, int *);
typedef int (*comm_size_int)(int, int *);
typedef void (*user_function)(void *, void *, int *, void *);
typedef int (*op_create_ptr)(user_function, int, void **);
typedef int (*op_create_int)(user_function, int, int *);
typedef PyObject *(*op_new_ptr)(void *);
typedef PyObject *(*op_new_int)(int);
typedef int (*test_fn)(void *, int *, void *);
typedef int (*wait_fn)(void *, void *);
typedef PyObject *(*request_new_ptr)(void *);
typedef PyObject *(*request_new_int)(int);
typedef void *(*handle_get)(PyObject *);

static struct {
    int pointer_handles;
    void *iallreduce, *iallgather, *allreduce, *allgather, *bcast, *alltoall, *gather, *reduce, *comm_rank, *comm_size;
    void *ibcast, *ialltoall, *igather, *ireduce, *sendrecv, *reduce_local;
    void *op_create, *op_new;
    test_fn test;
    wait_fn wait;
    void *request_new;
    handle_get request_get, comm_get, datatype_get, op_get;
    mpi_handle request_null, byte;
    void *in_place;
    PyObject *exception;
    int err_other;
} mpi;

/* A status is at most 8 ints and a count in every implementation known; leave room. */
typedef struct { int64_t words[16]; } any_status;

static int find_in(void *library, const char *why_prefix, char *why, size_t why_size) {
    mpi.iallreduce = dlsym(library, "MPI_Iallreduce");
    mpi.iallgather = dlsym(library, "MPI_Iallgather");
    mpi.test = (test_fn)dlsym(library, "MPI_Test");
    mpi.wait = (wait_fn)dlsym(library, "MPI_Wait");
    mpi.allreduce = dlsym(library, "MPI_Allreduce");
    mpi.allgather = dlsym(library, "MPI_Allgather");
    mpi.bcast = dlsym(library, "MPI_Bcast");
    mpi.alltoall = dlsym(library, "MPI_Alltoall");
    mpi.gather = dlsym(library, "MPI_Gather");
    mpi.reduce = dlsym(library, "MPI_Reduce");
    mpi.comm_rank = dlsym(library, "MPI_Comm_rank");
    mpi.comm_size = dlsym(library, "MPI_Comm_size");
    mpi.op_create = dlsym(library, "MPI_Op_create");
    mpi.ibcast = dlsym(library, "MPI_Ibcast");
    mpi.ialltoall = dlsym(library, "MPI_Ialltoall");
    mpi.igather = dlsym(library, "MPI_Igather");
    mpi.ireduce = dlsym(library, "MPI_Ireduce");
    mpi.sendrecv = dlsym(library, "MPI_Sendrecv");
    mpi.reduce_local = dlsym(library, "MPI_Reduce_local");
    if (mpi.sendrecv && mpi.reduce_local && mpi.iallreduce && mpi.iallgather && mpi.test && mpi.wait &&
        mpi.allreduce && mpi.allgather && mpi.bcast &&
        mpi.alltoall && mpi.gather && mpi.reduce && mpi.comm_rank && mpi.comm_size && mpi.op_create &&
        mpi.ibcast && mpi.ialltoall && mpi.igather && mpi.ireduce)
        return 1;
    snprintf(why, why_size, "%s", why_prefix);
    return 0;
}

struct search { void *found; };

/* dl_iterate_phdr's callback: the first loaded object exporting MPI_Iallreduce. */
static int find_library(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    struct search *search = data;
    if (info->dlpi_name == NULL || info->dlpi_name[0] == '\0') return 0;
    void *library = dlopen(info->dlpi_name, RTLD_LAZY | RTLD_NOLOAD);
    if (library == NULL) return 0;
    if (dlsym(library, "MPI_Iallreduce") != NULL) {
        search->found = library;
        return 1;
    }
    dlclose(library);
    return 0;
}

static int find_functions(char *why, size_t why_size) {
    /* A library loaded globally (or a profiling layer preloaded before it) comes first, as
     * it would for a program linked against MPI; else the one mpi4py loaded locally. */
    if (find_in(RTLD_DEFAULT, "", why, why_size)) return 0;
    struct search search = {NULL};
    dl_iterate_phdr(find_library, &search);
    if (search.found != NULL && find_in(search.found, "", why, why_size)) return 0;
    snprintf(why, why_size, "no loaded library exports MPI_Iallreduce, MPI_Iallgather, MPI_Test, MPI_Wait, "
                            "MPI_Allreduce, MPI_Allgather, MPI_Bcast, MPI_Alltoall, MPI_Gather, MPI_Reduce, their "
                            "nonblocking forms, MPI_Sendrecv, MPI_Reduce_local and MPI_Comm_rank");
    return -1;
}

static void *capsule_function(PyObject *capi, const char *name, const char *signature) {
    PyObject *capsule = PyDict_GetItemString(capi, name);
    if (capsule == NULL || !PyCapsule_IsValid(capsule, signature)) return NULL;
    return PyCapsule_GetPointer(capsule, signature);
}

static mpi_handle read_handle(void *slot) {
    return mpi.pointer_handles ? (mpi_handle)(*(void **)slot) : (mpi_handle)(*(int *)slot);
}

static int find_capi(PyObject *module, char *why, size_t why_size) {
    PyObject *capi = PyObject_GetAttrString(module, "__pyx_capi__");
    if (capi == NULL || !PyDict_Check(capi)) {
        Py_XDECREF(capi);
        PyErr_Clear();
        snprintf(why, why_size, "mpi4py.MPI has no C API (__pyx_capi__)");
        return -1;
    }
    mpi.request_new = capsule_function(capi, "PyMPIRequest_New", "PyObject *(MPI_Request)");
    mpi.request_get = (handle_get)capsule_function(capi, "PyMPIRequest_Get", "MPI_Request *(PyObject *)");
    mpi.comm_get = (handle_get)capsule_function(capi, "PyMPIComm_Get", "MPI_Comm *(PyObject *)");
    mpi.datatype_get = (handle_get)capsule_function(capi, "PyMPIDatatype_Get", "MPI_Datatype *(PyObject *)");
    mpi.op_get = (handle_get)capsule_function(capi, "PyMPIOp_Get", "MPI_Op *(PyObject *)");
    mpi.op_new = capsule_function(capi, "PyMPIOp_New", "PyObject *(MPI_Op)");
    Py_DECREF(capi);
    PyErr_Clear();
    if (!mpi.request_new || !mpi.request_get || !mpi.comm_get || !mpi.datatype_get || !mpi.op_get || !mpi.op_new) {
        snprintf(why, why_size, "mpi4py's C API lacks the Request, Comm, Datatype or Op functions");
        return -1;
    }
    return 0;
}

/* The handle inside the mpi4py object `name` of `module`, through `get`. */
static int module_handle(PyObject *module, const char *name, handle_get get, mpi_handle *out) {
    PyObject *object = PyObject_GetAttrString(module, name);
    if (object == NULL) return -1;
    void *slot = get(object);
    Py_DECREF(object);
    if (slot == NULL) return -1;
    *out = read_handle(slot);
    return 0;
}

int mpi_bind(PyObject *module, int pointer_handles, char *why, size_t why_size) {
    mpi.pointer_handles = pointer_handles;
    if (find_functions(why, why_size) < 0 || find_capi(module, why, why_size) < 0) return -1;
    if (module_handle(module, "REQUEST_NULL", mpi.request_get, &mpi.request_null) < 0 ||
        module_handle(module, "BYTE", mpi.datatype_get, &mpi.byte) < 0) {
        PyErr_Clear();
        snprintf(why, why_size, "mpi4py.MPI lacks REQUEST_NULL or BYTE");
        return -1;
    }
    PyObject *in_place = PyObject_GetAttrString(module, "IN_PLACE");
    mpi.exception = in_place == NULL ? NULL : PyObject_GetAttrString(module, "Exception");
    if (in_place == NULL || mpi.exception == NULL) {
        Py_XDECREF(in_place);
        PyErr_Clear();
        snprintf(why, why_size, "mpi4py.MPI lacks IN_PLACE or Exception");
        return -1;
    }
    /* mpi4py's IN_PLACE converts to an int holding the C constant's address. */
    PyObject *address = PyNumber_Long(in_place);
    Py_DECREF(in_place);
    mpi.in_place = address == NULL ? NULL : PyLong_AsVoidPtr(address);
    Py_XDECREF(address);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        snprintf(why, why_size, "mpi4py.MPI.IN_PLACE is not an address");
        return -1;
    }
    PyObject *other = PyObject_GetAttrString(module, "ERR_OTHER");
    mpi.err_other = other == NULL ? -1 : (int)PyLong_AsLong(other);
    Py_XDECREF(other);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        snprintf(why, why_size, "mpi4py.MPI lacks ERR_OTHER");
        return -1;
    }
    return 0;
}

int mpi_error_other(void) { return mpi.err_other; }

static mpi_handle handle_of(PyObject *object, handle_get get) {
    void *slot = get(object);
    return slot == NULL ? -1 : read_handle(slot);
}

mpi_handle mpi_comm_of(PyObject *comm) { return handle_of(comm, mpi.comm_get); }
mpi_handle mpi_datatype_of(PyObject *datatype) { return handle_of(datatype, mpi.datatype_get); }
mpi_handle mpi_op_of(PyObject *op) { return handle_of(op, mpi.op_get); }

PyObject *mpi_new_request(void) {
    if (mpi.pointer_handles) return ((request_new_ptr)mpi.request_new)((void *)mpi.request_null);
    return ((request_new_int)mpi.request_new)((int)mpi.request_null);
}

void *mpi_request_slot(PyObject *request) { return mpi.request_get(request); }

int mpi_iallreduce_in_place(void *buffer, int count, mpi_handle datatype, mpi_handle op, mpi_handle comm,
                            void *request) {
    if (mpi.pointer_handles)
        return ((iallreduce_ptr)mpi.iallreduce)(mpi.in_place, buffer, count, (void *)datatype, (void *)op,
                                                 (void *)comm, request);
    return ((iallreduce_int)mpi.iallreduce)(mpi.in_place, buffer, count, (int)datatype, (int)op, (int)comm,
                                             request);
}

int mpi_allreduce(const void *send, void *recv, int count, mpi_handle datatype, mpi_handle op, mpi_handle comm) {
    const void *from = send == NULL ? mpi.in_place : send;
    if (mpi.pointer_handles)
        return ((allreduce_ptr)mpi.allreduce)(from, recv, count, (void *)datatype, (void *)op, (void *)comm);
    return ((allreduce_int)mpi.allreduce)(from, recv, count, (int)datatype, (int)op, (int)comm);
}

int mpi_sendrecv(const void *send, void *recv, int count, mpi_handle datatype, int peer, int tag, mpi_handle comm) {
    any_status status;
    if (mpi.pointer_handles)
        return ((sendrecv_ptr)mpi.sendrecv)(send, count, (void *)datatype, peer, tag, recv, count, (void *)datatype,
                                            peer, tag, (void *)comm, &status);
    return ((sendrecv_int)mpi.sendrecv)(send, count, (int)datatype, peer, tag, recv, count, (int)datatype, peer, tag,
                                        (int)comm, &status);
}

int mpi_reduce_local(const void *in, void *inout, int count, mpi_handle datatype, mpi_handle op) {
    if (mpi.pointer_handles)
        return ((reduce_local_ptr)mpi.reduce_local)(in, inout, count, (void *)datatype, (void *)op);
    return ((reduce_local_int)mpi.reduce_local)(in, inout, count, (int)datatype, (int)op);
}

int mpi_iallgather_bytes(const void *send, void *recv, int count, mpi_handle comm, void *request) {
    if (mpi.pointer_handles)
        return ((iallgather_ptr)mpi.iallgather)(send, count, (void *)mpi.byte, recv, count, (void *)mpi.byte,
                                                 (void *)comm, request);
    return ((iallgather_int)mpi.iallgather)(send, count, (int)mpi.byte, recv, count, (int)mpi.byte, (int)comm,
                                             request);
}

int mpi_allgather_bytes(const void *send, void *recv, int count, mpi_handle comm) {
    if (mpi.pointer_handles)
        return ((allgather_ptr)mpi.allgather)(send, count, (void *)mpi.byte, recv, count, (void *)mpi.byte,
                                               (void *)comm);
    return ((allgather_int)mpi.allgather)(send, count, (int)mpi.byte, recv, count, (int)mpi.byte, (int)comm);
}

int mpi_bcast_bytes(void *buffer, int count, int root, mpi_handle comm) {
    if (mpi.pointer_handles) return ((bcast_ptr)mpi.bcast)(buffer, count, (void *)mpi.byte, root, (void *)comm);
    return ((bcast_int)mpi.bcast)(buffer, count, (int)mpi.byte, root, (int)comm);
}

int mpi_alltoall_bytes(const void *send, void *recv, int count, mpi_handle comm) {
    if (mpi.pointer_handles)
        return ((alltoall_ptr)mpi.alltoall)(send, count, (void *)mpi.byte, recv, count, (void *)mpi.byte, (void *)comm);
    return ((alltoall_int)mpi.alltoall)(send, count, (int)mpi.byte, recv, count, (int)mpi.byte, (int)comm);
}

int mpi_gather_bytes(const void *send, void *recv, int count, int root, mpi_handle comm) {
    if (mpi.pointer_handles)
        return ((gather_ptr)mpi.gather)(send, count, (void *)mpi.byte, recv, count, (void *)mpi.byte, root,
                                         (void *)comm);
    return ((gather_int)mpi.gather)(send, count, (int)mpi.byte, recv, count, (int)mpi.byte, root, (int)comm);
}

int mpi_reduce(const void *send, void *recv, int count, mpi_handle datatype, mpi_handle op, int root, mpi_handle comm) {
    if (mpi.pointer_handles)
        return ((reduce_ptr)mpi.reduce)(send, recv, count, (void *)datatype, (void *)op, root, (void *)comm);
    return ((reduce_int)mpi.reduce)(send, recv, count, (int)datatype, (int)op, root, (int)comm);
}

int mpi_ibcast_bytes(void *buffer, int count, int root, mpi_handle comm, void *request) {
    if (mpi.pointer_handles)
        return ((ibcast_ptr)mpi.ibcast)(buffer, count, (void *)mpi.byte, root, (void *)comm, request);
    return ((ibcast_int)mpi.ibcast)(buffer, count, (int)mpi.byte, root, (int)comm, request);
}

int mpi_ialltoall_bytes(const void *send, void *recv, int count, mpi_handle comm, void *request) {
    if (mpi.pointer_handles)
        return ((ialltoall_ptr)mpi.ialltoall)(send, count, (void *)mpi.byte, recv, count, (void *)mpi.byte,
                                               (void *)comm, request);
    return ((ialltoall_int)mpi.ialltoall)(send, count, (int)mpi.byte, recv, count, (int)mpi.byte, (int)comm,
                                           request);
}

int mpi_igather_bytes(const void *send, void *recv, int count, int root, mpi_handle comm, void *request) {
    if (mpi.pointer_handles)
        return ((igather_ptr)mpi.igather)(send, count, (void *)mpi.byte, recv, count, (void *)mpi.byte, root,
                                           (void *)comm, request);
    return ((igather_int)mpi.igather)(send, count, (int)mpi.byte, recv, count, (int)mpi.byte, root, (int)comm,
                                       request);
}

int mpi_ireduce(const void *send, void *recv, int count, mpi_handle datatype, mpi_handle op, int root,
                mpi_handle comm, void *request) {
    if (mpi.pointer_handles)
        return ((ireduce_ptr)mpi.ireduce)(send, recv, count, (void *)datatype, (void *)op, root, (void *)comm,
                                           request);
    return ((ireduce_int)mpi.ireduce)(send, recv, count, (int)datatype, (int)op, root, (int)comm, request);
}

int mpi_comm_rank(mpi_handle comm, int *rank) {
    if (mpi.pointer_handles) return ((comm_rank_ptr)mpi.comm_rank)((void *)comm, rank);
    return ((comm_rank_int)mpi.comm_rank)((int)comm, rank);
}

int mpi_iallreduce(const void *send, void *recv, int count, mpi_handle datatype, mpi_handle op, mpi_handle comm,
                   void *request) {
    if (send == NULL) send = mpi.in_place;
    if (mpi.pointer_handles)
        return ((iallreduce_ptr)mpi.iallreduce)(send, recv, count, (void *)datatype, (void *)op, (void *)comm, request);
    return ((iallreduce_int)mpi.iallreduce)(send, recv, count, (int)datatype, (int)op, (int)comm, request);
}

PyObject *mpi_new_op(user_function function, int commute) {
    if (mpi.pointer_handles) {
        void *op = NULL;
        if (((op_create_ptr)mpi.op_create)(function, commute, &op) != 0) goto failed;
        return ((op_new_ptr)mpi.op_new)(op);
    }
    int op = 0;
    if (((op_create_int)mpi.op_create)(function, commute, &op) != 0) goto failed;
    return ((op_new_int)mpi.op_new)(op);
failed:
    PyErr_SetString(PyExc_RuntimeError, "MPI_Op_create failed");
    return NULL;
}

int mpi_comm_size(mpi_handle comm, int *size) {
    if (mpi.pointer_handles) return ((comm_size_ptr)mpi.comm_size)((void *)comm, size);
    return ((comm_size_int)mpi.comm_size)((int)comm, size);
}

int mpi_test(void *request, int *flag) {
    any_status status;
    return mpi.test(request, flag, &status);
}

int mpi_wait(void *request) {
    any_status status;
    return mpi.wait(request, &status);
}

void mpi_failed(PyObject *engine, int code, PyObject *op, PyObject *name) {
    PyObject *mpi_error = PyObject_CallFunction(mpi.exception, "i", code);
    if (mpi_error == NULL) return;
    PyObject *error = PyObject_CallFunctionObjArgs(ENGINE(engine)->mpi_failed, mpi_error, op, name, NULL);
    Py_DECREF(mpi_error);
    if (error == NULL) return;
    PyErr_SetObject((PyObject *)Py_TYPE(error), error);
    Py_DECREF(error);
}
