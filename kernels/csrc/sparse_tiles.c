/* Products against a weight kept in fusegen's sparse tiles (kernels/sparse_format.py):
 * out [T, N] = x [T, K] W^T, W [N, K] stored as 64 x 64 tiles, row-tile major, each a
 * bitmap (one 64-bit word a local column c: bit j set iff row j of that column is kept),
 * its kept values packed column by column (c ascending, then j ascending) and an offset
 * into them; with int8 values one fp32 scale a tile (value = code x scale).
 *
 * How ("load as sparse, compute as dense", after Flash-LLM): threads split the row-tiles
 * (bands of 64 output rows). For a band and MR rows of x, the band's 64 sums of each row
 * live in registers (AVX-512: 4 zmm a row, MR = 6 rows, 24 sums). The tiles of the band are
 * walked in order of k; each column's mask word expands its packed values into the
 * column's 64 rows of W, as fp32 vectors (zeros where the bitmap has none), and each row
 * of x multiplies them by its x[r, k] broadcast, an FMA a vector. So the values are read
 * once per MR rows of x and never written out dense.
 *   AVX-512 with VBMI2: vpexpandw / vpexpandb load a column's 32 16-bit or 64 8-bit values
 *     straight to their rows (bf16 widened by an unpack with zeros, which leaves the rows
 *     in each 128-bit lane's order; the stores put them back, `PERM_UNPACK`), fp32 by
 *     vexpandps, 16 rows a load.
 *   AVX-512 without VBMI2: 16 rows a step: the step's values loaded (a masked load of as
 *     many as the mask has bits), widened to fp32, then vexpandps / vpexpandd.
 *   AVX2: 16 rows a pass (two ymm, MR = 6: 12 sums): 8 rows a step, the values loaded
 *     packed, widened and moved to their rows by vpermd with a table indexed by the mask
 *     byte, the empty lanes zeroed.
 *   plain C: each set bit's value added into its row's sum, the reference expansion.
 *   bf16 x against bf16 values with AVX512_BF16 (and VBMI2): two columns a step, their
 *     expanded words interleaved into pairs and multiplied by vdpbf16ps (`band_pass_dp`).
 * The path is chosen by the compiler's target flags (native.py builds with -march=native).
 *
 * Numerics: every output element is one fp32 sum over k ascending, x[r, k] x W[o, k] added
 * by an FMA each (vdpbf16ps's pairs of k for bf16 x and values, where the build has it;
 * a weight the bitmap does not hold adds nothing), whatever T, MR, the
 * thread count or the row's place in the batch: a row's result is independent of its
 * batch. bf16 x is widened to fp32 (exact) and the sums rounded once to bf16; fp32 x gives
 * fp32 sums. int8 weights are code x scale rounded once in fp32, as the format's decode.
 */
#include <stdlib.h>

/* the sums keep the order written: an element's value must not depend on which inlined
 * copy of the kernel computed it */
#pragma GCC optimize("no-associative-math")

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

/* the format's value types (sparse_tiles.py passes these) */
enum { V_BF16 = 0, V_F16 = 1, V_F32 = 2, V_I8 = 3 };

typedef struct {
    const uint64_t *bitmap; /* [tiles, 64] */
    const int64_t *offsets; /* [tiles + 1] */
    const uint8_t *values;  /* [nnz] of the value type */
    const float *scales;    /* [tiles], int8 only */
    int64_t n, k, n_ti, nnz;
    const float *x; /* [rows, k] fp32, row stride ldx */
    int64_t rows, ldx;
    void *out; /* [rows, n], row stride ldo: fp32, or bf16 for out_bf16 */
    int64_t ldo;
    int out_bf16;
    const uint16_t *xb; /* SP_DP: bf16 x [rows, ldxb], one zero past k (pairs of channels) */
    int64_t ldxb;
} call_t;

static inline int popcount64(uint64_t w) { return __builtin_popcountll(w); }

/* The lane (among a pass's NV x VL) holding each tile row, where a path's widening moves
 * rows: vpunpcklwd / vpunpckhwd with zeros widen 16-bit words within 128-bit lanes, so
 * vector v of a bf16 column holds rows 32 (v / 2) + 8 L + 4 (v % 2) + i in lane 4 L + i. */
#if SP_AVX512
static int PERM_UNPACK[TILE]; /* tile row -> lane position v * 16 + lane */
__attribute__((constructor)) static void init_perm_unpack(void) {
    for (int v = 0; v < 4; v++)
        for (int L = 0; L < 4; L++)
            for (int i = 0; i < 4; i++)
                PERM_UNPACK[32 * (v / 2) + 8 * L + 4 * (v % 2) + i] = 16 * v + 4 * L + i;
}
#endif

/* ---- one column's CH rows of W as fp32 vectors --------------------------------------- */
#if SP_AVX512
typedef __m512 vec_t;

/* column with mask `word`, its values from index `at`; rows [0, 64) in 4 vectors (in
 * PERM_UNPACK's order for bf16 on the VBMI2 path, else in order) */
static inline __attribute__((always_inline)) void
expand_column(const call_t *c, uint64_t word, int64_t at, __m512 scale, __m512 w[4],
              const int VT) {
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
        for (int g = 0; g < 4; g++) w[g] = _mm512_mul_ps(w[g], scale);
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
    (void)scale;
#else
    for (int g = 0; g < 4; g++) { /* 16 rows: load the step's values packed, then expand */
        const __mmask16 m = (__mmask16)(word >> (16 * g));
        const int count = popcount64(m);
        const __mmask16 first = (__mmask16)((1u << count) - 1);
        __m512i packed;
        if (VT == V_I8) {
            packed = _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(first, v + at));
            w[g] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_maskz_expand_epi32(m, packed)),
                                 scale);
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
#define ROW_POSITION(VT, j) (SP_VBMI2 && (VT) == V_BF16 ? PERM_UNPACK[j] : (j))

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
expand_pass(const call_t *c, uint64_t word, int64_t at, int h, __m256 scale, __m256 w[2],
            const int VT) {
    const int shift = 16 * h;
    at += popcount64(word & ((1ull << shift) - 1)); /* rows below the pass */
    for (int g = 0; g < 2; g++) {
        const int m = (int)(word >> (shift + 8 * g)) & 0xff;
        const int count = popcount64((uint64_t)m);
        const __m256 packed = load8(c, at, count, VT);
        w[g] = _mm256_and_ps(
            _mm256_permutevar8x32_ps(packed, _mm256_loadu_si256((const __m256i *)EXPAND_IDX[m])),
            _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)EXPAND_MASK[m])));
        if (VT == V_I8) w[g] = _mm256_mul_ps(w[g], scale);
        at += count;
    }
}
#define ROW_POSITION(VT, j) (j)
#else
#define ROW_POSITION(VT, j) (j)
#endif

/* ---- a band's rows of x: the micro-kernel ------------------------------------------- */

/* the sums of R rows of x (from r0) for a pass's CH tile rows (from `first` in the band),
 * stored: lane position ROW_POSITION(j) holds tile row j */
static inline __attribute__((always_inline)) void
store_rows(const call_t *c, const float *sums, int64_t r0, const int R, int64_t o0, int nrows,
           const int VT) {
    for (int r = 0; r < R; r++) {
        const float *s = sums + r * CH;
        if (c->out_bf16) {
            uint16_t *o = (uint16_t *)c->out + (r0 + r) * c->ldo + o0;
            for (int j = 0; j < nrows; j++) o[j] = f32_to_bf16(s[ROW_POSITION(VT, j)]);
        } else {
            float *o = (float *)c->out + (r0 + r) * c->ldo + o0;
            for (int j = 0; j < nrows; j++) o[j] = s[ROW_POSITION(VT, j)];
        }
    }
    (void)VT;
}

#if SP_AVX512 || SP_AVX2
static inline __attribute__((always_inline)) void
band_pass(const call_t *c, int64_t to, int h, int64_t r0, const int R, const int VT) {
    vec_t acc[MR][NV]; /* a fixed size: R rows of it live in registers */
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = (vec_t){0};
    const float *x = c->x + r0 * c->ldx;
    for (int64_t ti = 0; ti < c->n_ti; ti++) {
        const int64_t t = to * c->n_ti + ti;
        int64_t at = c->offsets[t];
        if (at == c->offsets[t + 1]) continue; /* an empty tile adds nothing */
        const uint64_t *words = c->bitmap + t * TILE;
        const int cols = c->k - TILE * ti < TILE ? (int)(c->k - TILE * ti) : TILE;
#if SP_AVX512
        const __m512 scale = _mm512_set1_ps(VT == V_I8 ? c->scales[t] : 1.0f);
#else
        const __m256 scale = _mm256_set1_ps(VT == V_I8 ? c->scales[t] : 1.0f);
#endif
        const float *xk = x + TILE * ti;
        for (int col = 0; col < cols; col++) {
            const uint64_t word = words[col];
            const int64_t here = at;
            at += popcount64(word);
            if (!word) continue;
            vec_t w[NV];
#if SP_AVX512
            expand_column(c, word, here, scale, w, VT);
            (void)h;
#else
            expand_pass(c, word, here, h, scale, w, VT);
#endif
            for (int r = 0; r < R; r++) {
#if SP_AVX512
                const __m512 xb = _mm512_set1_ps(xk[r * c->ldx + col]);
                for (int v = 0; v < NV; v++) acc[r][v] = _mm512_fmadd_ps(w[v], xb, acc[r][v]);
#else
                const __m256 xb = _mm256_set1_ps(xk[r * c->ldx + col]);
                for (int v = 0; v < NV; v++) acc[r][v] = _mm256_fmadd_ps(w[v], xb, acc[r][v]);
#endif
            }
        }
    }
    float sums[MR * CH] __attribute__((aligned(64)));
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NV; v++)
#if SP_AVX512
            _mm512_store_ps(sums + r * CH + v * VL, acc[r][v]);
#else
            _mm256_store_ps(sums + r * CH + v * VL, acc[r][v]);
#endif
    const int64_t o0 = to * TILE + h * CH;
    const int nrows = c->n - o0 < CH ? (int)(c->n - o0) : CH;
    if (nrows > 0) store_rows(c, sums, r0, R, o0, nrows, VT);
}
#endif

/* plain C: each set bit's value into its row's sum, in the same order (k ascending) */
static void band_plain(const call_t *c, int64_t to, int64_t r0, int R, int vt) {
    float sums[MR * TILE] = {0};
    const float *x = c->x + r0 * c->ldx;
    for (int64_t ti = 0; ti < c->n_ti; ti++) {
        const int64_t t = to * c->n_ti + ti;
        int64_t at = c->offsets[t];
        const uint64_t *words = c->bitmap + t * TILE;
        const int cols = c->k - TILE * ti < TILE ? (int)(c->k - TILE * ti) : TILE;
        const float scale = vt == V_I8 ? c->scales[t] : 1.0f;
        for (int col = 0; col < cols; col++) {
            for (uint64_t word = words[col]; word; word &= word - 1, at++) {
                const int j = __builtin_ctzll(word);
                float w;
                switch (vt) {
                case V_BF16: w = bf16_to_f32(((const uint16_t *)c->values)[at]); break;
                case V_F16: w = fp16(c->values + 2 * at); break;
                case V_F32: w = ((const float *)c->values)[at]; break;
                default: w = (float)((const int8_t *)c->values)[at] * scale; break;
                }
                for (int r = 0; r < R; r++)
                    sums[r * TILE + j] = __builtin_fmaf(w, x[r * c->ldx + TILE * ti + col],
                                                        sums[r * TILE + j]);
            }
        }
    }
    const int64_t o0 = to * TILE;
    const int nrows = c->n - o0 < TILE ? (int)(c->n - o0) : TILE;
    for (int r = 0; r < R; r++) {
        if (c->out_bf16) {
            uint16_t *o = (uint16_t *)c->out + (r0 + r) * c->ldo + o0;
            for (int j = 0; j < nrows; j++) o[j] = f32_to_bf16(sums[r * TILE + j]);
        } else {
            memcpy((float *)c->out + (r0 + r) * c->ldo + o0, sums + r * TILE, nrows * 4);
        }
    }
}

#if SP_DP
/* bf16 x against bf16 values: columns k and k + 1 expanded together and interleaved into
 * word pairs (row j's two weights in one dword, in PERM_UNPACK's lane order), multiplied
 * with x's pair (x[k], x[k + 1]) by vdpbf16ps: half the widening and the FMAs of
 * band_pass. Each element is summed over the pairs of k ascending (a row's result is
 * independent of its batch), products exact, in vdpbf16ps's fp32 sums. */
static inline __attribute__((always_inline)) void
band_pass_dp(const call_t *c, int64_t to, int64_t r0, const int R) {
    __m512 acc[MR][4];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++) acc[r][v] = _mm512_setzero_ps();
    const uint16_t *x = c->xb + r0 * c->ldxb, *values = (const uint16_t *)c->values;
    for (int64_t ti = 0; ti < c->n_ti; ti++) {
        const int64_t t = to * c->n_ti + ti;
        int64_t at = c->offsets[t];
        if (at == c->offsets[t + 1]) continue;
        const uint64_t *words = c->bitmap + t * TILE;
        const int cols = c->k - TILE * ti < TILE ? (int)(c->k - TILE * ti) : TILE;
        const uint16_t *xk = x + TILE * ti;
        for (int col = 0; col < cols; col += 2) {
            const uint64_t w0 = words[col], w1 = col + 1 < cols ? words[col + 1] : 0;
            const uint16_t *p0 = values + at, *p1 = p0 + popcount64(w0);
            at += popcount64(w0) + popcount64(w1);
            if (!(w0 | w1)) continue;
            const __mmask32 lo0 = (__mmask32)w0, lo1 = (__mmask32)w1;
            const __m512i a0 = _mm512_maskz_expandloadu_epi16(lo0, p0);
            const __m512i b0 = _mm512_maskz_expandloadu_epi16((__mmask32)(w0 >> 32),
                                                              p0 + popcount64(lo0));
            const __m512i a1 = _mm512_maskz_expandloadu_epi16(lo1, p1);
            const __m512i b1 = _mm512_maskz_expandloadu_epi16((__mmask32)(w1 >> 32),
                                                              p1 + popcount64(lo1));
            const __m512bh pair[4] = {(__m512bh)_mm512_unpacklo_epi16(a0, a1),
                                      (__m512bh)_mm512_unpackhi_epi16(a0, a1),
                                      (__m512bh)_mm512_unpacklo_epi16(b0, b1),
                                      (__m512bh)_mm512_unpackhi_epi16(b0, b1)};
            for (int r = 0; r < R; r++) {
                const __m512bh xp = (__m512bh)_mm512_set1_epi32((int)load32(
                    (const uint8_t *)(xk + r * c->ldxb + col)));
                for (int v = 0; v < 4; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], pair[v], xp);
            }
        }
    }
    float sums[MR * CH] __attribute__((aligned(64)));
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++) _mm512_store_ps(sums + r * CH + v * VL, acc[r][v]);
    const int64_t o0 = to * TILE;
    const int nrows = c->n - o0 < TILE ? (int)(c->n - o0) : TILE;
    store_rows(c, sums, r0, R, o0, nrows, V_BF16);
}

static void band_dp(const call_t *c, int64_t to) {
    for (int64_t r0 = 0; r0 < c->rows; r0 += MR) {
        const int rows = c->rows - r0 < MR ? (int)(c->rows - r0) : MR;
#define DP_CALL(R) band_pass_dp(c, to, r0, R)
        FOR_ROWS_1_TO_6(rows, DP_CALL)
#undef DP_CALL
    }
}
#endif

/* band `to`, every row of x in blocks of MR; one function per value type, so the type is
 * a constant inside the loops */
#if SP_AVX512 || SP_AVX2
static inline __attribute__((always_inline)) void
band_all(const call_t *c, int64_t to, const int VT) {
    for (int h = 0; h < TILE / CH; h++)
        for (int64_t r0 = 0; r0 < c->rows; r0 += MR) {
            const int rows = c->rows - r0 < MR ? (int)(c->rows - r0) : MR;
#define BAND_CALL(R) band_pass(c, to, h, r0, R, VT)
            FOR_ROWS_1_TO_6(rows, BAND_CALL)
#undef BAND_CALL
        }
}
static void band_bf16(const call_t *c, int64_t to) { band_all(c, to, V_BF16); }
static void band_f16(const call_t *c, int64_t to) { band_all(c, to, V_F16); }
static void band_f32(const call_t *c, int64_t to) { band_all(c, to, V_F32); }
static void band_i8(const call_t *c, int64_t to) { band_all(c, to, V_I8); }
#endif

typedef void (*band_fn)(const call_t *, int64_t);

static void band_plain_all(const call_t *c, int64_t to, int vt) {
    for (int64_t r0 = 0; r0 < c->rows; r0 += MR)
        band_plain(c, to, r0, c->rows - r0 < MR ? (int)(c->rows - r0) : MR, vt);
}

static int product(call_t *c, int vt, int num_threads, int plain) {
    const int64_t n_to = (c->n + TILE - 1) / TILE;
    band_fn band = 0;
#if SP_AVX512 || SP_AVX2
    if (!plain) band = vt == V_BF16 ? band_bf16 : vt == V_F16 ? band_f16
                     : vt == V_F32 ? band_f32 : band_i8;
#if SP_DP
    if (!plain && c->xb) band = band_dp;
#endif
#endif
    (void)plain;
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")
    for (int64_t to = 0; to < n_to; to++) {
        if (band)
            band(c, to);
        else
            band_plain_all(c, to, vt);
    }
    return 0;
}

static int make_call(call_t *c, const uint64_t *bitmap, const int64_t *offsets,
                     const void *values, int vt, const float *scales, int64_t n, int64_t k) {
    if (vt < V_BF16 || vt > V_I8 || (vt == V_I8 && !scales) || n <= 0 || k <= 0) return -1;
    const int64_t n_ti = (k + TILE - 1) / TILE, tiles = (n + TILE - 1) / TILE * n_ti;
    memset(c, 0, sizeof *c);
    c->bitmap = bitmap, c->offsets = offsets, c->values = values, c->scales = scales;
    c->n = n, c->k = k, c->n_ti = n_ti, c->nnz = offsets[tiles];
    return 0;
}

/* Which paths this build has: 1 (the kernel), | 2 AVX-512, | 4 VBMI2's expanding loads,
 * | 8 AVX2, | 16 bf16 x against bf16 values by vdpbf16ps (other bits than the FMA paths'). */
int sparse_tiles_available(void) {
    return 1 | (SP_AVX512 ? 2 : 0) | (SP_VBMI2 ? 4 : 0) | (SP_AVX2 ? 8 : 0) | (SP_DP ? 16 : 0);
}

/* x [rows, k] (row stride ldx) . W^T -> out [rows, n] (row stride ldo), x and out fp32
 * (x_bf16 0) or bf16 (x_bf16 1: x widened to fp32, exactly, and the sums rounded once to
 * bf16); W the tiles (bitmap, offsets, values of type vt: 0 bf16, 1 fp16, 2 fp32, 3 int8
 * with scales). plain: the plain-C path (tests). Returns -1 for an unknown value type,
 * int8 values without scales, an empty shape, or memory for the widened x run out. */
int sparse_tiles(const void *xv, int x_bf16, int64_t rows, int64_t ldx, const uint64_t *bitmap,
                 const int64_t *offsets, const void *values, int vt, const float *scales,
                 int64_t n, int64_t k, void *out, int64_t ldo, int num_threads, int plain) {
    call_t c;
    if (make_call(&c, bitmap, offsets, values, vt, scales, n, k)) return -1;
    if (rows <= 0) return 0;
    if (!x_bf16) {
        c.x = xv, c.rows = rows, c.ldx = ldx, c.out = out, c.ldo = ldo, c.out_bf16 = 0;
        return product(&c, vt, num_threads, plain);
    }
    const uint16_t *x = xv;
#if SP_DP
    if (vt == V_BF16 && !plain) { /* x as bf16 pairs, a zero past the last channel */
        uint16_t *xb = malloc((size_t)rows * (k + 1) * 2);
        if (!xb) return -1;
        for (int64_t r = 0; r < rows; r++) {
            memcpy(xb + r * (k + 1), x + r * ldx, (size_t)k * 2);
            xb[r * (k + 1) + k] = 0;
        }
        c.xb = xb, c.ldxb = k + 1, c.rows = rows, c.out = out, c.ldo = ldo, c.out_bf16 = 1;
        const int status = product(&c, vt, num_threads, plain);
        free(xb);
        return status;
    }
#endif
    float *xf = malloc((size_t)rows * k * 4);
    if (!xf) return -1;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < k; i++) xf[r * k + i] = bf16_to_f32(x[r * ldx + i]);
    c.x = xf, c.rows = rows, c.ldx = k, c.out = out, c.ldo = ldo, c.out_bf16 = 1;
    const int status = product(&c, vt, num_threads, plain);
    free(xf);
    return status;
}
