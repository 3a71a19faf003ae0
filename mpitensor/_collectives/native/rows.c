/* Local reductions of the payloads carried in check rows, as NumPy's ufuncs do them.
 *
 * The Python lane reduces the gathered rows with the plan's ``combine`` (np.add,
 * np.logical_or, ...): row 0 with row 1, then the result with each next row. These loops do
 * the same operations in the same order on the same types, so a rank that reduces here and
 * one that reduces in NumPy get the same bits. Integers wrap as NumPy's do (the arithmetic
 * is done unsigned); bools combine as NumPy's logical ufuncs (SUM and MAX are or, PROD and
 * MIN and, as in `_core/dtypes.py`). MAX and MIN of float32 and float64 reduce their
 * OrderedKeys (keys.c), as MPI does on the other paths. Only the (dtype, op) pairs below have
 * a loop.
 */
#include "native.h"

#include <string.h>

/* ReduceOperation codes as lane.py passes them (MEAN reduces as SUM, then divides). */
enum { OP_SUM = 1, OP_PROD = 2, OP_MAX = 3, OP_MIN = 4, OP_BAND = 5, OP_BOR = 6, OP_BXOR = 7 };

/* Element classes; a loop's kind is class * 8 + op. */
enum { C_BOOL = 1, C_I8, C_I16, C_I32, C_I64, C_U8, C_U16, C_U32, C_U64, C_F32, C_F64, C_C64, C_C128 };

/* The class of an integer of `size` bytes (0 for none). */
static int int_class(size_t size, int is_signed) {
    switch (size) {
    case 1: return is_signed ? C_I8 : C_U8;
    case 2: return is_signed ? C_I16 : C_U16;
    case 4: return is_signed ? C_I32 : C_U32;
    case 8: return is_signed ? C_I64 : C_U64;
    default: return 0;
    }
}

/* No Python call: MPI calls the large groups' check op (check.c) without the GIL. */
static int class_of(int type_num) {
    switch (type_num) {
    case NPY_BOOL: return C_BOOL;
    case NPY_FLOAT: return C_F32;
    case NPY_DOUBLE: return C_F64;
    case NPY_CFLOAT: return C_C64;
    case NPY_CDOUBLE: return C_C128;
    case NPY_BYTE: return int_class(sizeof(signed char), 1);
    case NPY_UBYTE: return int_class(sizeof(unsigned char), 0);
    case NPY_SHORT: return int_class(sizeof(short), 1);
    case NPY_USHORT: return int_class(sizeof(unsigned short), 0);
    case NPY_INT: return int_class(sizeof(int), 1);
    case NPY_UINT: return int_class(sizeof(unsigned int), 0);
    case NPY_LONG: return int_class(sizeof(long), 1);
    case NPY_ULONG: return int_class(sizeof(unsigned long), 0);
    case NPY_LONGLONG: return int_class(sizeof(long long), 1);
    case NPY_ULONGLONG: return int_class(sizeof(unsigned long long), 0);
    default: return 0;
    }
}

int rows_pairwise(int kind) {
    int cls = kind / 8, op_code = kind % 8;
    return kind >= 0 && !((cls == C_F32 || cls == C_F64) && (op_code == OP_MAX || op_code == OP_MIN));
}

int rows_kind(int type_num, int op_code) {
    int cls = class_of(type_num);
    if (cls == 0 || op_code < OP_SUM || op_code > OP_BXOR) return -1;
    int floating = cls >= C_F32;
    int extremum = op_code == OP_MAX || op_code == OP_MIN;
    if ((cls == C_F32 || cls == C_F64) && extremum) return cls * 8 + op_code; /* through keys */
    if (floating && op_code != OP_SUM && op_code != OP_PROD) return -1;
    if ((cls == C_C64 || cls == C_C128) && op_code != OP_SUM) return -1;  /* complex products: NumPy's formula */
    return cls * 8 + op_code;
}

#define PAYLOAD(rows, index, row_bytes, header) ((const void *)((rows) + (size_t)(index) * (row_bytes) + (header)))

/* out = a op b, element by element, for `count` elements of type T (U: its unsigned twin). */
#define INT_LOOP(T, U, op_code)                                                        \
    do {                                                                               \
        T *o = out;                                                                    \
        const T *x = a, *y = b;                                                        \
        for (Py_ssize_t i = 0; i < count; i++) {                                       \
            T p = x[i], q = y[i];                                                      \
            switch (op_code) {                                                         \
            case OP_SUM: o[i] = (T)((U)p + (U)q); break;                               \
            case OP_PROD: o[i] = (T)((U)p * (U)q); break;                              \
            case OP_MAX: o[i] = p > q ? p : q; break;                                  \
            case OP_MIN: o[i] = p < q ? p : q; break;                                  \
            case OP_BAND: o[i] = p & q; break;                                         \
            case OP_BOR: o[i] = p | q; break;                                          \
            default: o[i] = p ^ q; break;                                              \
            }                                                                          \
        }                                                                              \
    } while (0)

#define FLOAT_LOOP(T, op_code)                                                         \
    do {                                                                               \
        T *o = out;                                                                    \
        const T *x = a, *y = b;                                                        \
        if (op_code == OP_SUM)                                                         \
            for (Py_ssize_t i = 0; i < count; i++) o[i] = x[i] + y[i];                 \
        else                                                                           \
            for (Py_ssize_t i = 0; i < count; i++) o[i] = x[i] * y[i];                 \
    } while (0)

static void bool_loop(int op_code, unsigned char *o, const unsigned char *x, const unsigned char *y,
                      Py_ssize_t count) {
    for (Py_ssize_t i = 0; i < count; i++) {
        int p = x[i] != 0, q = y[i] != 0;
        switch (op_code) {
        case OP_PROD: case OP_MIN: case OP_BAND: o[i] = (unsigned char)(p && q); break;
        case OP_BXOR: o[i] = (unsigned char)(p != q); break;
        default: o[i] = (unsigned char)(p || q); break;  /* SUM, MAX, BOR */
        }
    }
}

/* One step: out = a op b (out may be a). */
static void combine(int kind, void *out, const void *a, const void *b, Py_ssize_t count) {
    int cls = kind / 8, op_code = kind % 8;
    switch (cls) {
    case C_BOOL: bool_loop(op_code, out, a, b, count); break;
    case C_I8: INT_LOOP(int8_t, uint8_t, op_code); break;
    case C_I16: INT_LOOP(int16_t, uint16_t, op_code); break;
    case C_I32: INT_LOOP(int32_t, uint32_t, op_code); break;
    case C_I64: INT_LOOP(int64_t, uint64_t, op_code); break;
    case C_U8: INT_LOOP(uint8_t, uint8_t, op_code); break;
    case C_U16: INT_LOOP(uint16_t, uint16_t, op_code); break;
    case C_U32: INT_LOOP(uint32_t, uint32_t, op_code); break;
    case C_U64: INT_LOOP(uint64_t, uint64_t, op_code); break;
    case C_F32: FLOAT_LOOP(float, op_code); break;
    case C_F64: FLOAT_LOOP(double, op_code); break;
    case C_C64: FLOAT_LOOP(float, OP_SUM); break;
    case C_C128: FLOAT_LOOP(double, OP_SUM); break;
    default: break;
    }
}

void rows_combine(int kind, void *out, const void *a, const void *b, Py_ssize_t count) {
    int cls = kind / 8;
    combine(kind, out, a, b, (cls == C_C64 || cls == C_C128) ? 2 * count : count);
}

void rows_reduce(int kind, void *out, const char *rows, int size, int row_bytes, int header_bytes,
                 Py_ssize_t count) {
    int cls = kind / 8, op_code = kind % 8;
    if ((cls == C_F32 || cls == C_F64) && (op_code == OP_MAX || op_code == OP_MIN)) {
        keys_rows_reduce(cls == C_F32 ? NPY_FLOAT : NPY_DOUBLE, op_code == OP_MAX, out, rows, size, row_bytes,
                         header_bytes, count);
        return;
    }
    /* Complex sums add real and imaginary parts apart: twice the count of their float. */
    Py_ssize_t elements = (cls == C_C64 || cls == C_C128) ? 2 * count : count;
    combine(kind, out, PAYLOAD(rows, 0, row_bytes, header_bytes), PAYLOAD(rows, 1, row_bytes, header_bytes),
            elements);
    for (int index = 2; index < size; index++)
        combine(kind, out, out, PAYLOAD(rows, index, row_bytes, header_bytes), elements);
}

int divide_in_place(int type_num, void *data, Py_ssize_t count, int size) {
    if (type_num == NPY_FLOAT) {
        float *x = data, n = (float)size;
        for (Py_ssize_t i = 0; i < count; i++) x[i] = x[i] / n;
        return 0;
    }
    if (type_num == NPY_DOUBLE) {
        double *x = data, n = (double)size;
        for (Py_ssize_t i = 0; i < count; i++) x[i] = x[i] / n;
        return 0;
    }
    return -1;
}
