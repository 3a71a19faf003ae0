/* The layouts of the Python classes whose objects the lane builds and reads.
 *
 * `Op`, `Tensor` and `CollectiveTensor` are Python classes with __slots__; the lane makes
 * their objects as `wrap_array` does in Python (allocated, then their slots filled, no
 * __init__) and reads their slots at the offsets their member descriptors give. The offsets
 * are looked up by name when the module is bound, so a renamed or removed slot makes the
 * bind fail with its name (and the Python lanes take every call) instead of a wrong read.
 */
#include "native.h"

#include <structmember.h>

Layout layout;
const RingApi *ring_api;

/* The trace ring's functions, from its module's capsule; 0, or -1 with an error set. */
int ring_api_load(void) {
    if (ring_api == NULL) ring_api = PyCapsule_Import("mpitensor._runtime.tracing._ring._C_API", 0);
    return ring_api == NULL ? -1 : 0;
}

static int descriptor_offset(PyObject *descriptor, Py_ssize_t *out) {
    int ok = Py_IS_TYPE(descriptor, &PyMemberDescr_Type) &&
             ((PyMemberDescrObject *)descriptor)->d_member->type == T_OBJECT_EX;
    if (ok) *out = ((PyMemberDescrObject *)descriptor)->d_member->offset;
    return ok;
}

static int offset_of(PyObject *cls, const char *name, Py_ssize_t *out) {
    PyObject *descriptor = PyObject_GetAttrString(cls, name);
    if (descriptor == NULL) return -1;
    int ok = descriptor_offset(descriptor, out);
    Py_DECREF(descriptor);
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%s.%s is not a slot", ((PyTypeObject *)cls)->tp_name, name);
        return -1;
    }
    return 0;
}

#define OFFSET(cls, field, name) \
    if (offset_of(cls, name, &layout.field) < 0) return -1

/* The offsets of `count` member descriptors, in order; `what` names them in the error. */
static int field_offsets(PyObject *fields, PyObject *owner, Py_ssize_t *const *outs, Py_ssize_t count,
                         const char *what) {
    if (!PyTuple_Check(fields) || PyTuple_GET_SIZE(fields) != count) {
        PyErr_Format(PyExc_TypeError, "bind() takes %zd slot descriptors of %s", count, what);
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *descriptor = PyTuple_GET_ITEM(fields, i);
        if (!descriptor_offset(descriptor, outs[i]) ||
            !PyType_IsSubtype((PyTypeObject *)owner, PyDescr_TYPE(descriptor))) {
            PyErr_Format(PyExc_TypeError, "field %zd of %s is not a slot", i, what);
            return -1;
        }
    }
    return 0;
}

int slots_bind(PyObject *op_class, PyObject *tensor_class, PyObject *tensor_fields, PyObject *handle_class,
               PyObject *handle_fields) {
    if (!PyType_Check(op_class) || !PyType_Check(tensor_class) || !PyType_Check(handle_class)) {
        PyErr_SetString(PyExc_TypeError, "bind() takes the Op, Tensor and handle classes");
        return -1;
    }
    OFFSET(op_class, op_name, "name");
    OFFSET(op_class, op_group, "group");
    OFFSET(op_class, op_nbytes, "nbytes");
    OFFSET(op_class, op_post, "post");
    OFFSET(op_class, op_finish, "finish");
    OFFSET(op_class, op_record, "record");
    OFFSET(op_class, op_keep, "keep");
    OFFSET(op_class, op_protections, "protections");
    OFFSET(op_class, op_exchange, "exchange");
    OFFSET(op_class, op_compare, "compare");
    OFFSET(op_class, op_payload, "payload");
    OFFSET(op_class, op_requests, "requests");
    OFFSET(op_class, op_stepper, "stepper");
    OFFSET(op_class, op_state, "state");
    OFFSET(op_class, op_result, "result");
    OFFSET(op_class, op_error, "error");
    OFFSET(op_class, op_check_req, "check_req");
    OFFSET(op_class, op_check_send, "check_send");
    OFFSET(op_class, op_check_recv, "check_recv");
    OFFSET(op_class, op_check_stage, "check_stage");
    OFFSET(op_class, op_seq, "seq");
    OFFSET(op_class, op_trace, "trace");
    Py_ssize_t *const tensor[] = {&layout.tensor_array, &layout.tensor_device};
    Py_ssize_t *const handle[] = {&layout.handle_op, &layout.handle_value, &layout.handle_ctx,
                                  &layout.handle_resolved};
    if (field_offsets(tensor_fields, tensor_class, tensor, 2, "Tensor (array, device)") < 0 ||
        field_offsets(handle_fields, handle_class, handle, 4, "CollectiveTensor (op, value, ctx, resolved)") < 0)
        return -1;
    Py_INCREF(op_class);
    Py_INCREF(tensor_class);
    Py_INCREF(handle_class);
    layout.op_type = (PyTypeObject *)op_class;
    layout.tensor_type = (PyTypeObject *)tensor_class;
    layout.handle_type = (PyTypeObject *)handle_class;
    return 0;
}
