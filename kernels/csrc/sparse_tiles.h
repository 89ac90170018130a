/* The expansions of fusegen's sparse tiles (sparse_tiles.c, which describes the format
 * and the paths): the build's instruction set, a call's arguments, one column (or a pair
 * of columns, for vdpbf16ps) expanded into registers, the sums stored. Shared by the
 * few-row path (sparse_tiles.c) and the many-row path (sparse_tiles_many.h). */
#ifndef FUSEGEN_SPARSE_TILES_H
#define FUSEGEN_SPARSE_TILES_H

#include <stdlib.h>

#include "common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define SP_AVX512 1
#else
#define SP_AVX512 0
#endif
#if SP_AVX512 && defined(__AVX512VBMI2__)
#define SP_VBMI2 1
#else
#define SP_VBMI2 0
#endif
#if SP_VBMI2 && defined(__AVX512BF16__)
#define SP_DP 1 /* bf16 x against bf16 values: two columns a step by vdpbf16ps */
#else
#define SP_DP 0
#endif
#if SP_DP && defined(__AVX512VBMI__)
#define SP_DP_I8 1 /* bf16 x against int8 values likewise, the codes made bf16 by vpermi2b */
#else
#define SP_DP_I8 0
#endif
#if !SP_AVX512 && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SP_AVX2 1
#else
#define SP_AVX2 0
#endif

#define TILE 64 /* rows and columns a tile */
#define MR 6    /* rows of x a pass */
#if SP_AVX512
#define VL 16   /* fp32 lanes a vector */
#define CH 64   /* tile rows a pass: 4 zmm a row of x */
#elif SP_AVX2
#define VL 8
#define CH 16   /* two ymm a row of x: 12 sums, 2 weight vectors, x, in 16 ymm */
#else
#define VL 1
#define CH 64
#endif
#define NV (CH / VL) /* weight vectors a column step */
#define STEP_FLOATS 64       /* a step expanded: 64 rows of fp32, or 64 bf16 pairs */
#define SCRATCH_STEPS 1024   /* expanded steps a thread holds (256 KB, in L2) */

/* the format's value types (sparse_tiles.py passes these), and log2 of their bytes */
enum { V_BF16 = 0, V_F16 = 1, V_F32 = 2, V_I8 = 3 };
#define VALUE_SHIFT(VT) ((VT) == V_F32 ? 2 : (VT) == V_I8 ? 0 : 1)

typedef struct {
    const uint64_t *bitmap; /* [tiles, 64] */
    const int64_t *offsets; /* [tiles + 1] */
    const uint8_t *values;  /* [nnz] of the value type */
    const float *scales;    /* [tiles], int8 only */
    int64_t n, k, n_ti, nnz;
    int vt;         /* the value type */
    const float *x; /* [rows, k] fp32, row stride ldx */
    int64_t rows, ldx;
    void *out; /* [rows, n], row stride ldo: fp32, or bf16 for out_bf16 */
    int64_t ldo;
    int out_bf16;
    const uint16_t *xb; /* SP_DP: bf16 x [rows, ldxb] in pairs of channels (odd k: a copy
                         * with one zero past k) */
    int64_t ldxb;
} call_t;

static inline int popcount64(uint64_t w) { return __builtin_popcountll(w); }

/* Where a path's registers hold each tile row (lane position among a step's 64):
 * LAYOUT_UNPACK: vpunpcklwd / vpunpckhwd widen 16-bit words within 128-bit lanes, so
 *   vector v of a bf16 column (or of a vdpbf16ps pair) holds rows 32 (v / 2) + 8 L +
 *   4 (v % 2) + i in lane 4 L + i;
 * LAYOUT_PAIR8: int8 pairs (`pairs_i8`) hold rows 16 L + 4 v + i in lane 4 L + i of v. */
enum { LAYOUT_NATURAL = 0, LAYOUT_UNPACK = 1, LAYOUT_PAIR8 = 2 };
static int POSITION[3][TILE]; /* layout, tile row -> lane position v * 16 + lane */
__attribute__((constructor)) static void init_positions(void) {
    for (int v = 0; v < 4; v++)
        for (int L = 0; L < 4; L++)
            for (int i = 0; i < 4; i++) {
                POSITION[LAYOUT_NATURAL][16 * v + 4 * L + i] = 16 * v + 4 * L + i;
                POSITION[LAYOUT_UNPACK][32 * (v / 2) + 8 * L + 4 * (v % 2) + i] = 16 * v + 4 * L + i;
                POSITION[LAYOUT_PAIR8][16 * L + 4 * v + i] = 16 * v + 4 * L + i;
            }
}

/* the layout of an FMA path's column (VT) and of a vdpbf16ps path's pair (DP) */
#define LAYOUT(VT, DP)                                                                    \
    ((DP) ? ((VT) == V_I8 ? LAYOUT_PAIR8 : LAYOUT_UNPACK)                                 \
          : (SP_VBMI2 && (VT) == V_BF16 ? LAYOUT_UNPACK : LAYOUT_NATURAL))

/* ---- one column's CH rows of W as fp32 vectors (int8: the codes, unscaled) ---------- */
#if SP_AVX512
typedef __m512 vec_t;

/* column with mask `word`, its values from index `at`; rows [0, 64) in 4 vectors (in
 * LAYOUT(VT, 0)'s order) */
static inline __attribute__((always_inline)) void
expand_column(const call_t *c, uint64_t word, int64_t at, __m512 w[4], const int VT) {
    const uint8_t *v = c->values;
    if (VT == V_F32) {
        const float *p = (const float *)v + at;
        for (int g = 0; g < 4; g++) {
            const __mmask16 m = (__mmask16)(word >> (16 * g));
            w[g] = _mm512_maskz_expandloadu_ps(m, p);
            p += popcount64(m);
        }
        return;
    }
#if SP_VBMI2
    if (VT == V_I8) {
        const __m512i b = _mm512_maskz_expandloadu_epi8((__mmask64)word, v + at);
        w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_castsi512_si128(b)));
        w[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(b, 1)));
        w[2] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(b, 2)));
        w[3] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(b, 3)));
        return;
    }
    const uint16_t *p = (const uint16_t *)v + at;
    const __mmask32 lo = (__mmask32)word, hi = (__mmask32)(word >> 32);
    const __m512i h0 = _mm512_maskz_expandloadu_epi16(lo, p);
    const __m512i h1 = _mm512_maskz_expandloadu_epi16(hi, p + popcount64(lo));
    if (VT == V_BF16) { /* bf16 -> fp32: the word in the high half, zeros below */
        const __m512i z = _mm512_setzero_si512();
        w[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, h0));
        w[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, h0));
        w[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, h1));
        w[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, h1));
    } else {
        w[0] = _mm512_cvtph_ps(_mm512_castsi512_si256(h0));
        w[1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h0, 1));
        w[2] = _mm512_cvtph_ps(_mm512_castsi512_si256(h1));
        w[3] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h1, 1));
    }
#else
    for (int g = 0; g < 4; g++) { /* 16 rows: load the step's values packed, then expand */
        const __mmask16 m = (__mmask16)(word >> (16 * g));
        const int count = popcount64(m);
        const __mmask16 first = (__mmask16)((1u << count) - 1);
        __m512i packed;
        if (VT == V_I8) {
            packed = _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(first, v + at));
            w[g] = _mm512_cvtepi32_ps(_mm512_maskz_expand_epi32(m, packed));
        } else {
            const __m256i h = _mm256_maskz_loadu_epi16(first, (const uint16_t *)v + at);
            w[g] = VT == V_BF16
                ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                : _mm512_cvtph_ps(h);
            w[g] = _mm512_maskz_expand_ps(m, w[g]);
        }
        at += count;
    }
#endif
}

/* a step of the FMA path: the column's 4 vectors */
static inline __attribute__((always_inline)) void
expand_step(const call_t *c, uint64_t word, int64_t at, vec_t w[NV], const int VT) {
    expand_column(c, word, at, w, VT);
}

#elif SP_AVX2
typedef __m256 vec_t;

/* vpermd indices: lane l of a mask byte m takes packed value popcount(m & (2^l - 1)) */
static int32_t EXPAND_IDX[256][8], EXPAND_MASK[256][8];
__attribute__((constructor)) static void init_expand_tables(void) {
    for (int m = 0; m < 256; m++)
        for (int l = 0, n = 0; l < 8; l++) {
            EXPAND_IDX[m][l] = n;
            EXPAND_MASK[m][l] = (m >> l) & 1 ? -1 : 0;
            n += (m >> l) & 1;
        }
}

/* 8 consecutive values from index `at` widened to fp32 (a copy where fewer than 8 are
 * left in the buffer, so nothing past its end is read) */
static inline __attribute__((always_inline)) __m256
load8(const call_t *c, int64_t at, int count, const int VT) {
    const int size = VT == V_F32 ? 4 : VT == V_I8 ? 1 : 2;
    const uint8_t *p = c->values + at * size;
    uint8_t tail[32] = {0};
    if (at + 8 > c->nnz) {
        memcpy(tail, p, (size_t)count * size);
        p = tail;
    }
    if (VT == V_F32) return _mm256_loadu_ps((const float *)p);
    if (VT == V_I8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (VT == V_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* pass h's rows [16 h, 16 h + 16) of the column with mask `word`, values from `at` */
static inline __attribute__((always_inline)) void
expand_pass(const call_t *c, uint64_t word, int64_t at, int h, __m256 w[2], const int VT) {
    const int shift = 16 * h;
    at += popcount64(word & ((1ull << shift) - 1)); /* rows below the pass */
    for (int g = 0; g < 2; g++) {
        const int m = (int)(word >> (shift + 8 * g)) & 0xff;
        const int count = popcount64((uint64_t)m);
        const __m256 packed = load8(c, at, count, VT);
        w[g] = _mm256_and_ps(
            _mm256_permutevar8x32_ps(packed, _mm256_loadu_si256((const __m256i *)EXPAND_IDX[m])),
            _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)EXPAND_MASK[m])));
        at += count;
    }
}
#endif

/* ---- storing a block of sums ----------------------------------------------------------- */

/* R rows of x (from r0), tile rows [0, nrows) of the band from output o0: row r's sum of
 * tile row j at sums[r * stride + POSITION[layout][j]] */
static inline __attribute__((always_inline)) void
store_rows(const call_t *c, const float *sums, int stride, int64_t r0, const int R,
           int64_t o0, int nrows, int layout) {
    const int *pos = POSITION[layout];
    for (int r = 0; r < R; r++) {
        const float *s = sums + r * stride;
        if (c->out_bf16) {
            uint16_t *o = (uint16_t *)c->out + (r0 + r) * c->ldo + o0;
            for (int j = 0; j < nrows; j++) o[j] = f32_to_bf16(s[pos[j]]);
        } else {
            float *o = (float *)c->out + (r0 + r) * c->ldo + o0;
            for (int j = 0; j < nrows; j++) o[j] = s[pos[j]];
        }
    }
}

static inline int band_rows(const call_t *c, int64_t o0, int width) {
    return c->n - o0 < width ? (int)(c->n - o0) : width;
}


#if SP_AVX512 || SP_AVX2
#if SP_AVX512
#define VSET1(f) _mm512_set1_ps(f)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VSTORE(p, v) _mm512_store_ps(p, v)
#define VLOAD(p) _mm512_load_ps(p)
#else
#define VSET1(f) _mm256_set1_ps(f)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VSTORE(p, v) _mm256_store_ps(p, v)
#define VLOAD(p) _mm256_load_ps(p)
#endif
#endif

#if SP_DP
#if SP_DP_I8
/* bf16 of |code| for code 0..127, low and high bytes (vpermi2b tables) */
static uint8_t I8_LO[128] __attribute__((aligned(64))), I8_HI[128] __attribute__((aligned(64)));
__attribute__((constructor)) static void init_i8_tables(void) {
    for (int m = 0; m < 128; m++) {
        const uint16_t b = f32_to_bf16((float)m);
        I8_LO[m] = (uint8_t)b, I8_HI[m] = (uint8_t)(b >> 8);
    }
}

/* columns with masks w0, w1 (codes from p0, p1) as bf16 pairs in LAYOUT_PAIR8: the two
 * columns' bytes interleaved, each byte's |code| looked up in the low and high byte
 * tables, the code's sign put on the high byte, and the bytes interleaved into words.
 * Codes lie in [-127, 127] (the format's clamp). */
static inline __attribute__((always_inline)) void
pairs_i8(const int8_t *p0, uint64_t w0, const int8_t *p1, uint64_t w1, __m512i pair[4]) {
    const __m512i lo0 = _mm512_load_si512(I8_LO), lo1 = _mm512_load_si512(I8_LO + 64);
    const __m512i hi0 = _mm512_load_si512(I8_HI), hi1 = _mm512_load_si512(I8_HI + 64);
    const __m512i sign = _mm512_set1_epi8((char)0x80);
    const __m512i a0 = _mm512_maskz_expandloadu_epi8((__mmask64)w0, p0);
    const __m512i a1 = _mm512_maskz_expandloadu_epi8((__mmask64)w1, p1);
    const __m512i both[2] = {_mm512_unpacklo_epi8(a0, a1), _mm512_unpackhi_epi8(a0, a1)};
    for (int g = 0; g < 2; g++) {
        const __m512i m = _mm512_abs_epi8(both[g]);
        const __m512i lo = _mm512_permutex2var_epi8(lo0, m, lo1);
        /* hi | (code & 0x80) */
        const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, m, hi1),
                                                     both[g], sign, 0xf8);
        pair[2 * g] = _mm512_unpacklo_epi8(lo, hi);
        pair[2 * g + 1] = _mm512_unpackhi_epi8(lo, hi);
    }
}
#endif

/* columns k and k + 1 of a tile (masks w0, w1; values from index `at`) as 4 vectors of
 * bf16 pairs (row j's two weights in one dword), in LAYOUT(VT, 1)'s order */
static inline __attribute__((always_inline)) void
expand_pair(const call_t *c, uint64_t w0, uint64_t w1, int64_t at, __m512i pair[4],
            const int VT) {
#if SP_DP_I8
    if (VT == V_I8) {
        const int8_t *p0 = (const int8_t *)c->values + at;
        pairs_i8(p0, w0, p0 + popcount64(w0), w1, pair);
        return;
    }
#endif
    const uint16_t *p0 = (const uint16_t *)c->values + at, *p1 = p0 + popcount64(w0);
    const __mmask32 lo0 = (__mmask32)w0, lo1 = (__mmask32)w1;
    const __m512i a0 = _mm512_maskz_expandloadu_epi16(lo0, p0);
    const __m512i b0 = _mm512_maskz_expandloadu_epi16((__mmask32)(w0 >> 32), p0 + popcount64(lo0));
    const __m512i a1 = _mm512_maskz_expandloadu_epi16(lo1, p1);
    const __m512i b1 = _mm512_maskz_expandloadu_epi16((__mmask32)(w1 >> 32), p1 + popcount64(lo1));
    pair[0] = _mm512_unpacklo_epi16(a0, a1), pair[1] = _mm512_unpackhi_epi16(a0, a1);
    pair[2] = _mm512_unpacklo_epi16(b0, b1), pair[3] = _mm512_unpackhi_epi16(b0, b1);
    (void)VT;
}
#endif

#endif /* FUSEGEN_SPARSE_TILES_H */
