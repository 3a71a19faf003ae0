/* MAX and MIN of float32 and float64 through OrderedKeys, for the compiled lane (keys.h). */
#if defined(__GNUC__) && !defined(__clang__)
/* The loops vectorize at -O3 (integer selects; no float arithmetic, so nothing is reordered). */
#pragma GCC optimize("O3")
#endif
#include "native.h"

#include "keys.h"

int keys_supported(int type_num) { return type_num == NPY_FLOAT || type_num == NPY_DOUBLE; }

int keys_encode(int type_num, int maximum, const void *src, void *dst, Py_ssize_t count) {
    if (!keys_supported(type_num)) return -1;
    keys_encode_loop(type_num == NPY_DOUBLE, maximum, src, dst, (int64_t)count);
    return 0;
}

int keys_decode(int type_num, void *data, Py_ssize_t count) {
    if (!keys_supported(type_num)) return -1;
    keys_decode_loop(type_num == NPY_DOUBLE, data, (int64_t)count);
    return 0;
}

void keys_rows_reduce(int type_num, int maximum, void *out, const char *rows, int size, int row_bytes, int header,
                      Py_ssize_t count) {
    /* Row 0 with row 1, then the result with each next row, as `Extremum` is applied. */
    int wide = type_num == NPY_DOUBLE;
    keys_extremum_loop(wide, maximum, rows + header, rows + row_bytes + header, out, (int64_t)count);
    for (int index = 2; index < size; index++)
        keys_extremum_loop(wide, maximum, out, rows + (size_t)index * (size_t)row_bytes + header, out, (int64_t)count);
}
