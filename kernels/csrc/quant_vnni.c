/* Integer products against a weight kept as its GGUF blocks, bf16 activations:
 * out [T, N] = x [T, K] W^T with x quantized to int8 per block of 32 values, as
 * llama.cpp's Q8_0 "vec_dot_type", and each block's dot product taken in int32 by
 * vpdpbusd (AVX512_VNNI: unsigned bytes times signed bytes, four at a time). The kernel
 * is written once against vnni.h's vector layer; AVX2 builds take quant_avx2.h's form of
 * that layer (vpmaddubsw, 8 columns a ymm, Q8_0's codes kept signed with no +128
 * offset), which gives the same bits.
 *
 * Block layouts: kernels/csrc/quant_gguf.c. Numerics, for each row of x and each block
 * of 32 channels:
 *   d = amax / 127 (fp32, IEEE division), q = round(x / d) as round(x * (1 / d)) to the
 *   nearest, ties to even (vcvtps2dq), d = 0 giving q = 0; sums of q per 16 values.
 *   Weight codes are taken unsigned (4, 5, 6 bits; Q8_0's int8 codes shifted by +128),
 *   their offset (-8, -16, -32, -128) folded in as offset * sum(q) in the int32 sum.
 *   Per block, per output: acc += float(isum) * (d_w * d_x), and for the types with a
 *   minimum (Q4_1, Q5_1 and the K-quants' sub-block mins) acc += m * (d_x * sum(q)).
 *   Q4_K / Q5_K take d_w = d * scale and m = -dmin * min per sub-block of 32 (fp32
 *   products); Q6_K its two sub-blocks of 16 a block, each with d_w = d * scale.
 * Activations keep one d per 32 values for every type (not llama.cpp's Q8_K, one per
 * 256): the K-quants' sub-block scales then sit in the fp32 factor, not the integer sum.
 *
 * Layout in registers: a zmm holds 16 weight rows (output columns), one a 32-bit lane;
 * a block's codes are transposed 4 bytes at a time as it is expanded (q[i]'s lane c:
 * column c's values 4i..4i+3), so vpdpbusd with one broadcast dword of x adds 4 values
 * of 16 columns, and a unit of 32 values leaves each column's exact int32 sum in its own
 * lane: no reduction across lanes, one fp32 multiply-add a block (two for the minimum,
 * two for Q6_K's halves). Threads split the output columns in chunks of NC = 16 (8 on
 * AVX2). A call of up to RMAX rows expands each block in registers as it comes; a larger
 * call expands a chunk's blocks once into a per-thread scratch and runs RMAX rows of x at
 * a time over it. Repacked blocks (quant_gguf_q8_packed_bf16) are loaded as they lie,
 * every RDIRECT rows with no scratch where REPACKED_DIRECT (AVX-512). The next chunk's
 * bytes, which follow this chunk's in memory, are prefetched in order. A call of many
 * rows runs them a tile at a time (TILE_BYTES of x's codes, kept in L2 while every chunk
 * reads them). An element's value depends on its row of x and its weight row only: the
 * same operations in the same order whatever the row count, the row's place, the tile,
 * the thread count, the path or which R-variant ran it (batch-invariant).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The order of fp32 sums is each element's own (see above) */
#pragma GCC optimize("no-associative-math")

#include "vnni.h"

#define GROUP 16 /* rows a repacked group: quant_gguf_q8_packed_bf16's */

/* Rows of x a pass over repacked blocks expanded in registers takes on AVX-512 (32 zmm):
 * 8 for the 4- and 5-bit types of 32-value blocks (their codes, scale and minimum fit
 * beside 8 accumulators, and each expansion serves twice the rows), RMAX for Q8_0 (its
 * 8-bit codes stream from memory, the head's: measured slower at 8) and the K-quants
 * (two or four units a step). AVX2 builds (16 ymm) go through the scratch past RMAX. */
#if HAS_VNNI
#define RDIRECT_MAX 8
#else
#define RDIRECT_MAX RMAX
#endif
#define RDIRECT(QT) \
    ((QT) == Q4_0 || (QT) == Q4_1 || (QT) == Q5_0 || (QT) == Q5_1 ? RDIRECT_MAX : RMAX)

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

/* values and bytes per block of `qtype`; 0 for a type this file does not know */
static int block_shape(int qtype, int *bytes) {
    switch (qtype) {
    case Q4_0: *bytes = 18; return 32;
    case Q4_1: *bytes = 20; return 32;
    case Q5_0: *bytes = 22; return 32;
    case Q5_1: *bytes = 24; return 32;
    case Q8_0: *bytes = 34; return 32;
    case Q4_K: *bytes = 144; return 256;
    case Q5_K: *bytes = 176; return 256;
    case Q6_K: *bytes = 210; return 256;
    default: return 0;
    }
}

/* 1 where this build has the int8 product for `qtype` */
int quant_gguf_q8_available(int qtype) {
    int bytes;
    return (HAS_VNNI || HAS_AVX2_Q8) && block_shape(qtype, &bytes) ? 1 : 0;
}

#if HAS_VNNI || HAS_AVX2_Q8

/* x quantized: per row k codes, per 32 values d and d * sum(q), per 16 values sum(q) */
typedef struct {
    int8_t *q;
    float *d, *ds;
    int32_t *s16;
    int64_t k;
} xq_t;

/* one row: k bf16 values -> codes, d, d * sum, sums per 16 */
static void quantize_row(const uint16_t *x, int64_t k, int8_t *q, float *d, float *ds,
                         int32_t *s16) {
    for (int64_t u = 0; u < k / 32; u++, x += 32, q += 32) {
        int32_t sa, sb;
        const float dx = quantize_block32(x, q, &sa, &sb);
        d[u] = dx;
        ds[u] = dx * (float)(sa + sb);
        s16[2 * u] = sa, s16[2 * u + 1] = sb;
    }
}

static void quantize_rows(const uint16_t *x, int64_t rows, int64_t ldx, const xq_t *xq) {
    const int64_t k = xq->k, nu = k / 32;
    _Pragma("omp for schedule(static)")
    for (int64_t r = 0; r < rows; r++)
        quantize_row(x + r * ldx, k, xq->q + r * k, xq->d + r * nu, xq->ds + r * nu,
                     xq->s16 + 2 * r * nu);
}

static int alloc_xq(xq_t *xq, int64_t rows, int64_t k) {
    const int64_t nu = k / 32;
    void *tail;
    if (!(xq->q = alloc_codes(rows, k, 4, &tail))) return -1; /* d, ds, two sums of 16 */
    xq->d = tail;
    xq->ds = xq->d + rows * nu;
    xq->s16 = (int32_t *)(xq->ds + rows * nu);
    xq->k = k;
    return 0;
}

_Static_assert(GROUP % NC == 0, "a repacked group is whole chunks");

/* One 32-value unit of NC columns: q[i] holds values 4i..4i+3 of every column (column c
 * in dword c, one value a byte: unsigned codes, Q8_0's signed where CODES8_SIGNED); s =
 * each column's d_w, t its min (Q4_1, Q5_1, K-quants), or for Q6_K the d_w of values
 * 16..31 (s then those of 0..15). */
typedef struct {
    vi q[8];
    vf s, t;
} unit_t;

static inline vi low4(vi v) { return vi_and(v, vi_set8(0xf)); }
static inline vi high4(vi v) { return low4(vi_srl32(v, 4)); }

/* bits 4 i .. 4 i + 3 of each dword of qh as 16 added to the 4 bytes of q */
static inline vi fifth(vi q, vi qh, int i) {
    const vi spread = vi_lanes32(0, 0x04040404, 0x08080808, 0x0c0c0c0c);
    return add16_where(q, vi_shuffle8(vi_srl32(qh, 4 * i), spread), vi_set32(0x08040201));
}

/* signed byte `b` of each dword -> fp32 */
static inline vf sbyte(vi v, int b) { return vf_from_i32(vi_sra32(vi_sll32(v, 24 - 8 * b), 24)); }

/* unsigned bits [shift, shift + width) of each dword */
static inline vi bits(vi v, int shift, int mask) { return vi_and(vi_srl32(v, shift), vi_set32(mask)); }

/* A repacked group of GROUP columns' blocks (RP, quant_gguf_q8_packed_bf16): each block's
 * field at byte `off` of width 4 (codes, 4-byte scale words) held at GROUP off as its
 * columns' words side by side, word i of column c at GROUP (off + 4 i) + 4 c; fp16 fields
 * (d, dmin) at GROUP off as GROUP fp16 values. This chunk is the group's part `half`
 * (columns NC half ..). sb: the group's current block. Otherwise the columns' own blocks
 * (col), transposed and gathered as they come. */
static inline void words(const int RP, const int half, const uint8_t *const col[NC],
                         const uint8_t *sb, int64_t off, vi T[4]) {
    if (!RP) {
        transpose_cols(col, off, T);
        return;
    }
    for (int i = 0; i < 4; i++) T[i] = vi_load(sb + GROUP * (off + 4 * i) + 4 * NC * half);
}

static inline vi word(const int RP, const int half, const uint8_t *const col[NC], vi vindex,
                      const uint8_t *sb, int64_t off) {
    return RP ? vi_load(sb + GROUP * off + 4 * NC * half) : gather(col, vindex, off);
}

/* a repacked group's fp16 field at `off` -> fp32 */
static inline vf fp16s(const int half, const uint8_t *sb, int64_t off) {
    return vf_load_fp16(sb + GROUP * off + 2 * NC * half);
}

/* Units per expansion step, steps per block, and the offset folded into the integer sums */
#define UNITS(QT) ((QT) == Q6_K ? 4 : (QT) == Q4_K || (QT) == Q5_K ? 2 : 1)
#define STEPS(QT) ((QT) == Q6_K ? 2 : (QT) == Q4_K || (QT) == Q5_K ? 4 : 1)
#define OFFSET(QT) \
    ((QT) == Q4_0 ? 8 : (QT) == Q5_0 ? 16 : (QT) == Q8_0 && !CODES8_SIGNED ? 128 : (QT) == Q6_K ? 32 : 0)
#define HAS_MIN(QT) ((QT) == Q4_1 || (QT) == Q5_1 || (QT) == Q4_K || (QT) == Q5_K)

/* Units [step * UNITS, (step + 1) * UNITS) of the NC columns' blocks (col: each column's
 * current block) */
static inline __attribute__((always_inline)) void
expand(const int QT, const int RP, const int half, const uint8_t *const col[NC], const uint8_t *sb,
       vi vindex, int step, unit_t *u) {
    vi T[4], U[4];
#define WORD(off) word(RP, half, col, vindex, sb, off)
    if (QT == Q4_0 || QT == Q4_1 || QT == Q5_0 || QT == Q5_1) {
        const int qoff = QT == Q4_0 ? 2 : QT == Q4_1 ? 4 : QT == Q5_0 ? 6 : 8;
        words(RP, half, col, sb, qoff, T);
        for (int i = 0; i < 4; i++) u->q[i] = low4(T[i]), u->q[4 + i] = high4(T[i]);
        if (QT == Q5_0 || QT == Q5_1) {
            const vi qh = WORD(QT == Q5_0 ? 2 : 4);
            for (int i = 0; i < 8; i++) u->q[i] = fifth(u->q[i], qh, i);
        }
        if (RP) {
            u->s = fp16s(half, sb, 0);
            u->t = HAS_MIN(QT) ? fp16s(half, sb, 2) : vf_zero();
        } else {
            const vi g = gather(col, vindex, 0);
            u->s = halves(g, 0);
            u->t = HAS_MIN(QT) ? halves(g, 1) : vf_zero();
        }
    } else if (QT == Q8_0) {
        const vi flip = vi_set8((char)0x80); /* signed codes -> unsigned, +128 */
        words(RP, half, col, sb, 2, T);
        words(RP, half, col, sb, 18, U);
        for (int i = 0; i < 4; i++)
            u->q[i] = CODES8_SIGNED ? T[i] : vi_xor(T[i], flip),
            u->q[4 + i] = CODES8_SIGNED ? U[i] : vi_xor(U[i], flip);
        u->s = RP ? fp16s(half, sb, 0) : halves(gather(col, vindex, 0), 0), u->t = vf_zero();
    } else if (QT == Q4_K || QT == Q5_K) { /* step: sub-blocks 2 step, 2 step + 1 */
        const int qoff = (QT == Q5_K ? 48 : 16) + 32 * step;
        words(RP, half, col, sb, qoff, T);
        words(RP, half, col, sb, qoff + 16, U);
        for (int i = 0; i < 4; i++) {
            u[0].q[i] = low4(T[i]), u[0].q[4 + i] = low4(U[i]);
            u[1].q[i] = high4(T[i]), u[1].q[4 + i] = high4(U[i]);
        }
        if (QT == Q5_K) {
            vi H[8];
            words(RP, half, col, sb, 16, H);
            words(RP, half, col, sb, 32, H + 4);
            for (int j = 0; j < 2; j++) {
                const vi bit = vi_set8((char)(1 << (2 * step + j)));
                for (int i = 0; i < 8; i++) u[j].q[i] = add16_where(u[j].q[i], H[i], bit);
            }
        }
        vf d, dmin;
        if (RP) {
            d = fp16s(half, sb, 0), dmin = fp16s(half, sb, 2);
        } else {
            const vi g = gather(col, vindex, 0);
            d = halves(g, 0), dmin = halves(g, 1);
        }
        for (int j = 0; j < 2; j++) { /* sub-block 2 step + j's 6-bit scale and min */
            const int sub = 2 * step + j;
            vi sc, mn;
            if (sub < 4) {
                sc = bits(WORD(4), 8 * sub, 63);
                mn = bits(WORD(8), 8 * sub, 63);
            } else {
                const vi hi = WORD(12);
                sc = vi_or(bits(hi, 8 * (sub - 4), 0xf), vi_sll32(bits(WORD(4), 8 * (sub - 4) + 6, 3), 4));
                mn = vi_or(bits(hi, 8 * (sub - 4) + 4, 0xf), vi_sll32(bits(WORD(8), 8 * (sub - 4) + 6, 3), 4));
            }
            u[j].s = vf_mul(d, vf_from_i32(sc));
            u[j].t = vf_sub(vf_zero(), vf_mul(dmin, vf_from_i32(mn)));
        }
    } else { /* Q6_K, step: the half of 128 values; unit j its quarter j */
        vi L[16], H[8];
        for (int i = 0; i < 4; i++) words(RP, half, col, sb, 64 * step + 16 * i, L + 4 * i);
        words(RP, half, col, sb, 128 + 32 * step, H);
        words(RP, half, col, sb, 128 + 32 * step + 16, H + 4);
        const vf d = RP ? fp16s(half, sb, 208) : halves(gather(col, vindex, 206), 1);
        const vi sc[2] = {WORD(192 + 8 * step), WORD(196 + 8 * step)};
        for (int j = 0; j < 4; j++) {
            for (int i = 0; i < 8; i++) { /* values 4 i.. of the quarter: ql bytes 32 (j & 1) + 4 i */
                const vi lo = L[4 * ((j & 1) * 2 + i / 4) + i % 4];
                const vi hb = vi_and(vi_srl32(H[i], 2 * j), vi_set8(3));
                u[j].q[i] = vi_or(j >> 1 ? high4(lo) : low4(lo), vi_sll32(hb, 4));
            }
            u[j].s = vf_mul(d, sbyte(sc[j >> 1], (2 * j) & 3));
            u[j].t = vf_mul(d, sbyte(sc[j >> 1], (2 * j + 1) & 3));
        }
    }
#undef WORD
}

/* acc + 4 products a dword of the weight codes w and x's codes at p, broadcast */
static inline vi dot_codes(const int QT, vi acc, vi w, const int8_t *p) {
    return QT == Q8_0 ? dot8_at(acc, w, p) : dot4_at(acc, w, p);
}

/* one row's unit against the NC columns: acc += its fp32 terms (the same operations, in
 * the same order, for every row count and path) */
static inline __attribute__((always_inline)) vf
unit_dot(const int QT, const unit_t *u, const xq_t *xq, int64_t row, int64_t unit, vf acc) {
    const int64_t at = row * (xq->k / 32) + unit;
    const int8_t *q = xq->q + row * xq->k + unit * 32;
    const vf dx = vf_set(xq->d[at]);
    const int32_t sa = xq->s16[2 * at], sb = xq->s16[2 * at + 1];
    if (QT == Q6_K) { /* two 16-value halves, each its own scale */
        vi ia = vi_set32(-OFFSET(QT) * sa), ib = vi_set32(-OFFSET(QT) * sb);
        for (int i = 0; i < 4; i++) {
            ia = dot_codes(QT, ia, u->q[i], q + 4 * i);
            ib = dot_codes(QT, ib, u->q[4 + i], q + 16 + 4 * i);
        }
        acc = vf_fma(vf_from_i32(ia), vf_mul(u->s, dx), acc);
        return vf_fma(vf_from_i32(ib), vf_mul(u->t, dx), acc);
    }
    /* two chains of integer sums (exact: their order is free), then one fp32 term */
    vi i0 = OFFSET(QT) ? vi_set32(-OFFSET(QT) * (sa + sb)) : vi_zero();
    vi i1 = vi_zero();
    for (int i = 0; i < 8; i += 2) {
        i0 = dot_codes(QT, i0, u->q[i], q + 4 * i);
        i1 = dot_codes(QT, i1, u->q[i + 1], q + 4 * i + 4);
    }
    acc = vf_fma(vf_from_i32(vi_add32(i0, i1)), vf_mul(u->s, dx), acc);
    if (HAS_MIN(QT)) acc = vf_fma(u->t, vf_set(xq->ds[at]), acc);
    return acc;
}

/* Rows [r0, r0 + R) against the chunk, each block expanded in registers as it comes (sb0:
 * the chunk's repacked group) */
static inline __attribute__((always_inline)) void
micro_direct(const int QT, const int RP, const int R, const xq_t *xq, int64_t r0,
             const uint8_t *const col0[NC], const uint8_t *sb0, int half, vi vindex,
             int64_t nb, int bytes, uint16_t *out, int64_t ldo, int ncols) {
    const int US = UNITS(QT);
    vf acc[RDIRECT_MAX];
    for (int r = 0; r < R; r++) acc[r] = vf_zero();
    /* the next chunk's rows follow this chunk's in memory (NC * nb * bytes of them): a
     * block's worth of them prefetched a block */
    const char *next = (const char *)col0[0] + NC * nb * bytes;
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *col[NC];
        for (int c = 0; c < NC; c++) col[c] = col0[c] + i * bytes;
        for (int64_t b = 0; b < NC * bytes; b += 64) _mm_prefetch(next + i * NC * bytes + b, _MM_HINT_T0);
        for (int step = 0; step < STEPS(QT); step++) {
            unit_t u[4];
            expand(QT, RP, half, col, sb0 + i * GROUP * bytes, vindex, step, u);
            for (int j = 0; j < US; j++)
                for (int r = 0; r < R; r++)
                    acc[r] = unit_dot(QT, &u[j], xq, r0 + r, (i * STEPS(QT) + step) * US + j, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) store_row(out + r * ldo, acc[r], ncols);
}

/* Rows [r0, r0 + R) against the chunk's units expanded beforehand (`units`, nu of them) */
static inline __attribute__((always_inline)) void
micro_units(const int QT, const int R, const xq_t *xq, int64_t r0, const unit_t *units, int64_t nu,
            uint16_t *out, int64_t ldo, int ncols) {
    vf acc[RMAX];
    for (int r = 0; r < R; r++) acc[r] = vf_zero();
    for (int64_t unit = 0; unit < nu; unit++)
        for (int r = 0; r < R; r++) acc[r] = unit_dot(QT, &units[unit], xq, r0 + r, unit, acc[r]);
    for (int r = 0; r < R; r++) store_row(out + r * ldo, acc[r], ncols);
}

/* rows [begin, rows) of x against one chunk of NC columns: up to RMAX rows (and
 * repacked blocks where REPACKED_DIRECT) straight from the blocks, more through the
 * chunk's units expanded once into `units` (RP: the chunk is part `half` of the repacked
 * group at sb0) */
static inline __attribute__((always_inline)) void
chunk_rows(const int QT, const int RP, const xq_t *xq, int64_t begin, int64_t rows,
           const uint8_t *const col[NC], const uint8_t *sb0, int half, vi vindex, int64_t nb,
           int bytes, unit_t *units, uint16_t *out, int64_t ldo, int ncols) {
    int64_t r0 = begin; /* rows [begin, rows) of x */
    if (rows - begin <= RMAX || (RP && REPACKED_DIRECT)) {
#define DIRECT(R) \
    micro_direct(QT, RP, R, xq, r0, col, sb0, half, vindex, nb, bytes, out + r0 * ldo, ldo, ncols)
        if (RP && RDIRECT(QT) > RMAX)
            for (; r0 + RDIRECT(QT) <= rows; r0 += RDIRECT(QT)) DIRECT(RDIRECT(QT));
        for (; r0 + RMAX <= rows; r0 += RMAX) DIRECT(RMAX);
        RMAX_CASES(rows - r0, DIRECT)
#undef DIRECT
        return;
    }
    const int US = UNITS(QT);
    const char *next = (const char *)col[0] + NC * nb * bytes; /* as micro_direct */
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *c[NC];
        for (int j = 0; j < NC; j++) c[j] = col[j] + i * bytes;
        for (int64_t b = 0; b < NC * bytes; b += 64) _mm_prefetch(next + i * NC * bytes + b, _MM_HINT_T1);
        for (int step = 0; step < STEPS(QT); step++)
            expand(QT, RP, half, c, sb0 + i * GROUP * bytes, vindex, step,
                   units + (i * STEPS(QT) + step) * US);
    }
    const int64_t nu = xq->k / 32;
    for (; r0 + RMAX <= rows; r0 += RMAX)
        micro_units(QT, RMAX, xq, r0, units, nu, out + r0 * ldo, ldo, ncols);
#define UNITS_(R) micro_units(QT, R, xq, r0, units, nu, out + r0 * ldo, ldo, ncols)
    RMAX_CASES(rows - r0, UNITS_)
#undef UNITS_
}

/* x's codes a tile of rows holds at most: every chunk runs over a tile's rows while they
 * stay in L2 (a prefill's 2,048 rows of 1,536 codes are 3 MiB: read again from L3 for
 * each chunk otherwise) */
#define TILE_BYTES (192 * 1024)

/* rows of x a tile: a multiple of RDIRECT_MAX, all of them for a decode-sized call */
static int64_t row_tile(int64_t rows, int64_t k) {
    int64_t tile = TILE_BYTES / k / RDIRECT_MAX * RDIRECT_MAX;
    if (tile < RDIRECT_MAX) tile = RDIRECT_MAX;
    return rows < tile ? rows : tile;
}

/* packed: w's whole groups of GROUP rows repacked (quant_gguf_q8_packed_bf16), GROUP / NC
 * chunks a group. Each thread takes the same chunks in every tile of rows (a static
 * schedule over the same count), so no tile waits for another. */
static int all_chunks(int qtype, int packed, const xq_t *xq, int64_t rows, const uint8_t *w,
                      int64_t n, int64_t nb, int bytes, uint16_t *out, int64_t ldo) {
    const int64_t row_bytes = nb * bytes, chunks = (n + NC - 1) / NC;
    const int64_t tile = row_tile(rows, xq->k);
    /* a thread's units of one chunk, for tiles of more than RMAX rows */
    unit_t *units = tile > RMAX ? aligned_alloc(64, (size_t)(xq->k / 32) * sizeof(unit_t)) : 0;
    const int failed = tile > RMAX && !units; /* still takes part in the omp for */
    for (int64_t t0 = 0; t0 < rows; t0 += tile) {
        const int64_t t1 = rows - t0 < tile ? rows : t0 + tile;
        _Pragma("omp for schedule(static) nowait") /* the parallel region's end waits */
        for (int64_t ch = 0; ch < chunks; ch++) {
            if (failed) continue;
            const int64_t first = ch * NC;
            const int ncols = n - first < NC ? (int)(n - first) : NC;
            const uint8_t *col[NC];
            int32_t offsets[NC];
            for (int c = 0; c < NC; c++) { /* a last chunk's missing columns: its last */
                offsets[c] = (int32_t)((c < ncols ? c : ncols - 1) * row_bytes);
                col[c] = w + first * row_bytes + offsets[c];
            }
            const vi vindex = vi_load(offsets);
            uint16_t *o = out + first;
            /* a last partial group stays as stored */
            const int64_t group = first / GROUP * GROUP;
            const int rp = packed && group + GROUP <= n, half = (int)(first - group) / NC;
            const uint8_t *sb0 = w + group * row_bytes;
            switch (qtype * 2 + rp) {
#define TYPE(Q)                                                                          \
    case 2 * Q:                                                                          \
        chunk_rows(Q, 0, xq, t0, t1, col, sb0, half, vindex, nb, bytes, units, o, ldo,   \
                   ncols);                                                               \
        break;                                                                           \
    case 2 * Q + 1:                                                                      \
        chunk_rows(Q, 1, xq, t0, t1, col, sb0, half, vindex, nb, bytes, units, o, ldo,   \
                   ncols);                                                               \
        break;
            TYPE(Q4_0) TYPE(Q4_1) TYPE(Q5_0) TYPE(Q5_1) TYPE(Q8_0) TYPE(Q4_K) TYPE(Q5_K)
            TYPE(Q6_K)
#undef TYPE
            default: break;
            }
        }
    }
    free(units);
    return failed;
}
#endif

static int multiply(int qtype, int packed, const uint16_t *x, int64_t rows, int64_t ldx,
                    const uint8_t *w, int64_t n, int64_t k, uint16_t *out, int64_t ldo,
                    int num_threads) {
    int bytes;
    const int block = block_shape(qtype, &bytes);
    if (!(HAS_VNNI || HAS_AVX2_Q8) || !block || k % block) return -1;
    if (rows <= 0 || n <= 0) return 0;
#if HAS_VNNI || HAS_AVX2_Q8
    xq_t xq;
    if (alloc_xq(&xq, rows, k)) return -1;
    QUANTIZE_THEN_MULTIPLY(quantize_rows, xq, x, rows, ldx, k, num_threads,
                           all_chunks(qtype, packed, &xq, rows, w, n, k / block, bytes, out, ldo));
#else
    (void)packed, (void)x, (void)ldx, (void)w, (void)out, (void)ldo, (void)num_threads;
    return -1;
#endif
}

/* x [rows, k] bf16 (row stride ldx) . W^T -> out [rows, n] bf16 (row stride ldo), by int8
 * products (see the top of this file). Any row count. Returns -1 for an unknown type, k
 * not whole blocks, a build without AVX512_VNNI or AVX2 or no memory. */
int quant_gguf_q8_bf16(int qtype, const uint16_t *x, int64_t rows, int64_t ldx,
                       const uint8_t *w, int64_t n, int64_t k, uint16_t *out, int64_t ldo,
                       int num_threads) {
    return multiply(qtype, 0, x, rows, ldx, w, n, k, out, ldo, num_threads);
}

/* 1 where this build multiplies `qtype`'s repacked blocks */
int quant_gguf_q8_packed_available(int qtype) { return quant_gguf_q8_available(qtype); }

/* quant_gguf_q8_bf16 with w repacked (kernels/quant_vnni.py's pack_blocks): each whole
 * group of 16 rows (output columns) holds, block by block, its 16 rows' blocks with each
 * field interleaved (the 16 rows' fp16 scales side by side, then their codes 4 bytes a
 * row at a time: the layout the kernel's registers take, so no transpose or gather runs);
 * a last group of fewer rows stays as stored. The same bytes, the same results bit for
 * bit. -1 as quant_gguf_q8_bf16. (AVX2 builds read a group as two chunks of 8 rows.) */
int quant_gguf_q8_packed_bf16(int qtype, const uint16_t *x, int64_t rows, int64_t ldx,
                              const uint8_t *w, int64_t n, int64_t k, uint16_t *out,
                              int64_t ldo, int num_threads) {
    return multiply(qtype, 1, x, rows, ldx, w, n, k, out, ldo, num_threads);
}

/* The repacked layout's fields a block: (byte offset, bytes, interleave width), in order
 * (kernels/quant_vnni.py's FIELDS); a row of zeros ends a type's list */
static const int FIELDS[][5][3] = {
    [Q4_0] = {{0, 2, 2}, {2, 16, 4}},
    [Q4_1] = {{0, 2, 2}, {2, 2, 2}, {4, 16, 4}},
    [Q5_0] = {{0, 2, 2}, {2, 4, 4}, {6, 16, 4}},
    [Q5_1] = {{0, 2, 2}, {2, 2, 2}, {4, 4, 4}, {8, 16, 4}},
    [Q8_0] = {{0, 2, 2}, {2, 32, 4}},
    [Q4_K] = {{0, 2, 2}, {2, 2, 2}, {4, 140, 4}},
    [Q5_K] = {{0, 2, 2}, {2, 2, 2}, {4, 172, 4}},
    [Q6_K] = {{0, 208, 4}, {208, 2, 2}},
};
/* w [rows, k / block * bytes] repacked in place (unpack: back to the blocks as stored),
 * one group of GROUP rows at a time through a scratch copy of it; the last rows % GROUP
 * rows untouched. -1 for an unknown type, k not whole blocks or no memory. */
int quant_gguf_q8_repack(int qtype, uint8_t *w, int64_t rows, int64_t k, int unpack) {
    int bytes;
    const int block = block_shape(qtype, &bytes);
    if (!block || k % block || rows < 0) return -1;
    const int64_t nb = k / block, row_bytes = nb * bytes;
    uint8_t *scratch = malloc((size_t)(GROUP * row_bytes) + 1);
    if (!scratch) return -1;
    for (int64_t g = 0; g + GROUP <= rows; g += GROUP) {
        uint8_t *group = w + g * row_bytes;
        memcpy(scratch, group, (size_t)(GROUP * row_bytes));
        for (int64_t i = 0; i < nb; i++) {
            uint8_t *packed = (unpack ? scratch : group) + i * GROUP * bytes;
            uint8_t *stored = (unpack ? group : scratch) + i * bytes;
            for (int f = 0; FIELDS[qtype][f][1]; f++) {
                const int off = FIELDS[qtype][f][0], len = FIELDS[qtype][f][1];
                const int width = FIELDS[qtype][f][2];
                for (int word = 0; word < len / width; word++)
                    for (int c = 0; c < GROUP; c++) {
                        uint8_t *p = packed + GROUP * off + (word * GROUP + c) * width;
                        uint8_t *r = stored + c * row_bytes + off + word * width;
                        uint8_t *to = unpack ? r : p, *from = unpack ? p : r;
                        if (width == 4) memcpy(to, from, 4); /* constant sizes: moves */
                        else memcpy(to, from, 2);
                    }
            }
        }
    }
    free(scratch);
    return 0;
}

/* Rows `ids` (count of them) of w [n, k / block * bytes], its whole groups of GROUP rows
 * repacked (quant_gguf_q8_repack's layout), as stored: out [count, k / block * bytes]. A
 * row of a repacked group is gathered field by field from its lane of each block's
 * interleaved fields; a row of the last partial group is copied. An embedding table
 * repacked for the head it is tied to is looked up this way. -1 for an unknown type, k
 * not whole blocks or an id outside [0, n). */
int quant_gguf_q8_packed_rows(int qtype, const uint8_t *w, int64_t n, int64_t k,
                              const int64_t *ids, int64_t count, uint8_t *out) {
    int bytes;
    const int block = block_shape(qtype, &bytes);
    if (!block || k % block || n < 0 || count < 0) return -1;
    for (int64_t j = 0; j < count; j++)
        if (ids[j] < 0 || ids[j] >= n) return -1;
    const int64_t nb = k / block, row_bytes = nb * bytes, whole = n / GROUP * GROUP;
    for (int64_t j = 0; j < count; j++) {
        const int64_t id = ids[j];
        uint8_t *row = out + j * row_bytes;
        if (id >= whole) {
            memcpy(row, w + id * row_bytes, (size_t)row_bytes);
            continue;
        }
        const uint8_t *group = w + id / GROUP * GROUP * row_bytes;
        const int c = (int)(id % GROUP);
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *packed = group + i * GROUP * bytes;
            uint8_t *stored = row + i * bytes;
            for (int f = 0; FIELDS[qtype][f][1]; f++) {
                const int off = FIELDS[qtype][f][0], len = FIELDS[qtype][f][1];
                const int width = FIELDS[qtype][f][2];
                for (int word = 0; word < len / width; word++) {
                    const uint8_t *from = packed + GROUP * off + (word * GROUP + c) * width;
                    if (width == 4) memcpy(stored + off + word * width, from, 4);
                    else memcpy(stored + off + word * width, from, 2);
                }
            }
        }
    }
    return 0;
}

/* x's quantization alone (tests): codes q [rows, k] and d [rows, k / 32]. -1 without
 * AVX512_VNNI or AVX2, k not a multiple of 32 or no memory. */
int quant_gguf_q8_quantize_bf16(const uint16_t *x, int64_t rows, int64_t ldx, int64_t k,
                                int8_t *q, float *d) {
    if (!(HAS_VNNI || HAS_AVX2_Q8) || k % 32 || rows < 0) return -1;
#if HAS_VNNI || HAS_AVX2_Q8
    xq_t xq;
    if (alloc_xq(&xq, rows > 0 ? rows : 1, k)) return -1;
    quantize_rows(x, rows, ldx, &xq);
    memcpy(q, xq.q, (size_t)(rows * k));
    memcpy(d, xq.d, (size_t)(rows * (k / 32)) * 4);
    free(xq.q);
    return 0;
#else
    (void)x, (void)ldx, (void)q, (void)d;
    return -1;
#endif
}
