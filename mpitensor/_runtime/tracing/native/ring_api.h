/* The C interface of `mpitensor._runtime.tracing._ring`, for the compiled lane.
 *
 * The lane records its calls in the same ring as the Python engine, without a Python call:
 * it takes this table from the capsule `mpitensor._runtime.tracing._ring._C_API`.
 */
#ifndef MPITENSOR_RING_API_H
#define MPITENSOR_RING_API_H

#include <Python.h>
#include <stdint.h>

/* The moments of a collective, as the event's fields. */
enum { RING_AGREED = 1, RING_POSTED = 2, RING_COMPLETE = 3, RING_RESOLVED = 4 };
/* How its data travelled (`ring.TRANSPORTS`). */
enum { RING_MPI = 1, RING_SHM = 2, RING_CHECK = 3, RING_LOCAL = 4 };

typedef struct {
    PyTypeObject *ring_type;
    /* The ring's clock, in ns. */
    int64_t (*now)(void);
    /* A new span: the collective `kind` of `nbytes` bytes on group `group`, called at `called`
     * (the ring's clock; 0 for now). NULL with an error: memory ran out (the event may be kept). */
    PyObject *(*begin)(PyObject *ring, int32_t kind, int64_t group, int64_t nbytes, int32_t dtype, int64_t called);
    /* Record a collective called at `called` whose data came in its check, which agreed now (no
     * span: nothing is left to record). 0, or -1 when memory ran out (the event is not kept). */
    int (*carried_event)(PyObject *ring, int32_t kind, int64_t group, int64_t nbytes, int32_t dtype,
                         int64_t called);
    /* Record moment `field` (RING_AGREED ..) of `span` as now. */
    void (*mark)(PyObject *span, int field);
    /* Record that the span's data was posted now, travelling by `transport`. */
    void (*posted)(PyObject *span, int32_t transport);
} RingApi;

#endif
