/* Integer products against a group-quantized weight (docs/quantization.md), bf16
 * activations: out [T, N] = x [T, K] W^T with x quantized to int8 per block of 32 values,
 * as llama.cpp's Q8_0 and kernels/csrc/quant_vnni.c do it, and each block's dot product
 * taken in int32 by vpdpbusd (AVX512_VNNI: unsigned bytes times signed bytes, four at a
 * time). The kernel is written once against vnni.h's vector layer; AVX2 builds take
 * quant_avx2.h's form of that layer (vpmaddubsw, 8 columns a ymm, int8 codes c taken
 * signed as c - 128 with the zero point's factor 128 - zero), which gives the same bits.
 *
 * Weight: W[o, i] = (q[o, i] - zero[o, i / g]) * scale[o, i / g], g = 32, 64 or 128; codes
 * q uint8, int8 one a byte [N, K], int4 two a byte [N, K / 2] in runs of 32 channels (byte
 * k: channel k low nibble, k + 16 high, GGUF Q4_0's order); scale fp16 [N, K / g]; zero
 * uint8 [N, K / g] or none (symmetric: 128 for int8, 8 for int4).
 *
 * Numerics, for each row of x and each block b of 32 channels (group g = b * 32 / g):
 *   d = amax / 127 (fp32, IEEE division), q = round(x * (1 / d)) to the nearest, ties to
 *   even (vcvtps2dq), d = 0 giving q = 0: bit for bit quant_vnni.c's quantization;
 *   isum = sum (q_w - zero) * q_x, exact in int32 (the codes unsigned in vpdpbusd, the zero
 *   point folded in as -zero * sum(q_x));
 *   acc = fma(float(isum), scale * d, acc) in fp32, blocks in ascending order from 0;
 * then acc is rounded once to bf16 (nearest even).
 *
 * Layout in registers (quant_vnni.c's): a zmm holds 16 weight rows (output columns), one a
 * 32-bit lane; a unit of 32 channels is transposed 4 bytes at a time as it is expanded, so
 * vpdpbusd with one broadcast dword of x adds 4 values of 16 columns and each column's
 * int32 sum stays in its own lane. Threads split the output columns in chunks of NC = 16
 * (8 on AVX2); a chunk's scales and zero points are transposed to per-group vectors
 * first. A call of up to RMAX rows expands each unit in registers as it comes; a larger
 * call expands the chunk's units once into a per-thread scratch and runs RMAX rows of x
 * at a time over it. An element's value depends on its row of x and its weight row only:
 * the same operations in the same order whatever the row count, the row's place, the
 * thread count or the path (batch-invariant).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The order of fp32 sums is each element's own (see above) */
#pragma GCC optimize("no-associative-math")

#include "vnni.h"

static int valid_format(int bits, int group, int64_t k) {
    return (bits == 4 || bits == 8) && (group == 32 || group == 64 || group == 128) && k > 0 &&
           k % group == 0;
}

/* 1 where this build has the int8 product for int`bits` codes */
int quant_group_q8_available(int bits) {
    return (HAS_VNNI || HAS_AVX2_Q8) && (bits == 4 || bits == 8) ? 1 : 0;
}

#if HAS_VNNI || HAS_AVX2_Q8

/* x quantized: per row k codes, per 32 values d and sum(q) * mult (symmetric weights:
 * mult = the zero point's whole term a sum, see quant_group_q8_bf16; else 1) */
typedef struct {
    int8_t *q;
    float *d;
    int32_t *s;
    int64_t k;
    int32_t mult;
} xq_t;

/* one row: k bf16 values -> codes, d and mult * sum(q) per 32 (the codes and d:
 * quant_vnni.c's quantize_row) */
static void quantize_row(const uint16_t *x, int64_t k, int8_t *q, float *d, int32_t *s,
                         int32_t mult) {
    for (int64_t u = 0; u < k / 32; u++, x += 32, q += 32) {
        int32_t sa, sb;
        d[u] = quantize_block32(x, q, &sa, &sb);
        s[u] = mult * (sa + sb);
    }
}

static void quantize_rows(const uint16_t *x, int64_t rows, int64_t ldx, const xq_t *xq) {
    const int64_t k = xq->k, nu = k / 32;
    _Pragma("omp for schedule(static)")
    for (int64_t r = 0; r < rows; r++)
        quantize_row(x + r * ldx, k, xq->q + r * k, xq->d + r * nu, xq->s + r * nu, xq->mult);
}

static int alloc_xq(xq_t *xq, int64_t rows, int64_t k) {
    void *tail;
    if (!(xq->q = alloc_codes(rows, k, 2, &tail))) return -1; /* d and the sum */
    xq->d = tail;
    xq->s = (int32_t *)(xq->d + rows * (k / 32));
    xq->k = k;
    xq->mult = 1;
    return 0;
}

/* One 32-channel unit of NC columns: q[i] holds channels 4i..4i+3 of every column (column
 * c in dword c, one code a byte: unsigned, int8 codes c as c - 128 where CODES8_SIGNED) */
typedef struct {
    vi q[8];
} unit_t;

/* A chunk's group constants: per group, each column's fp32 scale and its integer sums'
 * zero-point factor (-zero; int8 codes taken signed: 128 - zero) */
typedef struct {
    vf s;
    vi z;
} gconst_t;

/* unit `unit` of the NC columns (col: each column's codes) */
static inline __attribute__((always_inline)) void
expand(const int BITS, const uint8_t *const col[NC], int64_t unit, unit_t *u) {
    vi T[4], U[4];
    if (BITS == 8) {
        const vi flip = vi_set8((char)0x80); /* c -> c - 128 */
        transpose_cols(col, 32 * unit, T);
        transpose_cols(col, 32 * unit + 16, U);
        for (int i = 0; i < 4; i++)
            u->q[i] = CODES8_SIGNED ? vi_xor(T[i], flip) : T[i],
            u->q[4 + i] = CODES8_SIGNED ? vi_xor(U[i], flip) : U[i];
    } else { /* low nibbles: channels 0..15, high: 16..31 */
        const vi mask = vi_set8(0xf);
        transpose_cols(col, 16 * unit, T);
        for (int i = 0; i < 4; i++)
            u->q[i] = vi_and(T[i], mask), u->q[4 + i] = vi_and(vi_srl32(T[i], 4), mask);
    }
}

/* the chunk's columns' scales (fp32) and zero-point factors, group by group */
static void group_consts(int bits, const uint16_t *scales, const uint8_t *zeros, int zero,
                         int64_t groups, const int64_t row[NC], gconst_t *gc) {
    const int shift = bits == 8 && CODES8_SIGNED ? 128 : 0;
    for (int64_t g = 0; g < groups; g++) {
        uint16_t h[NC];
        int32_t z[NC];
        for (int c = 0; c < NC; c++) {
            h[c] = scales[row[c] * groups + g];
            z[c] = shift - (zeros ? zeros[row[c] * groups + g] : zero);
        }
        gc[g].s = vf_load_fp16(h);
        gc[g].z = vi_load(z);
    }
}

/* one row's unit against the NC columns: acc += float(isum) * (scale * d) (the same
 * operations, in the same order, for every row count and path) */
static inline __attribute__((always_inline)) vf
unit_dot(const int BITS, const int SYM, const unit_t *u, const gconst_t *gc, const xq_t *xq,
         int64_t row, int64_t unit, vf acc) {
    const int64_t at = row * (xq->k / 32) + unit;
    const int8_t *q = xq->q + row * xq->k + unit * 32;
    /* two chains of integer sums (exact: their order is free), the first from the zero
     * point's term, factor * sum(q) */
    vi i0 = SYM ? vi_set32(xq->s[at]) : vi_mullo32(gc->z, vi_set32(xq->s[at]));
    vi i1 = vi_zero();
    for (int i = 0; i < 8; i += 2) {
        const vi x0 = bcast32(q + 4 * i), x1 = bcast32(q + 4 * i + 4);
        i0 = BITS == 8 ? dot8(i0, u->q[i], x0) : dot4(i0, u->q[i], x0);
        i1 = BITS == 8 ? dot8(i1, u->q[i + 1], x1) : dot4(i1, u->q[i + 1], x1);
    }
    const vf sd = vf_mul(gc->s, vf_set(xq->d[at]));
    return vf_fma(vf_from_i32(vi_add32(i0, i1)), sd, acc);
}

/* Rows [0, R) against the chunk, each unit expanded in registers as it comes */
static inline __attribute__((always_inline)) void
micro_direct(const int BITS, const int SYM, const int R, const xq_t *xq, const uint8_t *const col[NC],
             const gconst_t *gc, int64_t upg, int64_t row_bytes, uint16_t *out, int64_t ldo,
             int ncols) {
    vf acc[RMAX];
    for (int r = 0; r < R; r++) acc[r] = vf_zero();
    /* the next chunk's rows follow this chunk's in memory: as many of their bytes
     * prefetched a unit as the unit reads of this chunk's */
    const char *next = (const char *)col[0] + NC * row_bytes;
    const int64_t nu = xq->k / 32, ub = BITS * 4; /* bytes a unit of one column */
    for (int64_t unit = 0; unit < nu; unit++) {
        for (int64_t b = 0; b < NC * ub; b += 64) _mm_prefetch(next + unit * NC * ub + b, _MM_HINT_T0);
        unit_t u;
        expand(BITS, col, unit, &u);
        for (int r = 0; r < R; r++) acc[r] = unit_dot(BITS, SYM, &u, &gc[unit / upg], xq, r, unit, acc[r]);
    }
    for (int r = 0; r < R; r++) store_row(out + r * ldo, acc[r], ncols);
}

/* Rows [r0, r0 + R) against the chunk's units expanded beforehand */
static inline __attribute__((always_inline)) void
micro_units(const int BITS, const int SYM, const int R, const xq_t *xq, int64_t r0, const unit_t *units,
            const gconst_t *gc, int64_t upg, uint16_t *out, int64_t ldo, int ncols) {
    vf acc[RMAX];
    for (int r = 0; r < R; r++) acc[r] = vf_zero();
    const int64_t nu = xq->k / 32;
    for (int64_t unit = 0; unit < nu; unit++)
        for (int r = 0; r < R; r++)
            acc[r] = unit_dot(BITS, SYM, &units[unit], &gc[unit / upg], xq, r0 + r, unit, acc[r]);
    for (int r = 0; r < R; r++) store_row(out + r * ldo, acc[r], ncols);
}

/* every row of x against one chunk of NC columns */
static inline __attribute__((always_inline)) void
chunk_rows(const int BITS, const int SYM, const xq_t *xq, int64_t rows, const uint8_t *const col[NC],
           const gconst_t *gc, int64_t upg, int64_t row_bytes, unit_t *units, uint16_t *out,
           int64_t ldo, int ncols) {
    int64_t r0 = 0;
    if (rows <= RMAX) {
#define DIRECT(R) micro_direct(BITS, SYM, R, xq, col, gc, upg, row_bytes, out, ldo, ncols)
        RMAX_CASES(rows - r0, DIRECT)
#undef DIRECT
        return;
    }
    const int64_t nu = xq->k / 32;
    const char *next = (const char *)col[0] + NC * row_bytes; /* as micro_direct */
    for (int64_t unit = 0; unit < nu; unit++) {
        for (int64_t b = 0; b < NC * BITS * 4; b += 64)
            _mm_prefetch(next + unit * NC * BITS * 4 + b, _MM_HINT_T1);
        expand(BITS, col, unit, &units[unit]);
    }
    for (; r0 + RMAX <= rows; r0 += RMAX)
        micro_units(BITS, SYM, RMAX, xq, r0, units, gc, upg, out + r0 * ldo, ldo, ncols);
#define UNITS_(R) micro_units(BITS, SYM, R, xq, r0, units, gc, upg, out + r0 * ldo, ldo, ncols)
    RMAX_CASES(rows - r0, UNITS_)
#undef UNITS_
}

typedef struct {
    int bits, group;
    const uint8_t *q;
    const uint16_t *s;
    const uint8_t *z;
    int64_t n, k;
} weight_t;

static int all_chunks(const weight_t *W, const xq_t *xq, int64_t rows, uint16_t *out, int64_t ldo) {
    const int64_t row_bytes = W->k * W->bits / 8, chunks = (W->n + NC - 1) / NC;
    const int64_t groups = W->k / W->group, upg = W->group / 32;
    /* a thread's group constants of one chunk, and its units for calls of more than RMAX
     * rows */
    const size_t unit_bytes = rows > RMAX ? (size_t)(W->k / 32) * sizeof(unit_t) : 0;
    char *mem = aligned_alloc(64, unit_bytes + (size_t)groups * sizeof(gconst_t));
    const int failed = !mem; /* still takes part in the omp for */
    unit_t *units = (unit_t *)mem;
    gconst_t *gc = (gconst_t *)(mem + unit_bytes);
    _Pragma("omp for schedule(static) nowait") /* the parallel region's end waits */
    for (int64_t ch = 0; ch < chunks; ch++) {
        if (failed) continue;
        const int64_t first = ch * NC;
        const int ncols = W->n - first < NC ? (int)(W->n - first) : NC;
        const uint8_t *col[NC];
        int64_t row[NC];
        for (int c = 0; c < NC; c++) { /* a last chunk's missing columns repeat its last one */
            row[c] = first + (c < ncols ? c : ncols - 1);
            col[c] = W->q + row[c] * row_bytes;
        }
        group_consts(W->bits, W->s, W->z, W->bits == 8 ? 128 : 8, groups, row, gc);
        uint16_t *o = out + first;
#define CHUNK(B, S) chunk_rows(B, S, xq, rows, col, gc, upg, row_bytes, units, o, ldo, ncols)
        if (W->bits == 8)
            W->z ? CHUNK(8, 0) : CHUNK(8, 1);
        else
            W->z ? CHUNK(4, 0) : CHUNK(4, 1);
#undef CHUNK
    }
    free(mem);
    return failed;
}
#endif

/* x [rows, k] bf16 (row stride ldx) . W^T -> out [rows, n] bf16 (row stride ldo), by int8
 * products (see the top of this file); W the codes q, scales s and zero points z (0:
 * symmetric) of n rows. Any row count. Returns -1 for bits other than 4 / 8, a group size
 * other than 32 / 64 / 128, k not whole groups, a build without AVX512_VNNI or AVX2 or no
 * memory. */
int quant_group_q8_bf16(int bits, int group, const uint16_t *x, int64_t rows, int64_t ldx,
                        const uint8_t *q, const uint16_t *s, const uint8_t *z, int64_t n,
                        int64_t k, uint16_t *out, int64_t ldo, int num_threads) {
    if (!(HAS_VNNI || HAS_AVX2_Q8) || !valid_format(bits, group, k)) return -1;
    if (rows <= 0 || n <= 0) return 0;
#if HAS_VNNI || HAS_AVX2_Q8
    xq_t xq;
    if (alloc_xq(&xq, rows, k)) return -1;
    const weight_t W = {bits, group, q, s, z, n, k};
    /* symmetric: the zero point's whole term, -zero (int8 codes taken signed: 128 - 128) */
    if (!z) xq.mult = bits == 8 ? (CODES8_SIGNED ? 0 : -128) : -8;
    QUANTIZE_THEN_MULTIPLY(quantize_rows, xq, x, rows, ldx, k, num_threads,
                           all_chunks(&W, &xq, rows, out, ldo));
#else
    (void)x, (void)ldx, (void)q, (void)s, (void)z, (void)out, (void)ldo, (void)num_threads;
    return -1;
#endif
}
