/* Products against a weight kept in fusegen's sparse tiles (kernels/sparse_format.py):
 * out [T, N] = x [T, K] W^T, W [N, K] stored as 64 x 64 tiles, row-tile major, each a
 * bitmap (one 64-bit word a local column c: bit j set iff row j of that column is kept),
 * its kept values packed column by column (c ascending, then j ascending) and an offset
 * into them; with int8 values one fp32 scale a tile (value = code x scale).
 *
 * How ("load as sparse, compute as dense", after Flash-LLM): threads split the row-tiles
 * (bands of 64 output rows). A step is one column of a tile (two for `vdpbf16ps`, below):
 * its mask word expands its packed values into the column's 64 rows of W, as fp32 vectors
 * (zeros where the bitmap has none), and each row of x multiplies them by its x[r, k]
 * broadcast, an FMA a vector, into the 64 sums of each row, kept in registers for MR = 6
 * rows (AVX-512: 4 zmm a row, 24 sums). A step whose columns keep nothing is skipped.
 *   Few rows (T <= MR): each step is expanded in registers, used by the rows, dropped.
 *   Many rows (T > MR, `band_many`): a run of a band's tiles (up to 256 KB expanded) is
 *     expanded once into a per-thread scratch, step after non-empty step, each 256 B as
 *     the registers would hold it, and every block of MR rows runs the dense inner loop
 *     over it (loads instead of expansions: Flash-LLM's compute-as-dense). Between runs
 *     the sums wait in the scratch, exact fp32.
 * The expansions:
 *   AVX-512 with VBMI2: vpexpandw / vpexpandb load a column's 32 16-bit or 64 8-bit values
 *     straight to their rows (bf16 widened by an unpack with zeros, which leaves the rows
 *     in each 128-bit lane's order; the stores put them back, `LAYOUT_UNPACK`), fp32 by
 *     vexpandps, 16 rows a load.
 *   AVX-512 without VBMI2: 16 rows a step: the step's values loaded (a masked load of as
 *     many as the mask has bits), widened to fp32, then vexpandps / vpexpandd.
 *   AVX2: 16 rows a pass (two ymm, MR = 6: 12 sums): 8 rows a step, the values loaded
 *     packed, widened and moved to their rows by vpermd with a table indexed by the mask
 *     byte, the empty lanes zeroed.
 *   plain C: each set bit's value added into its row's sum, the reference expansion.
 *   bf16 x with AVX512_BF16 (and VBMI2) against bf16 values, and with VBMI too against
 *     int8 values: two columns a step, their expanded words interleaved into pairs and
 *     multiplied by vdpbf16ps; int8 codes become bf16 (exact: |code| <= 127) by two
 *     128-entry byte tables (vpermi2b, the low and high byte of bf16(|code|)) and the
 *     code's sign (`pairs_i8`, `LAYOUT_PAIR8`).
 * The path is chosen by the compiler's target flags (native.py builds with -march=native).
 *
 * Numerics: every output element is one fp32 sum over the non-empty steps, k ascending,
 * x[r, k] x W[o, k] added by an FMA each (vdpbf16ps's pairs of k for bf16 x against bf16
 * or int8 values, where the build has it: other bits than the FMA paths'). int8 values
 * sum code x x[r, k] over a tile (codes exact in fp32 and bf16) and add that tile sum x
 * the tile's scale to the element's sum by one FMA, tile after tile (the scale folded
 * after the tile's dot, not into each value). The few-row and many-row paths take the
 * same steps in the same order with the same instructions, and the scratch keeps sums
 * exactly, so the choice between them (by T alone) changes no bit: a row's result is
 * the same whatever T, its place in the batch and the thread count (batch-invariant, as
 * the engine's deterministic mode needs). bf16 x is widened to fp32 (exact) and the sums
 * rounded once to bf16; fp32 x gives fp32 sums.
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
    const float *x; /* [rows, k] fp32, row stride ldx */
    int64_t rows, ldx;
    void *out; /* [rows, n], row stride ldo: fp32, or bf16 for out_bf16 */
    int64_t ldo;
    int out_bf16;
    const uint16_t *xb; /* SP_DP: bf16 x [rows, ldxb], one zero past k (pairs of channels) */
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

/* ---- few rows: each step expanded in registers ----------------------------------------- */
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

/* rows [r0, r0 + R) against pass h's CH rows of band `to`; int8: each tile's sum of
 * code x x folded into `total` with the tile's scale */
static inline __attribute__((always_inline)) void
band_pass(const call_t *c, int64_t to, int h, int64_t r0, const int R, const int VT) {
    vec_t acc[MR][NV], total[MR][NV]; /* fixed sizes: R rows of them live in registers */
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = total[r][v] = (vec_t){0};
    const float *x = c->x + r0 * c->ldx;
    for (int64_t ti = 0; ti < c->n_ti; ti++) {
        const int64_t t = to * c->n_ti + ti;
        int64_t at = c->offsets[t];
        if (at == c->offsets[t + 1]) continue; /* an empty tile adds nothing */
        const uint64_t *words = c->bitmap + t * TILE;
        const int cols = c->k - TILE * ti < TILE ? (int)(c->k - TILE * ti) : TILE;
        const float *xk = x + TILE * ti;
        for (int col = 0; col < cols; col++) {
            const uint64_t word = words[col];
            const int64_t here = at;
            at += popcount64(word);
            if (!word) continue;
            vec_t w[NV];
#if SP_AVX512
            expand_step(c, word, here, w, VT);
            (void)h;
#else
            expand_pass(c, word, here, h, w, VT);
#endif
            for (int r = 0; r < R; r++) {
                const vec_t xb = VSET1(xk[r * c->ldx + col]);
                for (int v = 0; v < NV; v++) acc[r][v] = VFMA(w[v], xb, acc[r][v]);
            }
        }
        if (VT == V_I8) {
            const vec_t scale = VSET1(c->scales[t]);
            for (int r = 0; r < R; r++)
                for (int v = 0; v < NV; v++) {
                    total[r][v] = VFMA(acc[r][v], scale, total[r][v]);
                    acc[r][v] = (vec_t){0};
                }
        }
    }
    float sums[MR * CH] __attribute__((aligned(64)));
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NV; v++)
            VSTORE(sums + r * CH + v * VL, VT == V_I8 ? total[r][v] : acc[r][v]);
    const int64_t o0 = to * TILE + h * CH;
    const int nrows = band_rows(c, o0, CH);
    if (nrows > 0) store_rows(c, sums, CH, r0, R, o0, nrows, LAYOUT(VT, 0));
}
#endif

/* plain C: each set bit's value into its row's sum, in the same order (k ascending; int8:
 * each tile's sum of codes x x folded in with its scale) */
static void band_plain(const call_t *c, int64_t to, int64_t r0, int R, int vt) {
    float sums[MR * TILE] = {0}, part[MR * TILE] = {0};
    float *acc = vt == V_I8 ? part : sums;
    const float *x = c->x + r0 * c->ldx;
    for (int64_t ti = 0; ti < c->n_ti; ti++) {
        const int64_t t = to * c->n_ti + ti;
        int64_t at = c->offsets[t];
        if (at == c->offsets[t + 1]) continue;
        const uint64_t *words = c->bitmap + t * TILE;
        const int cols = c->k - TILE * ti < TILE ? (int)(c->k - TILE * ti) : TILE;
        for (int col = 0; col < cols; col++) {
            for (uint64_t word = words[col]; word; word &= word - 1, at++) {
                const int j = __builtin_ctzll(word);
                float w;
                switch (vt) {
                case V_BF16: w = bf16_to_f32(((const uint16_t *)c->values)[at]); break;
                case V_F16: w = fp16(c->values + 2 * at); break;
                case V_F32: w = ((const float *)c->values)[at]; break;
                default: w = (float)((const int8_t *)c->values)[at]; break;
                }
                for (int r = 0; r < R; r++)
                    acc[r * TILE + j] = __builtin_fmaf(w, x[r * c->ldx + TILE * ti + col],
                                                       acc[r * TILE + j]);
            }
        }
        if (vt == V_I8)
            for (int i = 0; i < R * TILE; i++) {
                sums[i] = __builtin_fmaf(part[i], c->scales[t], sums[i]);
                part[i] = 0.0f;
            }
    }
    const int64_t o0 = to * TILE;
    store_rows(c, sums, TILE, r0, R, o0, band_rows(c, o0, TILE), LAYOUT_NATURAL);
}

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

/* bf16 x against bf16 (or int8) values: columns k and k + 1 expanded together into word
 * pairs, multiplied with x's pair (x[k], x[k + 1]) by vdpbf16ps: half the widening and
 * the FMAs of band_pass. Each element is summed over the pairs of k ascending, products
 * exact, in vdpbf16ps's fp32 sums; int8: each tile's sum folded in with its scale. */
static inline __attribute__((always_inline)) void
band_pass_dp(const call_t *c, int64_t to, int64_t r0, const int R, const int VT) {
    __m512 acc[MR][4], total[MR][4];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++) acc[r][v] = total[r][v] = _mm512_setzero_ps();
    const uint16_t *x = c->xb + r0 * c->ldxb;
    for (int64_t ti = 0; ti < c->n_ti; ti++) {
        const int64_t t = to * c->n_ti + ti;
        int64_t at = c->offsets[t];
        if (at == c->offsets[t + 1]) continue;
        const uint64_t *words = c->bitmap + t * TILE;
        const int cols = c->k - TILE * ti < TILE ? (int)(c->k - TILE * ti) : TILE;
        const uint16_t *xk = x + TILE * ti;
        for (int col = 0; col < cols; col += 2) {
            const uint64_t w0 = words[col], w1 = col + 1 < cols ? words[col + 1] : 0;
            const int64_t here = at;
            at += popcount64(w0) + popcount64(w1);
            if (!(w0 | w1)) continue;
            __m512i pair[4];
            expand_pair(c, w0, w1, here, pair, VT);
            for (int r = 0; r < R; r++) {
                const __m512bh xp = (__m512bh)_mm512_set1_epi32((int)load32(
                    (const uint8_t *)(xk + r * c->ldxb + col)));
                for (int v = 0; v < 4; v++)
                    acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)pair[v], xp);
            }
        }
        if (VT == V_I8) {
            const __m512 scale = _mm512_set1_ps(c->scales[t]);
            for (int r = 0; r < R; r++)
                for (int v = 0; v < 4; v++) {
                    total[r][v] = _mm512_fmadd_ps(acc[r][v], scale, total[r][v]);
                    acc[r][v] = _mm512_setzero_ps();
                }
        }
    }
    float sums[MR * TILE] __attribute__((aligned(64)));
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++)
            _mm512_store_ps(sums + r * TILE + v * VL, VT == V_I8 ? total[r][v] : acc[r][v]);
    const int64_t o0 = to * TILE;
    store_rows(c, sums, TILE, r0, R, o0, band_rows(c, o0, TILE), LAYOUT(VT, 1));
}
#endif

/* ---- many rows: a run of tiles expanded once, every row block over it ------------------ */
#if SP_AVX512 || SP_AVX2
/* A thread's scratch, kept for the thread's next calls (grown, never shrunk): the
 * expanded steps of a run of tiles, each step's first channel, where each tile's steps
 * end and its scale, and the sums of every row between runs. */
typedef struct {
    float *steps;    /* [SCRATCH_STEPS][STEP_FLOATS] */
    int32_t *k;      /* [SCRATCH_STEPS] */
    int32_t *ends;   /* [run tiles] */
    float *scale;    /* [run tiles] */
    float *sums;     /* [rows][TILE], in the path's layout */
} scratch_t;

static __thread void *scratch_block;
static __thread size_t scratch_size;

/* this thread's scratch for `rows` rows, or 0 when memory runs out */
static int thread_scratch(scratch_t *s, int64_t rows) {
    const size_t steps = (size_t)SCRATCH_STEPS * STEP_FLOATS * 4, ks = SCRATCH_STEPS * 4,
                 tiles = SCRATCH_STEPS / 32 * 4, sums = (size_t)rows * TILE * 4;
    const size_t need = steps + ks + 2 * tiles + sums;
    if (need > scratch_size) {
        free(scratch_block);
        scratch_size = 0;
        scratch_block = aligned_alloc(64, (need + 63) / 64 * 64);
        if (!scratch_block) return 0;
        scratch_size = need;
    }
    char *p = scratch_block;
    s->steps = (float *)p, s->sums = (float *)(p + steps);
    s->k = (int32_t *)(p + steps + sums), s->ends = (int32_t *)(p + steps + sums + ks);
    s->scale = (float *)(p + steps + sums + ks + tiles);
    return 1;
}

/* one step (its NV vectors w, first channel k) into R rows' sums of a pass */
static inline __attribute__((always_inline)) void
step_rows(const call_t *c, const vec_t w[NV], int64_t k, int64_t r0, const int R,
          vec_t acc[MR][NV], const int DP) {
#if SP_DP
    if (DP) {
        const uint16_t *xb = c->xb + r0 * c->ldxb + k;
        for (int r = 0; r < R; r++) {
            const __m512bh xp = (__m512bh)_mm512_set1_epi32((int)load32(
                (const uint8_t *)(xb + r * c->ldxb)));
            for (int v = 0; v < NV; v++)
                acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)_mm512_castps_si512(w[v]), xp);
        }
        return;
    }
#endif
    const float *x = c->x + r0 * c->ldx + k;
    for (int r = 0; r < R; r++) {
        const vec_t xb = VSET1(x[r * c->ldx]);
        for (int v = 0; v < NV; v++) acc[r][v] = VFMA(w[v], xb, acc[r][v]);
    }
    (void)DP;
}

/* R rows' sums of pass h from `sums` (or zero) into registers, and back */
static inline __attribute__((always_inline)) void
load_sums(vec_t acc[MR][NV], const float *sums, int h, const int R, int zero) {
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NV; v++)
            acc[r][v] = zero ? (vec_t){0} : VLOAD(sums + r * TILE + h * CH + v * VL);
}
static inline __attribute__((always_inline)) void
store_sums(float *sums, vec_t acc[MR][NV], int h, const int R) {
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NV; v++) VSTORE(sums + r * TILE + h * CH + v * VL, acc[r][v]);
}

/* int8: a tile's sums of codes x x (acc) into `sums` with its scale, acc zeroed */
static inline __attribute__((always_inline)) void
fold_tile(float *sums, vec_t acc[MR][NV], float scale, int h, const int R) {
    const vec_t s = VSET1(scale);
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NV; v++) {
            float *p = sums + r * TILE + h * CH + v * VL;
            VSTORE(p, VFMA(acc[r][v], s, VLOAD(p)));
            acc[r][v] = (vec_t){0};
        }
}

/* Tiles [ti0, ti1) of band `to`: their non-empty steps expanded into the scratch in
 * order, and (AVX-512, R > 0) rows [r0, r0 + R) multiplied by each step as it is
 * expanded, so the expansion overlaps their arithmetic; their sums as `rows_over_run`
 * keeps them. Returns the step count. */
static inline __attribute__((always_inline)) int64_t
expand_run(const call_t *c, int64_t to, int64_t ti0, int64_t ti1, scratch_t *s, float *sums,
           int64_t r0, const int R, int first, const int VT, const int DP) {
    vec_t acc[MR][NV];
    load_sums(acc, sums, 0, R, first || VT == V_I8);
    int64_t n = 0;
    for (int64_t ti = ti0; ti < ti1; ti++) {
        const int64_t t = to * c->n_ti + ti, n0 = n;
        int64_t at = c->offsets[t];
        const uint64_t *words = c->bitmap + t * TILE;
        const int cols = c->k - TILE * ti < TILE ? (int)(c->k - TILE * ti) : TILE;
        s->scale[ti - ti0] = VT == V_I8 ? c->scales[t] : 1.0f;
        for (int col = 0; at < c->offsets[t + 1] && col < cols; col += DP ? 2 : 1) {
            const uint64_t w0 = words[col], w1 = DP && col + 1 < cols ? words[col + 1] : 0;
            const int64_t here = at;
            at += popcount64(w0) + popcount64(w1);
            if (!(w0 | w1)) continue;
            float *dst = s->steps + n * STEP_FLOATS;
            const int64_t k = TILE * ti + col;
            /* the values a few steps on, asked for into L1 while this step is used */
            const char *ahead = (const char *)c->values + (here << VALUE_SHIFT(VT)) + 1024;
            _mm_prefetch(ahead, _MM_HINT_T0);
            _mm_prefetch(ahead + 64, _MM_HINT_T0);
#if SP_AVX512
            vec_t w[NV];
#if SP_DP
            if (DP) {
                __m512i pair[4];
                expand_pair(c, w0, w1, here, pair, VT);
                for (int v = 0; v < 4; v++) w[v] = _mm512_castsi512_ps(pair[v]);
            } else
#endif
                expand_step(c, w0, here, w, VT);
            for (int v = 0; v < NV; v++) VSTORE(dst + v * VL, w[v]);
            step_rows(c, w, k, r0, R, acc, DP);
#else
            for (int h = 0; h < TILE / CH; h++) {
                vec_t w[NV];
                expand_pass(c, w0, here, h, w, VT);
                for (int v = 0; v < NV; v++) VSTORE(dst + h * CH + v * VL, w[v]);
            }
#endif
            s->k[n++] = (int32_t)k;
        }
        s->ends[ti - ti0] = (int32_t)n;
        (void)r0;
        if (VT == V_I8 && n > n0) fold_tile(sums, acc, s->scale[ti - ti0], 0, R);
    }
    if (VT != V_I8) store_sums(sums, acc, 0, R);
    return n;
}

/* rows [r0, r0 + R) over a run of `run` tiles expanded in the scratch: their sums start
 * from `sums` (or zero, for the band's first run) and go back there; int8 sums each tile
 * and folds it into `sums` */
static inline __attribute__((always_inline)) void
rows_over_run(const call_t *c, const scratch_t *s, int64_t run, float *sums, int64_t r0,
              const int R, int first, const int VT, const int DP) {
    for (int h = 0; h < TILE / CH; h++) {
        vec_t acc[MR][NV];
        load_sums(acc, sums, h, R, first || VT == V_I8);
        for (int64_t i = 0, n = 0; i < run; i++) {
            for (; n < s->ends[i]; n++) {
                const float *w = s->steps + n * STEP_FLOATS + h * CH;
                vec_t wv[NV];
                for (int v = 0; v < NV; v++) wv[v] = VLOAD(w + v * VL);
                step_rows(c, wv, s->k[n], r0, R, acc, DP);
            }
            if (VT == V_I8 && (i ? s->ends[i - 1] : 0) < s->ends[i])
                fold_tile(sums, acc, s->scale[i], h, R);
        }
        if (VT != V_I8) store_sums(sums, acc, h, R);
    }
}

/* band `to` for rows [r_begin, r_end), in runs of as many tiles as the scratch holds;
 * the first block of rows multiplied as the run is expanded (AVX-512), the others over
 * the scratch; each row's sums (int8: its tiles' scaled sums) wait in the scratch
 * between runs */
static inline __attribute__((always_inline)) void
band_many(const call_t *c, int64_t to, int64_t r_begin, int64_t r_end, scratch_t *s,
          const int VT, const int DP) {
    const int64_t run_tiles = SCRATCH_STEPS / (DP ? TILE / 2 : TILE);
    if (VT == V_I8) memset(s->sums, 0, (size_t)(r_end - r_begin) * TILE * 4);
    for (int64_t ti = 0; ti < c->n_ti; ti += run_tiles) {
        const int64_t ti1 = ti + run_tiles < c->n_ti ? ti + run_tiles : c->n_ti;
        /* rows multiplied while expanding: the first block of MR (AVX-512) */
        const int fused = !SP_AVX512 ? 0 : r_end - r_begin < MR ? (int)(r_end - r_begin) : MR;
#if SP_AVX512
#define EXPAND_CALL(R) expand_run(c, to, ti, ti1, s, s->sums, r_begin, R, ti == 0, VT, DP)
        FOR_ROWS_1_TO_6(fused, EXPAND_CALL)
#undef EXPAND_CALL
#else
        expand_run(c, to, ti, ti1, s, s->sums, r_begin, 0, ti == 0, VT, DP);
#endif
        for (int64_t r0 = r_begin + fused; r0 < r_end; r0 += MR) {
            const int rows = r_end - r0 < MR ? (int)(r_end - r0) : MR;
            float *sums = s->sums + (r0 - r_begin) * TILE;
#define RUN_CALL(R) rows_over_run(c, s, ti1 - ti, sums, r0, R, ti == 0, VT, DP)
            FOR_ROWS_1_TO_6(rows, RUN_CALL)
#undef RUN_CALL
        }
    }
    for (int64_t r0 = r_begin; r0 < r_end; r0 += MR) {
        const int rows = r_end - r0 < MR ? (int)(r_end - r0) : MR;
        store_rows(c, s->sums + (r0 - r_begin) * TILE, TILE, r0, rows, to * TILE,
                   band_rows(c, to * TILE, TILE), LAYOUT(VT, DP));
    }
}
#endif

/* ---- the band functions, one per path and value type (the type a constant inside) ---- */
typedef void (*band_fn)(const call_t *, int64_t, int64_t, int64_t); /* band, rows [a, b) */

#if SP_AVX512 || SP_AVX2
static inline __attribute__((always_inline)) void
band_few(const call_t *c, int64_t to, int64_t r_begin, int64_t r_end, const int VT,
         const int DP) {
    for (int h = 0; h < (DP ? 1 : TILE / CH); h++)
        for (int64_t r0 = r_begin; r0 < r_end; r0 += MR) {
            const int rows = r_end - r0 < MR ? (int)(r_end - r0) : MR;
#if SP_DP
#define BAND_CALL(R) DP ? band_pass_dp(c, to, r0, R, VT) : band_pass(c, to, h, r0, R, VT)
#else
#define BAND_CALL(R) band_pass(c, to, h, r0, R, VT)
#endif
            FOR_ROWS_1_TO_6(rows, BAND_CALL)
#undef BAND_CALL
        }
}

/* T > MR rows take the many-row path (each step then expanded once, not once per block
 * of MR rows); the same bits either way. Without memory for the scratch, the few-row
 * path. */
static inline __attribute__((always_inline)) void
band(const call_t *c, int64_t to, int64_t r_begin, int64_t r_end, const int VT, const int DP) {
    scratch_t s;
    if (c->rows > MR && thread_scratch(&s, r_end - r_begin))
        band_many(c, to, r_begin, r_end, &s, VT, DP);
    else
        band_few(c, to, r_begin, r_end, VT, DP);
}
#define BAND_FN(NAME, VT, DP)                                                             \
    static void NAME(const call_t *c, int64_t to, int64_t a, int64_t b) { band(c, to, a, b, VT, DP); }
BAND_FN(band_bf16, V_BF16, 0)
BAND_FN(band_f16, V_F16, 0)
BAND_FN(band_f32, V_F32, 0)
BAND_FN(band_i8, V_I8, 0)
#if SP_DP
BAND_FN(band_dp_bf16, V_BF16, 1)
#endif
#if SP_DP_I8
BAND_FN(band_dp_i8, V_I8, 1)
#endif
#endif

static void band_plain_all(const call_t *c, int64_t to, int64_t r_begin, int64_t r_end,
                           int vt) {
    for (int64_t r0 = r_begin; r0 < r_end; r0 += MR)
        band_plain(c, to, r0, r_end - r0 < MR ? (int)(r_end - r0) : MR, vt);
}

/* whether bf16 x against values of type vt goes by vdpbf16ps in this build */
static int by_pairs(int vt) {
    return (SP_DP && vt == V_BF16) || (SP_DP_I8 && vt == V_I8);
}

static int product(call_t *c, int vt, int num_threads, int plain) {
    const int64_t n_to = (c->n + TILE - 1) / TILE;
    band_fn fn = 0;
#if SP_AVX512 || SP_AVX2
    if (!plain) fn = vt == V_BF16 ? band_bf16 : vt == V_F16 ? band_f16
                   : vt == V_F32 ? band_f32 : band_i8;
#if SP_DP
    if (!plain && c->xb) fn = vt == V_BF16 ? band_dp_bf16 : fn;
#endif
#if SP_DP_I8
    if (!plain && c->xb) fn = vt == V_I8 ? band_dp_i8 : fn;
#endif
#endif
    (void)plain;
    /* Work items: a band and a group of rows. Where the bands do not split evenly among
     * the threads, many rows are cut into up to one group a thread (of whole blocks of
     * MR rows), so every thread gets the same count of items; a group expands its band's
     * tiles again, which its >= 2 MR rows pay for. A row's sums do not depend on it. */
    int64_t group = c->rows;
    if (c->rows > MR && num_threads > 1 && n_to % num_threads) {
        const int64_t groups = c->rows / (2 * MR) < num_threads ? c->rows / (2 * MR) : num_threads;
        if (groups > 1) group = ((c->rows + groups - 1) / groups + MR - 1) / MR * MR;
    }
    const int64_t per_band = (c->rows + group - 1) / group;
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")
    for (int64_t item = 0; item < n_to * per_band; item++) {
        const int64_t to = item / per_band, r0 = item % per_band * group;
        const int64_t r1 = r0 + group < c->rows ? r0 + group : c->rows;
        if (fn)
            fn(c, to, r0, r1);
        else
            band_plain_all(c, to, r0, r1, vt);
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
 * | 8 AVX2, | 16 bf16 x against bf16 values by vdpbf16ps, | 32 bf16 x against int8 values
 * by vdpbf16ps (16 and 32: other bits than the FMA paths'). */
int sparse_tiles_available(void) {
    return 1 | (SP_AVX512 ? 2 : 0) | (SP_VBMI2 ? 4 : 0) | (SP_AVX2 ? 8 : 0) | (SP_DP ? 16 : 0)
         | (SP_DP_I8 ? 32 : 0);
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
    if (by_pairs(vt) && !plain) { /* x as bf16 pairs, a zero past the last channel */
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
    float *xf = malloc((size_t)rows * k * 4);
    if (!xf) return -1;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < k; i++) xf[r * k + i] = bf16_to_f32(x[r * ldx + i]);
    c.x = xf, c.rows = rows, c.ldx = k, c.out = out, c.ldo = ldo, c.out_bf16 = 1;
    const int status = product(&c, vt, num_threads, plain);
    free(xf);
    return status;
}
