/* Integer products against a weight kept as its GGUF blocks, bf16 activations:
 * out [T, N] = x [T, K] W^T with x quantized to int8 per block of 32 values, as
 * llama.cpp's Q8_0 "vec_dot_type", and each block's dot product taken in int32 by
 * vpdpbusd (AVX512_VNNI: unsigned bytes times signed bytes, four at a time).
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
 * Layout in registers: a zmm holds four weight rows (output columns), 16 codes each per
 * 128-bit lane; x's 16 codes are broadcast to the four lanes, so vpdpbusd leaves four
 * int32 partial sums per column. Those are converted and accumulated in fp32 per lane,
 * and each column's four lanes are added at the end ((l0 + l2) + (l1 + l3)).
 * A chunk of NG * 4 columns is expanded one block at a time in registers and used for
 * up to RMAX rows of x; threads split the chunks. An element's value depends on its row
 * of x and its weight row only: the same operations in the same order whatever the row
 * count, the row's place, the thread count or which R-variant ran it (batch-invariant).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The order of fp32 sums is each element's own (see above) */
#pragma GCC optimize("no-associative-math")

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__) && defined(__F16C__)
#define HAS_VNNI 1
#include <immintrin.h>
#else
#define HAS_VNNI 0
#endif

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
    return HAS_VNNI && block_shape(qtype, &bytes) ? 1 : 0;
}

#if HAS_VNNI
#define NG 2   /* groups of four columns per chunk */
#define NC (4 * NG)
#define RMAX 4 /* rows of x per micro-kernel call */

/* x quantized: per row k codes, per 32 values d and d * sum(q), per 16 values sum(q) */
typedef struct {
    int8_t *q;
    float *d, *ds;
    int32_t *s16;
    int64_t k;
} xq_t;

static inline float fp16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline uint32_t load32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* one row: k bf16 values -> codes, d, d * sum, sums per 16 */
static void quantize_row(const uint16_t *x, int64_t k, int8_t *q, float *d, float *ds,
                         int32_t *s16) {
    for (int64_t u = 0; u < k / 32; u++, x += 32, q += 32) {
        const __m512i raw = _mm512_loadu_si512(x);
        const __m512 lo = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw)), 16));
        const __m512 hi = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1)), 16));
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        /* a division (divss): -ffast-math would otherwise multiply by 1 / 127 */
        const float dx = _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(amax), _mm_set_ss(127.0f)));
        const float id = dx != 0.0f ? 1.0f / dx : 0.0f;
        const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(id)));
        const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(id)));
        _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(qlo));
        _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(qhi));
        const int32_t sa = _mm512_reduce_add_epi32(qlo), sb = _mm512_reduce_add_epi32(qhi);
        d[u] = dx;
        ds[u] = dx * (float)(sa + sb);
        s16[2 * u] = sa, s16[2 * u + 1] = sb;
    }
}

/* One 32-value unit of four columns: a = codes of values 0..15, b = 16..31 (one column a
 * 128-bit lane); s = d_w (each column's lane), t = the min (lane 0 of each column, 0
 * elsewhere) or, for Q6_K, the second 16 values' d_w. */
typedef struct {
    __m512i a, b;
    __m512 s, t;
} unit_t;

static inline __m512i load4x16(const uint8_t *const p[4], int off) {
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(p[0] + off)));
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p[1] + off)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p[2] + off)), 2);
    return _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p[3] + off)), 3);
}

/* four floats -> each broadcast over its column's lane (`mask` 0x1111: lane 0 only) */
static inline __m512 spread(__m128 f, __mmask16 mask) {
    const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    return _mm512_maskz_permutexvar_ps(mask, idx, _mm512_castps128_ps512(f));
}

/* the four columns' fp16 at byte `off` of their blocks */
static inline __m128 half4(const uint8_t *const p[4], int off) {
    uint16_t h[4];
    for (int c = 0; c < 4; c++) memcpy(h + c, p[c] + off, 2);
    uint64_t v;
    memcpy(&v, h, 8);
    return _mm_cvtph_ps(_mm_cvtsi64_si128((long long)v));
}

static inline __m512i low4(__m512i v) { return _mm512_and_si512(v, _mm512_set1_epi8(0xf)); }
static inline __m512i high4(__m512i v) { return low4(_mm512_srli_epi16(v, 4)); }

/* value j's fifth bit (bit j of each column's 32-bit qh at `off`), j in [first, first+16) */
static inline __m512i fifth(__m512i v, const uint8_t *const p[4], int off, int first) {
    uint64_t m = 0;
    for (int c = 0; c < 4; c++) m |= (uint64_t)((load32(p[c] + off) >> first) & 0xffff) << (16 * c);
    return _mm512_mask_add_epi8(v, (__mmask64)m, v, _mm512_set1_epi8(16));
}

/* Q4_K / Q5_K: sub-blocks `run`, `run` + 1's d * scale and dmin * min, each column */
static inline void k4_factors(const uint8_t *const p[4], int run, __m512 f[4]) {
    float v[4][4];
    for (int c = 0; c < 4; c++) {
        const uint8_t *b = p[c], *q = b + 4;
        const float d = fp16(b), dmin = fp16(b + 2);
        for (int h = 0; h < 2; h++) {
            const int j = run + h;
            int sc, mn;
            if (j < 4) {
                sc = q[j] & 63, mn = q[j + 4] & 63;
            } else {
                sc = (q[j + 4] & 0xf) | (q[j - 4] >> 6) << 4;
                mn = (q[j + 4] >> 4) | (q[j] >> 6) << 4;
            }
            v[2 * h][c] = d * (float)sc, v[2 * h + 1][c] = -(dmin * (float)mn);
        }
    }
    for (int i = 0; i < 4; i++)
        f[i] = spread(_mm_loadu_ps(v[i]), i & 1 ? 0x1111 : 0xffff);
}

/* Units per expansion call, and the offset folded into the integer sums */
#define UNITS(QT) ((QT) == Q6_K ? 4 : (QT) == Q4_K || (QT) == Q5_K ? 2 : 1)
#define OFFSET(QT) ((QT) == Q4_0 ? 8 : (QT) == Q5_0 ? 16 : (QT) == Q8_0 ? 128 : (QT) == Q6_K ? 32 : 0)
#define HAS_MIN(QT) ((QT) == Q4_1 || (QT) == Q5_1 || (QT) == Q4_K || (QT) == Q5_K)

/* Units [step * UNITS, (step + 1) * UNITS) of the four columns' blocks at p */
static inline __attribute__((always_inline)) void
expand(const int QT, const uint8_t *const p[4], int step, unit_t *u) {
    if (QT == Q4_0 || QT == Q4_1 || QT == Q5_0 || QT == Q5_1) {
        const int qoff = QT == Q4_0 ? 2 : QT == Q4_1 ? 4 : QT == Q5_0 ? 6 : 8;
        const __m512i v = load4x16(p, qoff);
        u->a = low4(v), u->b = high4(v);
        if (QT == Q5_0 || QT == Q5_1) {
            const int hoff = QT == Q5_0 ? 2 : 4;
            u->a = fifth(u->a, p, hoff, 0), u->b = fifth(u->b, p, hoff, 16);
        }
        u->s = spread(half4(p, 0), 0xffff);
        u->t = HAS_MIN(QT) ? spread(half4(p, 2), 0x1111) : _mm512_setzero_ps();
    } else if (QT == Q8_0) {
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        u->a = _mm512_xor_si512(load4x16(p, 2), flip);
        u->b = _mm512_xor_si512(load4x16(p, 18), flip);
        u->s = spread(half4(p, 0), 0xffff), u->t = _mm512_setzero_ps();
    } else if (QT == Q4_K || QT == Q5_K) { /* step: run pair, 32 bytes of nibbles */
        const int qoff = (QT == Q5_K ? 48 : 16) + 32 * step;
        const __m512i v0 = load4x16(p, qoff), v1 = load4x16(p, qoff + 16);
        u[0].a = low4(v0), u[0].b = low4(v1), u[1].a = high4(v0), u[1].b = high4(v1);
        if (QT == Q5_K) {
            const __m512i h0 = load4x16(p, 16), h1 = load4x16(p, 32), sixteen = _mm512_set1_epi8(16);
            for (int i = 0; i < 2; i++) {
                const __m512i bit = _mm512_set1_epi8((char)(1 << (2 * step + i)));
                u[i].a = _mm512_mask_add_epi8(u[i].a, _mm512_test_epi8_mask(h0, bit), u[i].a, sixteen);
                u[i].b = _mm512_mask_add_epi8(u[i].b, _mm512_test_epi8_mask(h1, bit), u[i].b, sixteen);
            }
        }
        __m512 f[4];
        k4_factors(p, 2 * step, f);
        u[0].s = f[0], u[0].t = f[1], u[1].s = f[2], u[1].t = f[3];
    } else { /* Q6_K, step: half of 128 values; unit j its quarter j */
        const __m512i l0 = load4x16(p, 64 * step), l1 = load4x16(p, 64 * step + 16);
        const __m512i l2 = load4x16(p, 64 * step + 32), l3 = load4x16(p, 64 * step + 48);
        const __m512i h0 = load4x16(p, 128 + 32 * step), h1 = load4x16(p, 128 + 32 * step + 16);
        const __m512i three = _mm512_set1_epi8(3);
        float sc[8][4];
        for (int c = 0; c < 4; c++) {
            const float d = fp16(p[c] + 208);
            const int8_t *s = (const int8_t *)(p[c] + 192 + 8 * step);
            for (int i = 0; i < 8; i++) sc[i][c] = d * (float)s[i];
        }
        for (int j = 0; j < 4; j++) {
            const __m512i a = j & 1 ? l2 : l0, b = j & 1 ? l3 : l1;
            const __m512i ha = _mm512_and_si512(_mm512_srli_epi16(h0, 2 * j), three);
            const __m512i hb = _mm512_and_si512(_mm512_srli_epi16(h1, 2 * j), three);
            u[j].a = _mm512_or_si512(j >> 1 ? high4(a) : low4(a), _mm512_slli_epi16(ha, 4));
            u[j].b = _mm512_or_si512(j >> 1 ? high4(b) : low4(b), _mm512_slli_epi16(hb, 4));
            u[j].s = spread(_mm_loadu_ps(sc[2 * j]), 0xffff);
            u[j].t = spread(_mm_loadu_ps(sc[2 * j + 1]), 0xffff);
        }
    }
}

/* (l0 + l2) + (l1 + l3) of each column's lane -> four floats */
static inline __m128 column_sums(__m512 v) {
    const __m512 t = _mm512_add_ps(v, _mm512_permute_ps(v, 0x4e));
    return _mm512_castps512_ps128(_mm512_maskz_compress_ps(0x1111, _mm512_add_ps(t, _mm512_permute_ps(t, 0xb1))));
}

/* 8 floats -> bf16, nearest even (as torch rounds), NaN kept quiet */
static inline __m128i to_bf16x8(__m256 f) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
    const __mmask8 nan = _mm256_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    r = _mm256_mask_or_epi32(r, nan, _mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    return _mm256_cvtepi32_epi16(r);
}

/* Rows [r0, r0 + R) of x against the chunk's columns (pointers `col`, one per column),
 * `nb` blocks: out's columns [0, ncols). */
static inline __attribute__((always_inline)) void
micro(const int QT, const int R, const xq_t *xq, int64_t r0, const uint8_t *const col[NC],
      int64_t nb, int bytes, uint16_t *out, int64_t ldo, int ncols) {
    const int UB = QT == Q4_K || QT == Q5_K || QT == Q6_K ? 8 : 1, US = UNITS(QT);
    const int64_t nu = xq->k / 32;
    __m512 acc[RMAX][NG];
    for (int r = 0; r < R; r++)
        for (int g = 0; g < NG; g++) acc[r][g] = _mm512_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *p[NG][4];
        for (int g = 0; g < NG; g++)
            for (int c = 0; c < 4; c++) {
                p[g][c] = col[4 * g + c] + i * bytes;
                _mm_prefetch((const char *)p[g][c] + 4 * bytes, _MM_HINT_T0);
            }
        for (int step = 0; step < UB / US; step++) {
            unit_t w[NG][4];
            for (int g = 0; g < NG; g++) expand(QT, p[g], step, w[g]);
            for (int j = 0; j < US; j++) {
                const int64_t unit = i * UB + step * US + j;
                for (int r = 0; r < R; r++) {
                    const int64_t row = r0 + r, at = row * nu + unit;
                    const int8_t *q = xq->q + row * xq->k + unit * 32;
                    const __m512i xa = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)q));
                    const __m512i xb = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(q + 16)));
                    const __m512 dx = _mm512_set1_ps(xq->d[at]);
                    const int32_t sa = xq->s16[2 * at], sb = xq->s16[2 * at + 1];
                    for (int g = 0; g < NG; g++) {
                        const unit_t *u = &w[g][j];
                        if (QT == Q6_K) {
                            const __m512i ia = _mm512_dpbusd_epi32(
                                _mm512_maskz_set1_epi32(0x1111, -OFFSET(QT) * sa), u->a, xa);
                            const __m512i ib = _mm512_dpbusd_epi32(
                                _mm512_maskz_set1_epi32(0x1111, -OFFSET(QT) * sb), u->b, xb);
                            acc[r][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), _mm512_mul_ps(u->s, dx), acc[r][g]);
                            acc[r][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ib), _mm512_mul_ps(u->t, dx), acc[r][g]);
                        } else {
                            __m512i is = OFFSET(QT) ? _mm512_maskz_set1_epi32(0x1111, -OFFSET(QT) * (sa + sb))
                                                    : _mm512_setzero_si512();
                            is = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(is, u->a, xa), u->b, xb);
                            acc[r][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(u->s, dx), acc[r][g]);
                            if (HAS_MIN(QT))
                                acc[r][g] = _mm512_fmadd_ps(u->t, _mm512_set1_ps(xq->ds[at]), acc[r][g]);
                        }
                    }
                }
            }
        }
    }
    const __mmask8 keep = (__mmask8)((1u << ncols) - 1);
    for (int r = 0; r < R; r++) {
        const __m256 s = _mm256_insertf128_ps(_mm256_castps128_ps256(column_sums(acc[r][0])),
                                              column_sums(acc[r][1]), 1);
        _mm_mask_storeu_epi16(out + r * ldo, keep, to_bf16x8(s));
    }
}

/* every row of x against one chunk of columns, RMAX rows a call */
static inline __attribute__((always_inline)) void
chunk_rows(const int QT, const xq_t *xq, int64_t rows, const uint8_t *const col[NC], int64_t nb,
           int bytes, uint16_t *out, int64_t ldo, int ncols) {
    int64_t r0 = 0;
    for (; r0 + RMAX <= rows; r0 += RMAX)
        micro(QT, RMAX, xq, r0, col, nb, bytes, out + r0 * ldo, ldo, ncols);
    switch ((int)(rows - r0)) {
    case 3: micro(QT, 3, xq, r0, col, nb, bytes, out + r0 * ldo, ldo, ncols); break;
    case 2: micro(QT, 2, xq, r0, col, nb, bytes, out + r0 * ldo, ldo, ncols); break;
    case 1: micro(QT, 1, xq, r0, col, nb, bytes, out + r0 * ldo, ldo, ncols); break;
    default: break;
    }
}

static void quantize_rows(const uint16_t *x, int64_t rows, int64_t ldx, const xq_t *xq) {
    const int64_t k = xq->k, nu = k / 32;
    _Pragma("omp for schedule(static)")
    for (int64_t r = 0; r < rows; r++)
        quantize_row(x + r * ldx, k, xq->q + r * k, xq->d + r * nu, xq->ds + r * nu,
                     xq->s16 + 2 * r * nu);
}

static void all_chunks(int qtype, const xq_t *xq, int64_t rows, const uint8_t *w, int64_t n,
                       int64_t nb, int bytes, uint16_t *out, int64_t ldo) {
    const int64_t row_bytes = nb * bytes, chunks = (n + NC - 1) / NC;
    _Pragma("omp for schedule(static)")
    for (int64_t ch = 0; ch < chunks; ch++) {
        const int64_t first = ch * NC;
        const int ncols = n - first < NC ? (int)(n - first) : NC;
        const uint8_t *col[NC];
        for (int c = 0; c < NC; c++) /* a last chunk's missing columns repeat its last one */
            col[c] = w + (first + (c < ncols ? c : ncols - 1)) * row_bytes;
        uint16_t *o = out + first;
        switch (qtype) {
#define TYPE(Q) case Q: chunk_rows(Q, xq, rows, col, nb, bytes, o, ldo, ncols); break;
        TYPE(Q4_0) TYPE(Q4_1) TYPE(Q5_0) TYPE(Q5_1) TYPE(Q8_0) TYPE(Q4_K) TYPE(Q5_K) TYPE(Q6_K)
#undef TYPE
        default: break;
        }
    }
}

static int alloc_xq(xq_t *xq, int64_t rows, int64_t k) {
    const int64_t nu = k / 32;
    char *mem = malloc((size_t)(rows * k + rows * nu * 16 + 64));
    if (!mem) return -1;
    xq->q = (int8_t *)mem;
    xq->d = (float *)(mem + (rows * k + 63) / 64 * 64);
    xq->ds = xq->d + rows * nu;
    xq->s16 = (int32_t *)(xq->ds + rows * nu);
    xq->k = k;
    return 0;
}
#endif

/* x [rows, k] bf16 (row stride ldx) . W^T -> out [rows, n] bf16 (row stride ldo), by int8
 * products (see the top of this file). Any row count. Returns -1 for an unknown type, k
 * not whole blocks, a build without AVX512_VNNI or no memory. */
int quant_gguf_q8_bf16(int qtype, const uint16_t *x, int64_t rows, int64_t ldx,
                       const uint8_t *w, int64_t n, int64_t k, uint16_t *out, int64_t ldo,
                       int num_threads) {
    int bytes;
    const int block = block_shape(qtype, &bytes);
    if (!HAS_VNNI || !block || k % block) return -1;
    if (rows <= 0 || n <= 0) return 0;
#if HAS_VNNI
    xq_t xq;
    if (alloc_xq(&xq, rows, k)) return -1;
    _Pragma("omp parallel num_threads(num_threads)")
    {
        quantize_rows(x, rows, ldx, &xq); /* the omp for's barrier: every row ready */
        all_chunks(qtype, &xq, rows, w, n, k / block, bytes, out, ldo);
    }
    free(xq.q);
    return 0;
#else
    (void)x, (void)ldx, (void)w, (void)out, (void)ldo, (void)num_threads;
    return -1;
#endif
}

/* x's quantization alone (tests): codes q [rows, k] and d [rows, k / 32]. -1 without
 * AVX512_VNNI, k not a multiple of 32 or no memory. */
int quant_gguf_q8_quantize_bf16(const uint16_t *x, int64_t rows, int64_t ldx, int64_t k,
                                int8_t *q, float *d) {
    if (!HAS_VNNI || k % 32 || rows < 0) return -1;
#if HAS_VNNI
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
