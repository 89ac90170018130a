/* Products against a weight kept as its GGUF blocks: out [T, N] = x [T, K] W^T, W [N, K]
 * stored row by row as the file stores it (each row K / block_size blocks), for
 * decode-sized T (at most MAX_ROWS rows; the caller multiplies larger calls itself).
 *
 * Block layouts (GGML's, little-endian; d, m, dmin are fp16):
 *   Q8_0  34 B / 32:  d, int8 q[32]                          w = d q
 *   Q4_0  18 B / 32:  d, q[16] (value j low nibble, j+16 high) w = d (q - 8)
 *   Q4_1  20 B / 32:  d, m, q[16]                            w = d q + m
 *   Q5_0  22 B / 32:  d, qh[4] (bit j: value j's fifth bit), q[16]   w = d (q - 16)
 *   Q5_1  24 B / 32:  d, m, qh[4], q[16]                     w = d q + m
 *   Q4_K 144 B / 256: d, dmin, scales[12] (8 x 6-bit scale and min), q[128]; four runs
 *                     of 64 values, the low nibbles of 32 bytes then their high nibbles,
 *                     each 32 with its own scale s and min mn: w = d s q - dmin mn
 *   Q5_K 176 B / 256: d, dmin, scales[12], qh[32] (run i's fifth bits: bit i of qh[l]),
 *                     q[128]; as Q4_K with 5-bit codes
 *   Q6_K 210 B / 256: ql[128], qh[64], int8 scales[16], d; two halves of 128 values,
 *                     16 values a scale: w = d s (q - 32)
 *
 * How: threads split the output rows in groups of NR. Decode calls of bf16 x (at most MR
 * rows, with AVX512_BF16; not Q8_0) expand each block of the group's rows to bf16 in
 * registers and multiply it at once (`direct_product`: no scratch round trip, the faster
 * path at one to six rows). Otherwise a group's NR weight rows are
 * expanded into the thread's scratch (each block read once per call; a row of K values
 * stays in L1/L2: bf16 straight from the register expansion with AVX512_BF16, else
 * fp32), then a micro-kernel multiplies MR rows of x at a time with the NR expanded rows,
 * holding MR x NR vectors of fp32 sums in registers; with AVX-512 four x rows' sums are
 * reduced together (`store_sums4`, the same additions as one row's). The
 * expansion has a plain-C form per type (the reference, and the only form on other
 * CPUs), an AVX-512 form for each and an AVX2 form for the 32-value 4- and 5-bit types;
 * the fp32 product is written with GCC vector extensions (zmm with AVX-512, ymm with
 * AVX2, NEON pairs on Arm), -ffast-math contracting `c += a * b` to fused multiply-adds.
 *
 * bf16 x: with AVX512_BF16 the expanded rows are rounded to bf16 (nearest even, the
 * values a model dequantized to bf16 holds) and multiplied pairwise by vdpbf16ps (exact
 * products, fp32 sums); elsewhere x is widened to fp32 and the fp32 product runs. Either
 * way the sums are rounded once to bf16, and x is never quantized.
 *
 * Every output element is summed in one order, whatever T, the thread count or the
 * element's place in the batch: lane-wise over K in steps of the vector width, then the
 * lanes. A row's result is therefore independent of the batch it came in
 * (batch-invariant).
 */
#include <stdlib.h>

/* Sums keep the order written (expand.h): an element's value cannot depend on which
 * inlined copy of the micro-kernel computed it. */
#pragma GCC optimize("no-associative-math")

#include "expand.h" /* and through it common.h: FOR_ROWS_1_TO_6 */

/* ---- plain-C expansion, one block into y (ROW below makes a row of them) --------- */

static inline void blk_q8_0(const uint8_t *b, float *y) {
    const float d = fp16(b);
    for (int j = 0; j < 32; j++) y[j] = d * (float)(int8_t)b[2 + j];
}

static inline void blk_q4_0(const uint8_t *b, float *y) {
    const float d = fp16(b);
    /* low nibbles, then high: one loop each, the form a compiler may vectorise */
    for (int j = 0; j < 16; j++) y[j] = d * (float)((b[2 + j] & 0xf) - 8);
    for (int j = 0; j < 16; j++) y[j + 16] = d * (float)((b[2 + j] >> 4) - 8);
}

static inline void blk_q4_1(const uint8_t *b, float *y) {
    const float d = fp16(b), m = fp16(b + 2);
    for (int j = 0; j < 16; j++) y[j] = d * (float)(b[4 + j] & 0xf) + m;
    for (int j = 0; j < 16; j++) y[j + 16] = d * (float)(b[4 + j] >> 4) + m;
}

static inline void blk_q5_0(const uint8_t *b, float *y) {
    const float d = fp16(b);
    const uint32_t qh = load32(b + 2);
    for (int j = 0; j < 16; j++) /* codes as int: qh is unsigned */
        y[j] = d * (float)((int)((b[6 + j] & 0xf) | ((qh >> j) & 1) << 4) - 16);
    for (int j = 0; j < 16; j++)
        y[j + 16] = d * (float)((int)((b[6 + j] >> 4) | ((qh >> (j + 16)) & 1) << 4) - 16);
}

static inline void blk_q5_1(const uint8_t *b, float *y) {
    const float d = fp16(b), m = fp16(b + 2);
    const uint32_t qh = load32(b + 4);
    for (int j = 0; j < 16; j++)
        y[j] = d * (float)((b[8 + j] & 0xf) | ((qh >> j) & 1) << 4) + m;
    for (int j = 0; j < 16; j++)
        y[j + 16] = d * (float)((b[8 + j] >> 4) | ((qh >> (j + 16)) & 1) << 4) + m;
}

/* Q4_K / Q5_K: run j's 6-bit scale and min from the 12 packed bytes (j < 8) */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xf) | (q[j - 4] >> 6) << 4;
        *mn = (q[j + 4] >> 4) | (q[j] >> 6) << 4;
    }
}

/* runs `run` and run + 1 of a Q4_K / Q5_K block: their factors d s and offsets dmin mn */
static inline void run_factors(const uint8_t *b, int run, float f[4]) {
    const float d = fp16(b), dmin = fp16(b + 2);
    int s0, m0, s1, m1;
    scale_min_k4(run, b + 4, &s0, &m0);
    scale_min_k4(run + 1, b + 4, &s1, &m1);
    f[0] = d * (float)s0, f[1] = dmin * (float)m0, f[2] = d * (float)s1, f[3] = dmin * (float)m1;
}

static inline void blk_q4_k(const uint8_t *b, float *y) {
    const uint8_t *q = b + 16;
    for (int run = 0; run < 8; run += 2, q += 32, y += 64) {
        float f[4];
        run_factors(b, run, f);
        for (int l = 0; l < 32; l++) y[l] = f[0] * (float)(q[l] & 0xf) - f[1];
        for (int l = 0; l < 32; l++) y[32 + l] = f[2] * (float)(q[l] >> 4) - f[3];
    }
}

static inline void blk_q5_k(const uint8_t *b, float *y) {
    const uint8_t *qh = b + 16, *q = b + 48;
    for (int run = 0; run < 8; run += 2, q += 32, y += 64) {
        float f[4];
        run_factors(b, run, f);
        for (int l = 0; l < 32; l++)
            y[l] = f[0] * (float)((q[l] & 0xf) | ((qh[l] >> run) & 1) << 4) - f[1];
        for (int l = 0; l < 32; l++)
            y[32 + l] = f[2] * (float)((q[l] >> 4) | ((qh[l] >> (run + 1)) & 1) << 4) - f[3];
    }
}

static inline void blk_q6_k(const uint8_t *b, float *y) {
    const float d = fp16(b + 208);
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    /* each run of 16 values (one scale) its own loop, so a compiler vectorises it:
     * quarter j of a half takes ql's low (j even) or high nibbles, qh's bits 2j, 2j+1 */
    for (int half = 0; half < 2; half++, ql += 64, qh += 32, sc += 8, y += 128)
        for (int j = 0; j < 4; j++)
            for (int s = 0; s < 2; s++) {
                const float ds = d * (float)sc[s + 2 * j];
                const uint8_t *lo = ql + 32 * (j & 1) + 16 * s, *hi = qh + 16 * s;
                const int shift = 4 * (j >> 1);
                float *out = y + 32 * j + 16 * s;
                for (int l = 0; l < 16; l++)
                    out[l] = ds * (float)((((lo[l] >> shift) & 0xf) |
                                           ((hi[l] >> (2 * j)) & 3) << 4) - 32);
            }
}

/* A row of nb blocks, BYTES each, expanded VALUES floats a block by the block function */
#define ROW(NAME, VALUES, BYTES, BLK)                                                     \
    static void NAME(const uint8_t *b, int64_t nb, float *y) {                             \
        for (int64_t i = 0; i < nb; i++) BLK(b + i * BYTES, y + i * VALUES);               \
    }
#define PLAIN_ROW(ID, t, VALUES, BYTES) ROW(row_##t, VALUES, BYTES, blk_##t)
GGUF_FORMATS(PLAIN_ROW)
#undef PLAIN_ROW

/* ---- AVX-512 expansion: the same values, 16 lanes at a time ------------------------ */
#if HAS_AVX512
/* 16 bytes of codes -> their low and high nibbles as 16 fp32 each */
static inline void nibbles(const uint8_t *q, __m512 *lo, __m512 *hi) {
    const __m128i v = _mm_loadu_si128((const __m128i *)q), mask = _mm_set1_epi8(0xf);
    *lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, mask)));
    *hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), mask)));
}

/* as nibbles, the fifth bits (16 per half) or-ed in as 16 */
static inline void nibbles5(const uint8_t *q, __mmask16 bit_lo, __mmask16 bit_hi, __m512 *lo,
                            __m512 *hi) {
    const __m128i v = _mm_loadu_si128((const __m128i *)q), mask = _mm_set1_epi8(0xf);
    const __m512i sixteen = _mm512_set1_epi32(16);
    __m512i l = _mm512_cvtepu8_epi32(_mm_and_si128(v, mask));
    __m512i h = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), mask));
    *lo = _mm512_cvtepi32_ps(_mm512_mask_or_epi32(l, bit_lo, l, sixteen));
    *hi = _mm512_cvtepi32_ps(_mm512_mask_or_epi32(h, bit_hi, h, sixteen));
}

static inline void blk_q8_0_v(const uint8_t *b, float *y) {
    const __m512 d = _mm512_set1_ps(fp16(b));
    for (int j = 0; j < 2; j++) {
        const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2 + 16 * j));
        _mm512_storeu_ps(y + 16 * j, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))));
    }
}

/* w = d q + c for both halves of a 32-value block */
static inline void store_block(float *y, __m512 lo, __m512 hi, float d, float c) {
    const __m512 dv = _mm512_set1_ps(d), cv = _mm512_set1_ps(c);
    _mm512_storeu_ps(y, _mm512_fmadd_ps(lo, dv, cv));
    _mm512_storeu_ps(y + 16, _mm512_fmadd_ps(hi, dv, cv));
}

/* a 32-value block of 4-bit codes q (with `five`, qh's fifth bits): w = d q + c */
static inline void block32(float *y, const uint8_t *q, uint32_t qh, const int five, float d,
                           float c) {
    __m512 lo, hi;
    if (five)
        nibbles5(q, (__mmask16)qh, (__mmask16)(qh >> 16), &lo, &hi);
    else
        nibbles(q, &lo, &hi);
    store_block(y, lo, hi, d, c);
}

/* 64 values of a Q4_K / Q5_K run pair: q[32] low nibbles (scale d0, min c0), then high */
static inline void run_pair(float *y, const uint8_t *q, const uint8_t *qh, int run, float d0,
                            float c0, float d1, float c1) {
    const __m512 dv0 = _mm512_set1_ps(d0), cv0 = _mm512_set1_ps(-c0);
    const __m512 dv1 = _mm512_set1_ps(d1), cv1 = _mm512_set1_ps(-c1);
    for (int h = 0; h < 2; h++) {
        __m512 lo, hi;
        if (qh) {
            const __m128i bits = _mm_loadu_si128((const __m128i *)(qh + 16 * h));
            nibbles5(q + 16 * h, _mm_test_epi8_mask(bits, _mm_set1_epi8((char)(1 << run))),
                     _mm_test_epi8_mask(bits, _mm_set1_epi8((char)(2 << run))), &lo, &hi);
        } else {
            nibbles(q + 16 * h, &lo, &hi);
        }
        _mm512_storeu_ps(y + 16 * h, _mm512_fmadd_ps(lo, dv0, cv0));
        _mm512_storeu_ps(y + 32 + 16 * h, _mm512_fmadd_ps(hi, dv1, cv1));
    }
}

static inline void blk_k4(const uint8_t *b, float *y, const int five) {
    const uint8_t *qh = five ? b + 16 : 0, *q = b + (five ? 48 : 16);
    for (int run = 0; run < 8; run += 2, q += 32, y += 64) {
        float f[4];
        run_factors(b, run, f);
        run_pair(y, q, qh, run, f[0], f[1], f[2], f[3]);
    }
}

static inline void blk_q4_k_v(const uint8_t *b, float *y) { blk_k4(b, y, 0); }
static inline void blk_q5_k_v(const uint8_t *b, float *y) { blk_k4(b, y, 1); }

/* Q6_K: the 6-bit codes of values 16 s .. 16 s + 15 of each quarter of a half (ql its 64
 * low-nibble bytes, qh its 32 high-bit bytes), quarter j in q[j] */
static inline void q6k_codes(const uint8_t *ql, const uint8_t *qh, int s, __m128i q[4]) {
    const __m128i low4 = _mm_set1_epi8(0xf), low2 = _mm_set1_epi8(3);
    const __m128i a = _mm_loadu_si128((const __m128i *)(ql + 16 * s));
    const __m128i c = _mm_loadu_si128((const __m128i *)(ql + 32 + 16 * s));
    const __m128i h = _mm_loadu_si128((const __m128i *)(qh + 16 * s));
    const __m128i lo[4] = {a, c, _mm_srli_epi16(a, 4), _mm_srli_epi16(c, 4)};
    for (int j = 0; j < 4; j++)
        q[j] = _mm_or_si128(_mm_and_si128(lo[j], low4),
                            _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(h, 2 * j), low2), 4));
}

static inline void blk_q6_k_v(const uint8_t *b, float *y) {
    const float d = fp16(b + 208);
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    for (int half = 0; half < 2; half++, ql += 64, qh += 32, sc += 8, y += 128)
        for (int s = 0; s < 2; s++) { /* 16 values of each quarter: one scale each */
            __m128i q[4];
            q6k_codes(ql, qh, s, q);
            for (int j = 0; j < 4; j++) {
                const float ds = d * (float)sc[s + 2 * j];
                const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q[j]));
                _mm512_storeu_ps(y + 32 * j + 16 * s, _mm512_fmadd_ps(v, _mm512_set1_ps(ds),
                                                                      _mm512_set1_ps(-32.0f * ds)));
            }
        }
}
#endif

/* ---- AVX2 expansion of Q4_0 / Q4_1 / Q5_0 / Q5_1 (the types compilers leave scalar);
 * the others keep their plain-C form, which compilers vectorise ------------------------ */
#if HAS_AVX2
/* 16 codes (bytes) -> d q + c in 16 fp32 */
static inline void store16(float *y, __m128i q, __m256 d, __m256 c) {
    _mm256_storeu_ps(y, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), d, c));
    _mm256_storeu_ps(y + 8, _mm256_fmadd_ps(
                                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8))),
                                d, c));
}

/* bits 0..15 of `bits` as 16 bytes of 16 (set) or 0 */
static inline __m128i fifth_bits(uint32_t bits) {
    const __m128i sel = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
    const __m128i spread = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m128i v = _mm_shuffle_epi8(_mm_cvtsi32_si128((int)bits), spread);
    return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(v, sel), sel), _mm_set1_epi8(16));
}

/* one 32-value block: q[16] nibbles (and, with `five`, qh's fifth bits); w = d q + c */
static inline void block32(float *y, const uint8_t *q, uint32_t qh, const int five, float d,
                           float c) {
    const __m128i v = _mm_loadu_si128((const __m128i *)q), mask = _mm_set1_epi8(0xf);
    __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
    if (five) {
        lo = _mm_or_si128(lo, fifth_bits(qh));
        hi = _mm_or_si128(hi, fifth_bits(qh >> 16));
    }
    const __m256 dv = _mm256_set1_ps(d), cv = _mm256_set1_ps(c);
    store16(y, lo, dv, cv);
    store16(y + 16, hi, dv, cv);
}

#define blk_q8_0_v blk_q8_0
#define blk_q4_k_v blk_q4_k
#define blk_q5_k_v blk_q5_k
#define blk_q6_k_v blk_q6_k
#endif

#if HAS_AVX512 || HAS_AVX2
/* the vector rows: the 32-value 4- and 5-bit types through this build's block32 */
static inline void blk_q4_0_v(const uint8_t *b, float *y) {
    block32(y, b + 2, 0, 0, fp16(b), -8.0f * fp16(b));
}
static inline void blk_q4_1_v(const uint8_t *b, float *y) {
    block32(y, b + 4, 0, 0, fp16(b), fp16(b + 2));
}
static inline void blk_q5_0_v(const uint8_t *b, float *y) {
    block32(y, b + 6, load32(b + 2), 1, fp16(b), -16.0f * fp16(b));
}
static inline void blk_q5_1_v(const uint8_t *b, float *y) {
    block32(y, b + 8, load32(b + 4), 1, fp16(b), fp16(b + 2));
}
#define VECTOR_ROW(ID, t, VALUES, BYTES) ROW(row_##t##_v, VALUES, BYTES, blk_##t##_v)
GGUF_FORMATS(VECTOR_ROW)
#undef VECTOR_ROW
#endif
#undef ROW

typedef void (*row_fn)(const uint8_t *, int64_t, float *);

/* The expansion for `qtype` (the plain-C one when `plain` or without a vector form), its block
 * size and bytes; 0 for a type this file does not know. */
static row_fn expander(int qtype, int plain, int *block, int *bytes) {
#if HAS_AVX512 || HAS_AVX2
#define PICK(fn) (plain ? fn : fn##_v)
#else
#define PICK(fn) ((void)plain, fn)
#endif
    switch (qtype) {
#define CASE(ID, t, VALUES, BYTES) \
    case ID: *block = VALUES, *bytes = BYTES; return PICK(row_##t);
    GGUF_FORMATS(CASE)
#undef CASE
    default: return 0;
    }
#undef PICK
}

/* 1 fp32 x, 2 bf16 x, 4 every expansion is AVX-512's; 0 for an unknown type */
int quant_gguf_available(int qtype) {
    int block, bytes;
    return expander(qtype, 0, &block, &bytes) ? 1 | 2 | (HAS_AVX512 ? 4 : 0) : 0;
}

/* ---- the product: micro() and rows_against() in common.h, the decode path here --------- */

#if HAS_BF16DOT
/* ---- decode calls (rows <= MR): each block expanded to bf16 in registers and multiplied
 * at once, no scratch. The bf16 values are the scratch path's (the same fp32 expansion,
 * rounded by the same vcvtne2ps2bf16 into the same 32-value vectors) and each sum takes
 * them in the same order (32 channels at a time along k), so a row's result is the same
 * bits whichever path its call takes. ---------------------------------------------- */
#define PAIR(lo, hi) ((__m512bh)_mm512_cvtne2ps_pbh((hi), (lo))) /* values lo then hi */

static inline void bf_q8_0(const uint8_t *b, __m512bh *v) {
    const __m512 d = _mm512_set1_ps(fp16(b));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2))));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18))));
    v[0] = PAIR(_mm512_mul_ps(d, lo), _mm512_mul_ps(d, hi));
}

static inline __m512bh dq_pair(__m512 lo, __m512 hi, float d, float c) { /* store_block's */
    const __m512 dv = _mm512_set1_ps(d), cv = _mm512_set1_ps(c);
    return PAIR(_mm512_fmadd_ps(lo, dv, cv), _mm512_fmadd_ps(hi, dv, cv));
}

/* A 4-bit block's 32 values looked up: its 16 possible values d q + c (q = 0..15, each
 * the same fused multiply-add as store_block's, rounded to bf16 alike) as a table, the
 * codes as word indexes into it (vpermw): one multiply-add a block, not two a row. */
static inline __m512bh lookup4(const uint8_t *q, float d, float c) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 t = _mm512_fmadd_ps(iota, _mm512_set1_ps(d), _mm512_set1_ps(c));
    /* the 16 values twice (words 0-15 and 16-31): vpermw reads an index's low five bits,
     * so a low nibble's word (the whole code byte) needs no mask, its bit 4 picking the
     * second copy of the same values */
    const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(t, t);
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)q));
    const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(w), _mm256_srli_epi16(w, 4), 1);
    return (__m512bh)_mm512_permutexvar_epi16(idx, table);
}

static inline void bf_q4_0(const uint8_t *b, __m512bh *v) {
    const float d = fp16(b);
    v[0] = lookup4(b + 2, d, -8.0f * d);
}

static inline void bf_q4_1(const uint8_t *b, __m512bh *v) { v[0] = lookup4(b + 4, fp16(b), fp16(b + 2)); }

static inline void bf_q5_0(const uint8_t *b, __m512bh *v) {
    __m512 lo, hi;
    const float d = fp16(b);
    const uint32_t qh = load32(b + 2);
    nibbles5(b + 6, (__mmask16)qh, (__mmask16)(qh >> 16), &lo, &hi);
    v[0] = dq_pair(lo, hi, d, -16.0f * d);
}

static inline void bf_q5_1(const uint8_t *b, __m512bh *v) {
    __m512 lo, hi;
    const uint32_t qh = load32(b + 4);
    nibbles5(b + 8, (__mmask16)qh, (__mmask16)(qh >> 16), &lo, &hi);
    v[0] = dq_pair(lo, hi, fp16(b), fp16(b + 2));
}

/* run_pair's 64 values as two vectors: the low nibbles' 32, then the high nibbles' */
static inline void bf_k4(const uint8_t *b, __m512bh *v, const int five) {
    const uint8_t *qh = five ? b + 16 : 0, *q = b + (five ? 48 : 16);
    for (int run = 0; run < 8; run += 2, q += 32, v += 2) {
        float f[4];
        run_factors(b, run, f);
        const __m512 dv0 = _mm512_set1_ps(f[0]), cv0 = _mm512_set1_ps(-f[1]);
        const __m512 dv1 = _mm512_set1_ps(f[2]), cv1 = _mm512_set1_ps(-f[3]);
        __m512 lo[2], hi[2];
        for (int h = 0; h < 2; h++) {
            if (five) {
                const __m128i bits = _mm_loadu_si128((const __m128i *)(qh + 16 * h));
                nibbles5(q + 16 * h, _mm_test_epi8_mask(bits, _mm_set1_epi8((char)(1 << run))),
                         _mm_test_epi8_mask(bits, _mm_set1_epi8((char)(2 << run))), &lo[h],
                         &hi[h]);
            } else {
                nibbles(q + 16 * h, &lo[h], &hi[h]);
            }
        }
        v[0] = PAIR(_mm512_fmadd_ps(lo[0], dv0, cv0), _mm512_fmadd_ps(lo[1], dv0, cv0));
        v[1] = PAIR(_mm512_fmadd_ps(hi[0], dv1, cv1), _mm512_fmadd_ps(hi[1], dv1, cv1));
    }
}
static inline void bf_q4_k(const uint8_t *b, __m512bh *v) { bf_k4(b, v, 0); }
static inline void bf_q5_k(const uint8_t *b, __m512bh *v) { bf_k4(b, v, 1); }

/* row_q6_k_v's values: quarter j of each half as one vector (its s = 0 then s = 1 16) */
static inline void bf_q6_k(const uint8_t *b, __m512bh *v) {
    const float d = fp16(b + 208);
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    for (int half = 0; half < 2; half++, ql += 64, qh += 32, sc += 8, v += 4) {
        __m512 f[2][4];
        for (int s = 0; s < 2; s++) {
            __m128i q[4];
            q6k_codes(ql, qh, s, q);
            for (int j = 0; j < 4; j++) {
                const float ds = d * (float)sc[s + 2 * j];
                f[s][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q[j])),
                                          _mm512_set1_ps(ds), _mm512_set1_ps(-32.0f * ds));
            }
        }
        for (int j = 0; j < 4; j++) v[j] = PAIR(f[0][j], f[1][j]);
    }
}

/* out rows [0, R) x the group's ncols weight rows (row_bytes apart), every block
 * expanded once and multiplied with the R rows of x while in registers */
static inline __attribute__((always_inline)) void
direct_group(const uint16_t *x, int64_t ldx, const uint8_t *w, int64_t row_bytes, int64_t nb,
             uint16_t *out, int64_t ldo, int ncols, const int R, const int BLOCK,
             const int BYTES, void (*const blk)(const uint8_t *, __m512bh *)) {
    enum { V = 8 }; /* at most 256 / 32 vectors a block */
    const int nv = BLOCK / 32;
    vf c[MR][NR];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NR; j++) c[r][j] = (vf){0};
    /* a last group's missing rows repeat its first (their sums are not stored) */
    const uint8_t *rowp[NR];
    for (int j = 0; j < NR; j++) rowp[j] = w + (j < ncols ? j : 0) * row_bytes;
    for (int64_t ib = 0; ib < nb; ib++) {
        __m512bh wv[NR][V];
        for (int j = 0; j < NR; j++) {
            _mm_prefetch((const char *)(rowp[j] + (ib + 8) * BYTES), _MM_HINT_T0);
            blk(rowp[j] + ib * BYTES, wv[j]);
        }
        for (int v = 0; v < nv; v++) {
            const int64_t i = ib * BLOCK + 32 * v;
            for (int r = 0; r < R; r++) {
                const __m512bh a = (__m512bh)_mm512_loadu_si512(x + r * ldx + i);
                for (int j = 0; j < NR; j++)
                    c[r][j] = (vf)_mm512_dpbf16_ps((__m512)c[r][j], a, wv[j][v]);
            }
        }
    }
    store_rows(c, out, ldo, ncols, R, 1);
}

static inline __attribute__((always_inline)) void
direct_rows(const uint16_t *x, int64_t rows, int64_t ldx, const uint8_t *w, int64_t row_bytes,
            int64_t nb, uint16_t *out, int64_t ldo, int ncols, const int BLOCK, const int BYTES,
            void (*const blk)(const uint8_t *, __m512bh *)) {
#define DIRECT(RR) direct_group(x, ldx, w, row_bytes, nb, out, ldo, ncols, RR, BLOCK, BYTES, blk)
    FOR_ROWS_1_TO_6(rows, DIRECT);
#undef DIRECT
}

/* One weight row's nb blocks as bf16 in `y` (k values): the blocks expanded in registers,
 * the values direct_group multiplies (and the scratch path's plain-C expansion rounds to) */
typedef void (*bf_row_fn)(const uint8_t *, int64_t, uint16_t *);
#define BF_ROW(NAME, BLOCK, BYTES, FN)                                                       \
    static void NAME(const uint8_t *b, int64_t nb, uint16_t *y) {                           \
        for (int64_t i = 0; i < nb; i++, b += BYTES, y += BLOCK) {                         \
            __m512bh v[BLOCK / 32];                                                         \
            FN(b, v);                                                                       \
            for (int j = 0; j < BLOCK / 32; j++) _mm512_storeu_si512(y + 32 * j, (__m512i)v[j]); \
        }                                                                                   \
    }
#define BF16_ROW(ID, t, VALUES, BYTES) BF_ROW(bf_row_##t, VALUES, BYTES, bf_##t)
GGUF_FORMATS(BF16_ROW)
#undef BF16_ROW
#undef BF_ROW

static bf_row_fn bf_expander(int qtype) {
    switch (qtype) {
#define CASE(ID, t, VALUES, BYTES) case ID: return bf_row_##t;
    GGUF_FORMATS(CASE)
#undef CASE
    default: return 0;
    }
}

/* bf16 x [rows <= MR, k] against the blocks, every thread a share of the groups of NR
 * weight rows; -1 for a type without a register expansion */
static int direct_product(int qtype, const uint16_t *x, int64_t rows, int64_t ldx,
                          const uint8_t *w, int64_t n, int64_t k, uint16_t *out, int64_t ldo,
                          int num_threads) {
    int block, bytes;
    if (!expander(qtype, 0, &block, &bytes) || k % block) return -1;
    const int64_t nb = k / block, row_bytes = nb * bytes, groups = (n + NR - 1) / NR;
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")
    for (int64_t g = 0; g < groups; g++) {
        const int64_t first = g * NR;
        const int ncols = n - first < NR ? (int)(n - first) : NR;
        const uint8_t *wg = w + first * row_bytes;
        uint16_t *o = out + first;
        switch (qtype) {
#define TYPE(Q, BL, BY, FN) \
    case Q: direct_rows(x, rows, ldx, wg, row_bytes, nb, o, ldo, ncols, BL, BY, FN); break;
        TYPE(Q8_0, 32, 34, bf_q8_0)
        TYPE(Q4_0, 32, 18, bf_q4_0)
        TYPE(Q4_1, 32, 20, bf_q4_1)
        TYPE(Q5_0, 32, 22, bf_q5_0)
        TYPE(Q5_1, 32, 24, bf_q5_1)
        TYPE(Q4_K, 256, 144, bf_q4_k)
        TYPE(Q5_K, 256, 176, bf_q5_k)
        TYPE(Q6_K, 256, 210, bf_q6_k)
#undef TYPE
        default: break;
        }
    }
    return 0;
}
#endif

/* A group's rows expanded into `scratch` (NR rows k apart): fp32, or with DOT bf16
 * (through `tmp`, one fp32 row, rounded to nearest even as torch rounds a weight). */
static inline __attribute__((always_inline)) void
expand_group(row_fn expand, const uint8_t *w, int64_t row_bytes, int64_t nb, int64_t k,
             int ncols, void *scratch, float *tmp, const int DOT, const void *bf_expand) {
    for (int j = 0; j < ncols; j++) {
#if HAS_BF16DOT
        if (DOT && bf_expand) { /* straight to bf16, no fp32 row in between */
            ((bf_row_fn)bf_expand)(w + j * row_bytes, nb, (uint16_t *)scratch + j * k);
            continue;
        }
        if (DOT) {
            uint16_t *dst = (uint16_t *)scratch + j * k;
            expand(w + j * row_bytes, nb, tmp);
            for (int64_t i = 0; i < k; i += 32)
                _mm512_storeu_si512(dst + i, (__m512i)_mm512_cvtne2ps_pbh(
                                                 _mm512_loadu_ps(tmp + i + 16),
                                                 _mm512_loadu_ps(tmp + i)));
            continue;
        }
#endif
        (void)tmp, (void)DOT, (void)bf_expand;
        expand(w + j * row_bytes, nb, (float *)scratch + j * k);
    }
}

/* x [rows, k] (row stride ldx; fp32, or bf16 with BF16) against the blocks -> out (row
 * stride ldo, x's dtype). With BF16 and no bf16 dot product in this build, x must already
 * be widened: the caller passes fp32 x and fp32 out (BF16 = 0). */
static inline __attribute__((always_inline)) int
product(int qtype, const void *x, int64_t rows, int64_t ldx, const uint8_t *w, int64_t n,
        int64_t k, void *out, int64_t ldo, int num_threads, int plain, const int BF16) {
    int block, bytes;
    const row_fn expand = expander(qtype, plain, &block, &bytes);
    if (!expand || k % block) return -1;
#if HAS_BF16DOT
    const void *bf_expand = BF16 && !plain ? (const void *)bf_expander(qtype) : 0;
#else
    const void *bf_expand = 0;
#endif
    const int64_t nb = k / block, row_bytes = nb * bytes, groups = (n + NR - 1) / NR;
    const int64_t es = BF16 ? 2 : 4, scratch_bytes = (NR * k * es + 63) / 64 * 64;
    int failed = 0;
    _Pragma("omp parallel num_threads(num_threads) reduction(|:failed)")
    {
        /* NR expanded rows (zeroed: a last group's unused rows hold finite values), and
         * for bf16 one fp32 row */
        char *scratch = aligned_alloc(64, scratch_bytes + (BF16 ? scratch_bytes : 0));
        if (!scratch)
            failed = 1;
        else
            memset(scratch, 0, scratch_bytes);
        _Pragma("omp for schedule(static)")
        for (int64_t g = 0; g < groups; g++) {
            if (!scratch) continue;
            const int64_t first = g * NR;
            const int ncols = n - first < NR ? (int)(n - first) : NR;
            expand_group(expand, w + first * row_bytes, row_bytes, nb, k, ncols, scratch,
                         (float *)(scratch + scratch_bytes), BF16, bf_expand);
            rows_against(x, rows, ldx, scratch, k, (char *)out + first * es, ldo, ncols, BF16);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}

/* x [rows, k] fp32 (row stride ldx) . W^T -> out [rows, n] (row stride ldo); w the
 * blocks, n rows of k / block_size blocks each. plain: use the plain-C expansion (tests).
 * Returns -1 for an unknown type, k not whole blocks, rows > MAX_ROWS or no memory. */
int quant_gguf_f32(int qtype, const float *x, int64_t rows, int64_t ldx, const uint8_t *w,
                   int64_t n, int64_t k, float *out, int64_t ldo, int num_threads, int plain) {
    if (rows > MAX_ROWS) return -1;
    if (rows <= 0 || n <= 0) {
        int block, bytes;
        return expander(qtype, plain, &block, &bytes) ? 0 : -1;
    }
    return product(qtype, x, rows, ldx, w, n, k, out, ldo, num_threads, plain, 0);
}

/* As quant_gguf_f32 for bf16 x and out, the sums rounded once to bf16. With AVX512_BF16
 * the weights are expanded to bf16 (each weight as torch would round it) and multiplied
 * pairwise by vdpbf16ps (products exact, summed in fp32); elsewhere x is widened to fp32
 * and the fp32 product runs. */
int quant_gguf_bf16(int qtype, const uint16_t *x, int64_t rows, int64_t ldx, const uint8_t *w,
                    int64_t n, int64_t k, uint16_t *out, int64_t ldo, int num_threads,
                    int plain) {
    if (rows > MAX_ROWS) return -1;
    if (rows <= 0 || n <= 0) return quant_gguf_f32(qtype, 0, 0, 0, w, n, k, 0, 0, 0, plain);
#if HAS_BF16DOT
    /* Q8_0 decode calls take the scratch too: for Q8_0 the register path is the slower
     * of the two at every decode row count (docs/performance.md) */
    if (!plain && rows <= MR && qtype != Q8_0)
        return direct_product(qtype, x, rows, ldx, w, n, k, out, ldo, num_threads);
    return product(qtype, x, rows, ldx, w, n, k, out, ldo, num_threads, plain, 1);
#else
    float *xf = malloc((size_t)rows * k * 4), *of = malloc((size_t)rows * n * 4);
    int status = -1;
    if (xf && of) {
        widen_rows(x, rows, ldx, k, xf);
        status = product(qtype, xf, rows, k, w, n, k, of, n, num_threads, plain, 0);
        if (status == 0) round_rows(of, rows, n, out, ldo);
    }
    free(xf);
    free(of);
    return status;
#endif
}

/* The blocks of n rows expanded to fp32 out [n, k]: a tile for callers that multiply
 * large T themselves. Returns -1 for an unknown type or k not whole blocks. */
int quant_gguf_dequantize_f32(int qtype, const uint8_t *w, int64_t n, int64_t k, float *out,
                              int num_threads, int plain) {
    int block, bytes;
    const row_fn expand = expander(qtype, plain, &block, &bytes);
    if (!expand || k % block) return -1;
    const int64_t nb = k / block;
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")
    for (int64_t j = 0; j < n; j++) expand(w + j * nb * bytes, nb, out + j * k);
    return 0;
}
