/* What the expansion kernels (quant_gguf.c, quant_group.c) share: the CPU features they
 * test, the register tiling (VL floats a vector, NR weight rows a group, MR x rows a
 * micro-kernel call) and the micro-kernel that multiplies
 * rows of x by NR weight rows expanded into a scratch, with the stores that reduce its
 * sums.
 *
 * Numerics, the same in every includer: every output element is summed in one order,
 * whatever the row count, the thread count or the element's place in the batch:
 * lane-wise over K in steps of the vector width (pairs of channels for vdpbf16ps), then
 * the lanes in a fixed order. `#pragma GCC optimize("no-associative-math")` in each
 * includer keeps -ffast-math from reassociating those sums; multiply-adds still
 * contract (fp-contract is its own flag). */
#ifndef FUSEGEN_KERNELS_EXPAND_H
#define FUSEGEN_KERNELS_EXPAND_H

#include "common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define HAS_AVX512 1
#else
#define HAS_AVX512 0
#endif
#if !HAS_AVX512 && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAS_AVX2 1
#else
#define HAS_AVX2 0
#endif

#define MAX_ROWS 64 /* rows of x a call of the expansion kernels takes */

#if defined(__AVX512F__)
#define VL 16 /* floats per vector */
#define NR 4  /* weight rows per group */
#define MR 6  /* x rows per micro-kernel call: 24 sums + 4 weight vectors in 32 zmm */
#else
#if defined(__AVX__) || defined(__aarch64__)
#define VL 8  /* a ymm, or a pair of NEON registers */
#else
#define VL 4  /* baseline x86-64: one xmm */
#endif
#define NR 2  /* 16 ymm (AVX2): 8 sums, 2 weight vectors, the x vector */
#define MR 4
#endif
typedef float vf __attribute__((vector_size(VL * 4)));

#if HAS_AVX512 && defined(__AVX512BF16__)
#define HAS_BF16DOT 1 /* bf16 x against weights expanded to bf16: vdpbf16ps */
#else
#define HAS_BF16DOT 0
#endif

static inline vf loadv(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vf fmav(vf c, vf a, vf b) { /* c + a b, one rounding, on every path */
#if HAS_AVX512
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif HAS_AVX2
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return c + a * b; /* contracted to an FMA where the target has one (fp-contract) */
#endif
}

/* finite fp32 values rounded to bf16 precision (nearest even), lane-wise */
static inline vf round_bf16(vf v) {
    typedef uint32_t vu __attribute__((vector_size(VL * 4)));
    const vu u = (vu)v;
    return (vf)((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
}

/* bf16 rows x [rows, k] (row stride ldx) widened to fp32 xf [rows, k] */
static inline void widen_rows(const uint16_t *x, int64_t rows, int64_t ldx, int64_t k,
                              float *xf) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < k; i++) xf[r * k + i] = bf16_to_f32(x[r * ldx + i]);
}

/* fp32 rows of [rows, n] rounded to bf16 out (row stride ldo) */
static inline void round_rows(const float *of, int64_t rows, int64_t n, uint16_t *out,
                              int64_t ldo) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < n; j++) out[r * ldo + j] = f32_to_bf16(of[r * n + j]);
}

/* One x row's NR sums, each vector's lanes added (in one fixed order per element), stored
 * as fp32 or rounded to bf16: columns [0, ncols) of `out`. */
static inline __attribute__((always_inline)) void
store_sums(const vf c[NR], void *out, int ncols, const int TO_BF16) {
    float s[NR];
#if HAS_AVX512
    /* NR == 4: halves added, then three hadds give the four sums in one xmm */
    __m256 t[4];
    for (int j = 0; j < 4; j++) {
        const __m512 v = (__m512)c[j];
        t[j] = _mm256_add_ps(_mm512_castps512_ps256(v),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    }
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(t[0], t[1]), _mm256_hadd_ps(t[2], t[3]));
    const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
#if HAS_BF16DOT
    if (TO_BF16) { /* vcvtneps2bf16: nearest even, as f32_to_bf16 */
        _mm_mask_storeu_epi16(out, (__mmask8)((1u << ncols) - 1), (__m128i)_mm_cvtneps_pbh(sums));
        return;
    }
#endif
    _mm_storeu_ps(s, sums);
#else
    for (int j = 0; j < NR; j++) {
        s[j] = 0.0f;
        for (int l = 0; l < VL; l++) s[j] += c[j][l];
    }
#endif
    for (int j = 0; j < ncols; j++) {
        if (TO_BF16)
            ((uint16_t *)out)[j] = f32_to_bf16(s[j]);
        else
            ((float *)out)[j] = s[j];
    }
}

#if HAS_AVX512
/* Four x rows' sums (c[r][j], NR == 4) at once, by the same additions as store_sums makes
 * for each row (lane i + lane i + 8, then pairs, pairs of pairs, the two 128-bit halves),
 * with 16 sums a vector instead of 4: about half the shuffles and adds. */
static inline __m512 hadd512(__m512 p, __m512 q) { /* each 128 bits: p0+p1 p2+p3 q0+q1 q2+q3 */
    return _mm512_add_ps(_mm512_shuffle_ps(p, q, 0x88), _mm512_shuffle_ps(p, q, 0xdd));
}

static inline __attribute__((always_inline)) void
store_sums4(const vf c[][NR], void *out, int64_t ldo, int ncols, const int TO_BF16) {
    __m512 b[4];
    for (int r = 0; r < 4; r++) {
        __m512 u[2]; /* columns (0, 1) and (2, 3): lanes i + i + 8 of each, 8 a column */
        for (int h = 0; h < 2; h++) {
            const __m512 p = (__m512)c[r][2 * h], q = (__m512)c[r][2 * h + 1];
            u[h] = _mm512_add_ps(_mm512_shuffle_f32x4(p, q, 0x44),
                                 _mm512_shuffle_f32x4(p, q, 0xee));
        }
        b[r] = hadd512(u[0], u[1]);
    }
    /* 128-bit block 2 l + m of e[h]: rows 2 h, 2 h + 1's columns m, m + 2, half l's sums */
    const __m512 e0 = hadd512(b[0], b[1]), e1 = hadd512(b[2], b[3]);
    const __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, 0x88),
                                   _mm512_shuffle_f32x4(e0, e1, 0xdd));
    /* s's block 2 h + m: rows 2 h, 2 h + 1's columns m, m + 2; to row-major 4 x 4 */
    const __m512i order = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
    const __m512 sums = _mm512_permutexvar_ps(order, s);
#if HAS_BF16DOT
    if (TO_BF16) {
        uint16_t v[16];
        _mm256_storeu_si256((__m256i *)v, (__m256i)_mm512_cvtneps_pbh(sums));
        for (int r = 0; r < 4; r++) memcpy((uint16_t *)out + r * ldo, v + 4 * r, 2 * ncols);
        return;
    }
#endif
    float v[16];
    _mm512_storeu_ps(v, sums);
    for (int r = 0; r < 4; r++) {
        if (TO_BF16)
            for (int j = 0; j < ncols; j++)
                ((uint16_t *)out)[r * ldo + j] = f32_to_bf16(v[4 * r + j]);
        else
            memcpy((float *)out + r * ldo, v + 4 * r, 4 * ncols);
    }
}
#endif

/* R rows of sums to out (row stride ldo): four at a time where the build can */
static inline __attribute__((always_inline)) void
store_rows(const vf c[][NR], void *out, int64_t ldo, int ncols, const int R, const int TO_BF16) {
    const int64_t es = TO_BF16 ? 2 : 4;
    int r = 0;
#if HAS_AVX512
    for (; r + 4 <= R; r += 4) store_sums4(c + r, (char *)out + r * ldo * es, ldo, ncols, TO_BF16);
#endif
    for (; r < R; r++) store_sums(c[r], (char *)out + r * ldo * es, ncols, TO_BF16);
}

/* out rows [0, R) x columns [0, ncols) = x rows . the NR expanded weight rows (k apart in
 * `w`: fp32, or bf16 where TO_BF16 and HAS_BF16DOT). fp32 x, or bf16 x (TO_BF16). */
static inline __attribute__((always_inline)) void
micro(const void *x, int64_t ldx, const void *w, int64_t k, void *out, int64_t ldo, int ncols,
      const int R, const int TO_BF16) {
    vf c[MR][NR];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NR; j++) c[r][j] = (vf){0};
#if HAS_BF16DOT
    if (TO_BF16) {
        const uint16_t *xb = x, *wb = w;
        for (int64_t i = 0; i < k; i += 32) { /* k is a multiple of 32 */
            __m512bh wv[NR];
            for (int j = 0; j < NR; j++) wv[j] = (__m512bh)_mm512_loadu_si512(wb + j * k + i);
            for (int r = 0; r < R; r++) {
                const __m512bh a = (__m512bh)_mm512_loadu_si512(xb + r * ldx + i);
                for (int j = 0; j < NR; j++)
                    c[r][j] = (vf)_mm512_dpbf16_ps((__m512)c[r][j], a, wv[j]);
            }
        }
    } else
#endif
    {
        const float *xf = x, *wf = w;
        for (int64_t i = 0; i < k; i += VL) {
            vf wv[NR];
            for (int j = 0; j < NR; j++) wv[j] = loadv(wf + j * k + i);
            for (int r = 0; r < R; r++) {
                const vf a = loadv(xf + r * ldx + i);
                for (int j = 0; j < NR; j++) c[r][j] = fmav(c[r][j], a, wv[j]);
            }
        }
    }
    store_rows(c, out, ldo, ncols, R, TO_BF16);
}

static inline __attribute__((always_inline)) void
rows_against(const void *x, int64_t rows, int64_t ldx, const void *w, int64_t k, void *out,
             int64_t ldo, int ncols, const int TO_BF16) {
    const int64_t es = TO_BF16 ? 2 : 4;
    for (int64_t r0 = 0, take; r0 < rows; r0 += take) {
        const char *xr = (const char *)x + r0 * ldx * es;
        char *o = (char *)out + r0 * ldo * es;
        /* MR rows a call, but 7-9 rows left as 4 + 3, 4 + 4, 5 + 4, not MR + 1-3: fuller
         * tiles, four rows' sums reduced together (the sums' order is each element's own) */
        const int64_t left = rows - r0;
        take = left <= MR ? left : MR == 6 && left <= 9 ? left - 4 : MR;
#define MICRO(RR) micro(xr, ldx, w, k, o, ldo, ncols, RR, TO_BF16)
        switch ((int)take) {
#if MR > 4
        case 6: MICRO(6); break;
        case 5: MICRO(5); break;
#endif
        case 4: MICRO(4); break;
        case 3: MICRO(3); break;
        case 2: MICRO(2); break;
        default: MICRO(1); break;
        }
#undef MICRO
    }
}

#endif /* FUSEGEN_KERNELS_EXPAND_H */
