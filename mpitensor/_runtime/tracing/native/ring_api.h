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
    PyTypeObject *ring_type, *span_type;
    /* A new span: the collective `kind` of `nbytes` bytes on group `group`, called now; NULL with an error. */
    PyObject *(*begin)(PyObject *ring, int32_t kind, int64_t group, int64_t nbytes, int32_t dtype);
    /* Record moment `field` (RING_AGREED ..) of `span` as now. */
    void (*mark)(PyObject *span, int field);
    /* Record how the span's data travelled. */
    void (*transport)(PyObject *span, int32_t code);
} RingApi;

#endif
