/* The shared segment of two ranks of one node, and the futex waits of their exchanges (pair.h).
 *
 * A segment is a memfd that rank 0 creates and rank 1 maps through /proc/<pid>/fd/<fd> (the
 * token rank 0 wrote checks that it is the one meant). It holds a header page, then two slots
 * per rank: a call's input goes into the slot of its number's parity, so a rank writes call
 * n + 1's input while its peer may still read call n's, and waits only for call n - 1's. The
 * counters are futex words: shared futexes (not FUTEX_PRIVATE), as the two processes map one
 * file. `ring` wakes only a dozing peer (a check's post stays free of system calls): the dozer
 * says it dozes before it looks at the count, the ringer counts before it looks whether the
 * peer dozes (both sequentially consistent), so one of them sees the other. A wait gives up
 * only where the peer's process no longer exists: the caller then lets MPI report the peer's
 * failure as it would have. */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "pair.h"

/* The segment's first page. `posted[r]`: the calls whose input rank r wrote; `read[r]`: the
 * calls whose peer's input rank r has read (each rank writes only its own words). */
typedef struct {
    uint64_t token;
    uint32_t posted[2];
    uint32_t read[2];
    uint32_t checks[2];  /* the checks of the group rank r posted (`ring`) */
    uint32_t dozing[2];  /* rank r sleeps on the peer's `checks` (only then does `ring` wake it) */
} Header;

#define HEADER_BYTES 4096
/* The largest call carried here (a slot's size): beyond it the copies cost more than a wait. */
#define MAX_BYTES ((size_t)8 << 20)
/* Spins on a counter before a wait sleeps: a peer already there is seen without a system call. */
#define SPINS 200
/* A sleeping wait looks whether the peer's process still exists this often. */
#define LOOK_NS 100000000L
#define MAX_PAIRS 256

struct Pair {
    char *base;
    size_t size, capacity, nbytes;
    int me;
    pid_t peer;
    uint32_t calls; /* this rank's calls so far; the current one's number */
};

typedef struct {
    intptr_t comm;
    int state; /* 1: `pair` set; -1: none will be */
    Pair *pair;
} Entry;

static Entry entries[MAX_PAIRS];
static int used;

static Header *header(Pair *pair) { return (Header *)pair->base; }

static char *slot(Pair *pair, int rank, uint32_t call) {
    return pair->base + HEADER_BYTES + (size_t)(2 * rank + (int)(call & 1)) * pair->capacity;
}

/* A communicator's handle as a key: an int handle (MPICH's) whether read signed or unsigned. */
static intptr_t key_of(intptr_t comm) { return comm < 0 && comm >= INT32_MIN ? (intptr_t)(uint32_t)comm : comm; }

static Entry *entry_of(intptr_t comm) {
    comm = key_of(comm);
    for (int i = 0; i < used; i++)
        if (entries[i].comm == comm) return &entries[i];
    return NULL;
}

/* Whether a count `seen` has reached `target` (counters wrap: compared by their difference). */
static int reached(uint32_t seen, uint32_t target) { return (int32_t)(seen - target) >= 0; }

/* Wait until `count` reaches `target`: 0, or -1 where the peer's process is gone. */
static int wait_for(Pair *pair, uint32_t *count, uint32_t target) {
    for (int spin = 0; spin < SPINS; spin++)
        if (reached(__atomic_load_n(count, __ATOMIC_ACQUIRE), target)) return 0;
    for (;;) {
        uint32_t seen = __atomic_load_n(count, __ATOMIC_ACQUIRE);
        if (reached(seen, target)) return 0;
        struct timespec look = {0, LOOK_NS};
        long code = syscall(SYS_futex, count, FUTEX_WAIT, seen, &look, NULL, 0);
        if (code == -1 && errno == ETIMEDOUT && kill(pair->peer, 0) == -1 && errno == ESRCH) return -1;
    }
}

static void wake(uint32_t *count) { syscall(SYS_futex, count, FUTEX_WAKE, 1, NULL, NULL, 0); }

static int pair_find(intptr_t comm, size_t nbytes, Pair **pair) {
    Entry *entry = entry_of(comm);
    if (nbytes > MAX_BYTES || (entry != NULL && entry->state < 0)) return -1;
    if (entry == NULL || entry->pair->capacity < nbytes) return 0;
    *pair = entry->pair;
    return 1;
}

static int pair_post(Pair *pair, const void *send, size_t nbytes) {
    Header *head = header(pair);
    uint32_t call = ++pair->calls;
    /* The slot held call - 2's input: the peer has read it once it read call - 2's. */
    if (wait_for(pair, &head->read[1 - pair->me], call - 2) != 0) return -1;
    memcpy(slot(pair, pair->me, call), send, nbytes);
    pair->nbytes = nbytes;
    __atomic_store_n(&head->posted[pair->me], call, __ATOMIC_RELEASE);
    wake(&head->posted[pair->me]);
    return 0;
}

static const void *pair_await_peer(Pair *pair) {
    int peer = 1 - pair->me;
    if (wait_for(pair, &header(pair)->posted[peer], pair->calls) != 0) return NULL;
    return slot(pair, peer, pair->calls);
}

static const void *pair_own(Pair *pair) { return slot(pair, pair->me, pair->calls); }

static void pair_done(Pair *pair) {
    Header *head = header(pair);
    __atomic_store_n(&head->read[pair->me], pair->calls, __ATOMIC_RELEASE);
    wake(&head->read[pair->me]);
}

static void pair_ring(intptr_t comm, uint32_t checks) {
    Entry *entry = entry_of(comm);
    if (entry == NULL || entry->pair == NULL) return;
    Header *head = header(entry->pair);
    int me = entry->pair->me;
    __atomic_store_n(&head->checks[me], checks, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&head->dozing[1 - me], __ATOMIC_SEQ_CST)) wake(&head->checks[me]);
}

static int pair_doze(intptr_t comm, uint32_t checks, long ns) {
    Entry *entry = entry_of(comm);
    if (entry == NULL || entry->pair == NULL) return -1;
    Header *head = header(entry->pair);
    int me = entry->pair->me;
    __atomic_store_n(&head->dozing[me], 1, __ATOMIC_SEQ_CST);
    uint32_t seen = __atomic_load_n(&head->checks[1 - me], __ATOMIC_SEQ_CST);
    int before = reached(seen, checks);
    if (!before) {
        struct timespec most = {ns / 1000000000L, ns % 1000000000L};
        syscall(SYS_futex, &head->checks[1 - me], FUTEX_WAIT, seen, &most, NULL, 0);
    }
    __atomic_store_n(&head->dozing[me], 0, __ATOMIC_SEQ_CST);
    return before;
}

static const PairApi api = {pair_find, pair_post, pair_await_peer, pair_own, pair_done, pair_ring, pair_doze};

/* ---- the Python interface (_transport/mpi/pair.py) ------------------------------------------ */

static PyObject *pair_api_address(PyObject *module, PyObject *unused) {
    (void)module, (void)unused;
    return PyLong_FromVoidPtr((void *)&api);
}

static PyObject *pair_create(PyObject *module, PyObject *args) {
    (void)module;
    Py_ssize_t size;
    unsigned long long token;
    if (!PyArg_ParseTuple(args, "nK", &size, &token)) return NULL;
    int fd = memfd_create("mpitensor-pair", MFD_CLOEXEC);
    if (fd < 0) return PyErr_SetFromErrno(PyExc_OSError);
    void *base = MAP_FAILED;
    if (ftruncate(fd, (off_t)size) == 0) base = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        PyErr_SetFromErrno(PyExc_OSError);
        close(fd);
        return NULL;
    }
    ((Header *)base)->token = token;
    return Py_BuildValue("iN", fd, PyLong_FromVoidPtr(base));
}

static PyObject *pair_attach(PyObject *module, PyObject *args) {
    (void)module;
    int pid, fd;
    Py_ssize_t size;
    unsigned long long token;
    if (!PyArg_ParseTuple(args, "iinK", &pid, &fd, &size, &token)) return NULL;
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", pid, fd);
    int opened = open(path, O_RDWR | O_CLOEXEC);
    if (opened < 0) return PyLong_FromLong(0);
    struct stat info;
    void *base = MAP_FAILED;
    if (fstat(opened, &info) == 0 && S_ISREG(info.st_mode) && info.st_size == (off_t)size)
        base = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED, opened, 0);
    close(opened);
    if (base == MAP_FAILED) return PyLong_FromLong(0);
    if (((Header *)base)->token != token) { /* another file of that number: not the peer's segment */
        munmap(base, (size_t)size);
        return PyLong_FromLong(0);
    }
    return PyLong_FromVoidPtr(base);
}

static void forget_entry(Entry *entry) {
    if (entry->pair != NULL) {
        munmap(entry->pair->base, entry->pair->size);
        PyMem_RawFree(entry->pair);
    }
    *entry = entries[--used];
}

static PyObject *pair_register(PyObject *module, PyObject *args) {
    (void)module;
    unsigned long long comm; /* a handle, as mpi4py gives it: an int one may come sign-extended */
    PyObject *address;
    Py_ssize_t size, capacity;
    int me, peer, usable;
    if (!PyArg_ParseTuple(args, "KOnniip", &comm, &address, &size, &capacity, &me, &peer, &usable)) return NULL;
    char *base = address == Py_None ? NULL : PyLong_AsVoidPtr(address);
    if (PyErr_Occurred()) return NULL;
    if (!usable && base != NULL) { /* mapped here, but not by both: no pair */
        munmap(base, (size_t)size);
        base = NULL;
    }
    Entry *entry = entry_of((intptr_t)comm);
    if (entry != NULL) forget_entry(entry);
    if (used == MAX_PAIRS) { /* that many 2-rank groups at once: the others exchange through MPI */
        if (base != NULL) munmap(base, (size_t)size);
        Py_RETURN_FALSE;
    }
    Pair *pair = NULL;
    if (base != NULL) {
        pair = PyMem_RawCalloc(1, sizeof(Pair));
        if (pair == NULL) return PyErr_NoMemory();
        *pair = (Pair){base, (size_t)size, (size_t)capacity, 0, me, (pid_t)peer, 0};
    }
    entries[used++] = (Entry){key_of((intptr_t)comm), base != NULL ? 1 : -1, pair};
    Py_RETURN_TRUE;
}

static PyObject *pair_py_state(PyObject *module, PyObject *args) {
    (void)module;
    unsigned long long comm; /* a handle, as mpi4py gives it: an int one may come sign-extended */
    Py_ssize_t nbytes;
    if (!PyArg_ParseTuple(args, "Kn", &comm, &nbytes)) return NULL;
    Pair *pair;
    return PyLong_FromLong(pair_find((intptr_t)comm, (size_t)nbytes, &pair));
}

static PyObject *pair_room(PyObject *module, PyObject *arg) {
    (void)module;
    unsigned long long comm = PyLong_AsUnsignedLongLongMask(arg);
    if (comm == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    return PyBool_FromLong(used < MAX_PAIRS || entry_of((intptr_t)comm) != NULL);
}

static PyObject *pair_forget(PyObject *module, PyObject *arg) {
    (void)module;
    unsigned long long comm = PyLong_AsUnsignedLongLongMask(arg);
    if (comm == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    Entry *entry = entry_of((intptr_t)comm);
    if (entry != NULL) forget_entry(entry);
    Py_RETURN_NONE;
}

/* The registered pair of `comm`, or NULL with an error set. */
static Pair *pair_of(PyObject *comm) {
    unsigned long long handle = PyLong_AsUnsignedLongLongMask(comm);
    if (handle == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    Entry *entry = entry_of((intptr_t)handle);
    if (entry == NULL || entry->pair == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "no shared pair is set up for this communicator");
        return NULL;
    }
    return entry->pair;
}

static PyObject *slot_view(Pair *pair, const void *data) {
    return PyMemoryView_FromMemory((char *)data, (Py_ssize_t)pair->nbytes, PyBUF_READ);
}

static PyObject *pair_py_post(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *comm;
    Py_buffer send;
    if (!PyArg_ParseTuple(args, "Oy*", &comm, &send)) return NULL;
    Pair *pair = pair_of(comm);
    int code = 0;
    if (pair != NULL && (size_t)send.len > pair->capacity) {
        PyErr_SetString(PyExc_ValueError, "the input is larger than the pair's slots");
        pair = NULL;
    }
    if (pair != NULL) {
        Py_BEGIN_ALLOW_THREADS
        code = pair_post(pair, send.buf, (size_t)send.len);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&send);
    if (pair == NULL) return NULL;
    return PyBool_FromLong(code == 0);
}

static PyObject *pair_py_await(PyObject *module, PyObject *comm) {
    (void)module;
    Pair *pair = pair_of(comm);
    if (pair == NULL) return NULL;
    const void *peer;
    Py_BEGIN_ALLOW_THREADS
    peer = pair_await_peer(pair);
    Py_END_ALLOW_THREADS
    if (peer == NULL) Py_RETURN_NONE;
    return slot_view(pair, peer);
}

static PyObject *pair_py_own(PyObject *module, PyObject *comm) {
    (void)module;
    Pair *pair = pair_of(comm);
    return pair == NULL ? NULL : slot_view(pair, pair_own(pair));
}

static PyObject *pair_py_done(PyObject *module, PyObject *comm) {
    (void)module;
    Pair *pair = pair_of(comm);
    if (pair == NULL) return NULL;
    pair_done(pair);
    Py_RETURN_NONE;
}

static PyObject *pair_py_ring(PyObject *module, PyObject *args) {
    (void)module;
    unsigned long long comm; /* a handle, as mpi4py gives it: an int one may come sign-extended */
    unsigned long long checks;
    if (!PyArg_ParseTuple(args, "KK", &comm, &checks)) return NULL;
    pair_ring((intptr_t)comm, (uint32_t)checks);
    Py_RETURN_NONE;
}

static PyObject *pair_py_doze(PyObject *module, PyObject *args) {
    (void)module;
    unsigned long long comm; /* a handle, as mpi4py gives it: an int one may come sign-extended */
    unsigned long long checks;
    long ns;
    if (!PyArg_ParseTuple(args, "KKl", &comm, &checks, &ns)) return NULL;
    int code;
    Py_BEGIN_ALLOW_THREADS
    code = pair_doze((intptr_t)comm, (uint32_t)checks, ns);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(code);
}

static PyMethodDef methods[] = {
    {"api_address", pair_api_address, METH_NOARGS, "The address of the C interface the compiled lane calls (pair.h)."},
    {"create", pair_create, METH_VARARGS,
     "create(size, token) -> (fd, address): a new shared segment of `size` bytes, `token` in its header."},
    {"attach", pair_attach, METH_VARARGS,
     "attach(pid, fd, size, token) -> address: map process `pid`'s segment `fd`; 0 where it cannot be mapped "
     "or is not the one whose header holds `token`."},
    {"register", pair_register, METH_VARARGS,
     "register(comm, address, size, capacity, me, peer, usable) -> bool: the segment at `address` (of `size` "
     "bytes) is the pair of communicator handle `comm`, slots of `capacity` bytes, this rank `me`, the peer's "
     "process `peer`; where not `usable` (or `address` is None) no pair will be, and a mapped segment is unmapped. "
     "Replaces (and unmaps) the one before. False where too many pairs are registered."},
    {"state", pair_py_state, METH_VARARGS,
     "state(comm, nbytes) -> int: 1 a pair carries a call of `nbytes` on communicator handle `comm`, 0 none is "
     "set up for it yet, -1 none will be."},
    {"room", pair_room, METH_O,
     "room(comm) -> bool: whether `register` can take a pair of communicator handle `comm` (not too many)."},
    {"forget", pair_forget, METH_O, "forget(comm): unmap and drop the pair of communicator handle `comm`, if any."},
    {"post", pair_py_post, METH_VARARGS,
     "post(comm, data) -> bool: the next call's input into this rank's slot; False where the peer's process is gone."},
    {"await_peer", pair_py_await, METH_O,
     "await_peer(comm) -> memoryview | None: the peer's input of this call once written (the GIL released); "
     "None where the peer's process is gone."},
    {"own", pair_py_own, METH_O, "own(comm) -> memoryview: this rank's input of this call, as `post` wrote it."},
    {"done", pair_py_done, METH_O, "done(comm): this rank has read the peer's input of this call."},
    {"ring", pair_py_ring, METH_VARARGS,
     "ring(comm, checks): this rank posted the first `checks` checks of the group of communicator handle `comm`."},
    {"doze", pair_py_doze, METH_VARARGS,
     "doze(comm, checks, ns) -> int: sleep until the peer posted its first `checks` checks, for at most `ns` "
     "(the GIL released): 1 it had before (no sleep), 0 slept, -1 no pair."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_pair", "The shared segment and futex waits of two ranks of one node (pair.h).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__pair(void) {
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) return NULL;
    if (PyModule_AddIntConstant(module, "HEADER_BYTES", HEADER_BYTES) < 0 ||
        PyModule_AddObject(module, "MAX_BYTES", PyLong_FromSize_t(MAX_BYTES)) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
