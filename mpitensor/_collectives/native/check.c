/* The large groups' check as MPI reduces it: mpitensor's own MPI op (see _transport/reduced_check.py).
 *
 * A record of CHECK_WORDS int64: the agreement hash and the per-rank value with their
 * negations (their MIN gives the least and the greatest of both at once), the code of a
 * carried payload (0: none) and the payload. Two records combine: the MIN of the first four
 * words; where both codes are the one nonzero code, the payloads reduced by the code's loop
 * (rows.c's, as the small groups' rows are), else the code -1 (the payload meaningless). The
 * op is made once, when the module is bound, and handed to the Python side as an mpi4py Op.
 */
#include "native.h"

#include <stdint.h>
#include <string.h>

enum { HEADER_WORDS = 4, CODE_WORD = 4, PAYLOAD_WORD = 5 };

/* The reduction a code names (`carry_code`: 1 + type number << 16 + op code << 8 + count): the
 * loop's kind and the element count; -1 where no loop takes it. */
static int code_kind(int64_t code, Py_ssize_t *count) {
    int64_t value = code - 1;
    *count = (Py_ssize_t)(value & 0xFF);
    int kind = rows_kind((int)(value >> 16), (int)((value >> 8) & 0xFF));
    return rows_pairwise(kind) ? kind : -1;
}

/* MPI's user function: inout = in (op) inout, for each of *len records. */
static void check_combine(void *in, void *inout, int *len, void *datatype) {
    (void)datatype;
    int64_t *a = in, *b = inout;
    for (int record = 0; record < *len; record++, a += consts.check_words, b += consts.check_words) {
        for (int word = 0; word < HEADER_WORDS; word++)
            if (a[word] < b[word]) b[word] = a[word];
        Py_ssize_t count;
        int kind = b[CODE_WORD] > 0 ? code_kind(b[CODE_WORD], &count) : -1;
        if (a[CODE_WORD] != b[CODE_WORD] || (b[CODE_WORD] > 0 && kind < 0)) {
            b[CODE_WORD] = -1;
            continue;
        }
        if (b[CODE_WORD] > 0) rows_combine(kind, b + PAYLOAD_WORD, a + PAYLOAD_WORD, b + PAYLOAD_WORD, count);
    }
}

const char check_op_doc[] =
"check_op(words)\n--\n\n"
"The MPI op (an mpi4py Op, commutative) of a large group's check records of `words` int64:\n"
"see _transport/reduced_check.py. Made once; later calls give the same op.";

PyObject *check_op(PyObject *module, PyObject *words) {
    (void)module;
    static PyObject *made;
    long count = PyLong_AsLong(words);
    if (count == -1 && PyErr_Occurred()) return NULL;
    if (!consts.bound || count <= PAYLOAD_WORD) {
        PyErr_SetString(PyExc_RuntimeError, "check_op(words) needs the module bound and a record of more than 5 words");
        return NULL;
    }
    if (made == NULL) {
        consts.check_words = (int)count;
        made = mpi_new_op(check_combine, 1);
    }
    return Py_XNewRef(made);
}
