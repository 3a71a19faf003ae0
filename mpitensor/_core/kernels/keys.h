/* MAX and MIN of floats through integer keys, as `_core.dtypes.OrderedKeys` maps them.
 *
 * MPI reduces MAX/MIN of float32 and float64 as signed integer keys that order like the
 * floats: the key of bit pattern `s` is `s` for a positive sign and `s ^ 0x7f..f` for a
 * negative one, and every NaN gets the key of one canonical NaN (a positive quiet NaN, above
 * every other key, for MAX; a negative one, below every other, for MIN). The map is its own
 * inverse. These loops give OrderedKeys' bits, and `keys_extremum` those of `Extremum`
 * (the float whose key is the larger, or smaller, of the operands' keys), so compiled and
 * NumPy code meet in MPI and agree bit for bit.
 *
 * Header-only: the transports' kernels (`_core/kernels/keys.c`) and the compiled lane
 * (`_collectives/native/keys.c`) each compile it.
 */
#ifndef MPITENSOR_KEYS_H
#define MPITENSOR_KEYS_H

#include <stdint.h>

/* Branch-free, so that the loops vectorize: a negative pattern's non-sign bits are flipped
 * (the arithmetic shift spreads the sign bit, the logical one drops it from the mask). */
#define KEYS_FLIP(U, S, b) ((b) ^ ((U)((S)(b) >> (8 * sizeof(U) - 1)) >> 1))

#define KEYS_F32_EXP 0x7f800000u
#define KEYS_F32_QUIET 0x7fc00000u
#define KEYS_F64_EXP 0x7ff0000000000000ull
#define KEYS_F64_QUIET 0x7ff8000000000000ull

/* One width's loops: U the bits, S their signed twin, F the float, EXP the infinities' magnitude, QUIET the
 * canonical NaN's positive bits. A NaN (magnitude above EXP) takes the canonical NaN's key. */
#define KEYS_WIDTH(N, U, S, F, EXP, QUIET)                                                                 \
    static inline S keys_nan_key##N(int maximum) {                                                      \
        U negative = (U)QUIET | ((U)1 << (8 * sizeof(U) - 1));                                           \
        return (S)(maximum ? (U)QUIET : KEYS_FLIP(U, S, negative));                                       \
    }                                                                                                   \
    static inline S keys_key##N(U b, S nan_key) {                                                       \
        S key = (S)KEYS_FLIP(U, S, b);                                                                   \
        return (b & ((U)-1 >> 1)) > (U)EXP ? nan_key : key;                                              \
    }                                                                                                   \
    static inline void keys_encode##N(const U *src, S *dst, int64_t count, int maximum) {               \
        S nan_key = keys_nan_key##N(maximum);                                                            \
        for (int64_t i = 0; i < count; i++) dst[i] = keys_key##N(src[i], nan_key);                       \
    }                                                                                                   \
    static inline void keys_decode##N(U *data, int64_t count) {                                          \
        for (int64_t i = 0; i < count; i++) data[i] = KEYS_FLIP(U, S, data[i]);                          \
    }                                                                                                   \
    /* The float whose key is the larger (MAX) or smaller: on the floats themselves, which     \
     * vectorizes at every width. Operands that compare equal merge their bits (AND for MAX,   \
     * so +0.0 wins; OR for MIN, -0.0), as their keys' order picks; a NaN operand gives the     \
     * canonical NaN. */                                                                        \
    static inline void keys_extremum##N(const U *a, const U *b, U *out, int64_t count, int maximum) {   \
        const F *x = (const F *)a, *y = (const F *)b;                                                   \
        U nan = (U)KEYS_FLIP(U, S, (U)keys_nan_key##N(maximum));                                        \
        if (maximum) {                                                                                  \
            for (int64_t i = 0; i < count; i++) {                                                       \
                F p = x[i], q = y[i];                                                                   \
                U r = p > q ? a[i] : b[i];                                                              \
                r = p == q ? (a[i] & b[i]) : r;                                                         \
                out[i] = (p != p || q != q) ? nan : r;                                                  \
            }                                                                                           \
        } else {                                                                                        \
            for (int64_t i = 0; i < count; i++) {                                                       \
                F p = x[i], q = y[i];                                                                   \
                U r = p < q ? a[i] : b[i];                                                              \
                r = p == q ? (a[i] | b[i]) : r;                                                         \
                out[i] = (p != p || q != q) ? nan : r;                                                  \
            }                                                                                           \
        }                                                                                               \
    }

KEYS_WIDTH(32, uint32_t, int32_t, float, KEYS_F32_EXP, KEYS_F32_QUIET)
KEYS_WIDTH(64, uint64_t, int64_t, double, KEYS_F64_EXP, KEYS_F64_QUIET)

/* dst[i] = key of src[i] (dst may be src). `wide`: float64, else float32. The buffers hold
 * floats, read here as bits (aligned, as NumPy's aligned arrays and the check's rows are). */
static inline void keys_encode_loop(int wide, int maximum, const void *src, void *dst, int64_t count) {
    if (wide)
        keys_encode64((const uint64_t *)src, (int64_t *)dst, count, maximum);
    else
        keys_encode32((const uint32_t *)src, (int32_t *)dst, count, maximum);
}

/* data[i] = the float of key data[i], in place. */
static inline void keys_decode_loop(int wide, void *data, int64_t count) {
    if (wide)
        keys_decode64((uint64_t *)data, count);
    else
        keys_decode32((uint32_t *)data, count);
}

/* out[i] = the float whose key is the MAX (or MIN) of the keys of a[i] and b[i]; out may be a or b. */
static inline void keys_extremum_loop(int wide, int maximum, const void *a, const void *b, void *out, int64_t count) {
    if (wide)
        keys_extremum64((const uint64_t *)a, (const uint64_t *)b, (uint64_t *)out, count, maximum);
    else
        keys_extremum32((const uint32_t *)a, (const uint32_t *)b, (uint32_t *)out, count, maximum);
}

#endif
