/* Products against a weight kept in fusegen's sparse tiles (kernels/sparse_format.py):
 * out [T, N] = x [T, K] W^T, W [N, K] stored as 64 x 64 tiles, row-tile major, each a
 * bitmap (one 64-bit word a local column c: bit j set iff row j of that column is kept),
 * its kept values packed column by column (c ascending, then j ascending) and an offset
 * into them; with int8 values one fp32 scale a tile (value = code x scale).
 *
 * A call may carry several such weights side by side (`segment_t`: a fused parameter's
 * parts, q, k and v or gate and up), each writing its columns of one output; their bands
 * are split among the threads as one list.
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
/* the sums keep the order written: an element's value must not depend on which inlined
 * copy of the kernel computed it */
#pragma GCC optimize("no-associative-math")

#include "sparse_tiles.h"

/* ---- few rows: each step expanded in registers ----------------------------------------- */
#if SP_AVX512 || SP_AVX2

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

#include "sparse_tiles_many.h"

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

static void band_plain_all(const call_t *c, int64_t to, int64_t r_begin, int64_t r_end) {
    for (int64_t r0 = r_begin; r0 < r_end; r0 += MR)
        band_plain(c, to, r0, r_end - r0 < MR ? (int)(r_end - r0) : MR, c->vt);
}

/* whether bf16 x against values of type vt goes by vdpbf16ps in this build */
static int by_pairs(int vt) {
    return (SP_DP && vt == V_BF16) || (SP_DP_I8 && vt == V_I8);
}

/* the band function of values of type vt, bf16 x as pairs (`pairs`) or not */
static band_fn band_for(int vt, int pairs, int plain) {
    if (plain) return band_plain_all;
    (void)pairs;
#if SP_DP
    if (pairs && vt == V_BF16) return band_dp_bf16;
#endif
#if SP_DP_I8
    if (pairs && vt == V_I8) return band_dp_i8;
#endif
#if SP_AVX512 || SP_AVX2
    return vt == V_BF16 ? band_bf16 : vt == V_F16 ? band_f16 : vt == V_F32 ? band_f32 : band_i8;
#else
    return band_plain_all;
#endif
}

/* one weight of a call (sparse_linear.py's _Segment): its tiles, its output rows (the
 * call's next n columns) and its value type (0 bf16, 1 fp16, 2 fp32, 3 int8 with scales) */
typedef struct {
    const uint64_t *bitmap; /* [tiles, 64] */
    const int64_t *offsets; /* [tiles + 1] */
    const void *values;     /* [nnz] */
    const float *scales;    /* [tiles], int8 only */
    int64_t n, vt;
} segment_t;

#define MAX_SEGMENTS 64

/* the bands of every segment, in order, split among `num_threads` threads (which thread
 * runs what changes no bit) */
static int product(const call_t *calls, const band_fn *fns, int num_segments, int64_t rows,
                   int num_threads) {
    int64_t first[MAX_SEGMENTS + 1]; /* each segment's first band in the call's list */
    first[0] = 0;
    for (int s = 0; s < num_segments; s++)
        first[s + 1] = first[s] + (calls[s].n + TILE - 1) / TILE;
    const int64_t n_to = first[num_segments];
    /* Work items: a band and a group of rows. Where the bands do not split evenly among
     * the threads, many rows are cut into up to one group a thread (of whole blocks of
     * MR rows), so every thread gets the same count of items; a group expands its band's
     * tiles again, which its >= 2 MR rows pay for. A row's sums do not depend on it. */
    int64_t group = rows;
    if (rows > MR && num_threads > 1 && n_to % num_threads) {
        const int64_t groups = rows / (2 * MR) < num_threads ? rows / (2 * MR) : num_threads;
        if (groups > 1) group = ((rows + groups - 1) / groups + MR - 1) / MR * MR;
    }
    const int64_t per_band = (rows + group - 1) / group;
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")
    for (int64_t item = 0; item < n_to * per_band; item++) {
        const int64_t b = item / per_band, r0 = item % per_band * group;
        const int64_t r1 = r0 + group < rows ? r0 + group : rows;
        int s = 0;
        while (b >= first[s + 1]) s++;
        fns[s](&calls[s], b - first[s], r0, r1);
    }
    return 0;
}

/* Which paths this build has: 1 (the kernel), | 2 AVX-512, | 4 VBMI2's expanding loads,
 * | 8 AVX2, | 16 bf16 x against bf16 values by vdpbf16ps, | 32 bf16 x against int8 values
 * by vdpbf16ps (16 and 32: other bits than the FMA paths'). */
int sparse_tiles_available(void) {
    return 1 | (SP_AVX512 ? 2 : 0) | (SP_VBMI2 ? 4 : 0) | (SP_AVX2 ? 8 : 0) | (SP_DP ? 16 : 0)
         | (SP_DP_I8 ? 32 : 0);
}

/* x [rows, k] (row stride ldx) . [W_0; W_1; ...]^T -> out [rows, sum of n_s] (row stride
 * ldo): segment s's weight W_s [n_s, k] writes the n_s columns after the segments before
 * it. x and out fp32 (x_bf16 0) or bf16 (x_bf16 1: x widened to fp32, exactly, and the
 * sums rounded once to bf16). plain: the plain-C path (tests). Returns -1 for a segment
 * with an unknown value type, int8 values without scales or no rows, an empty k, more
 * than MAX_SEGMENTS segments, or memory for a widened x run out. */
int sparse_tiles(const void *xv, int x_bf16, int64_t rows, int64_t ldx, const segment_t *segments,
                 int num_segments, int64_t k, void *out, int64_t ldo, int num_threads,
                 int plain) {
    if (num_segments < 1 || num_segments > MAX_SEGMENTS || k <= 0) return -1;
    call_t calls[MAX_SEGMENTS];
    band_fn fns[MAX_SEGMENTS];
    const int64_t n_ti = (k + TILE - 1) / TILE;
    int pairs = 0, widened = 0;
    int64_t col = 0;
    for (int s = 0; s < num_segments; s++) {
        const segment_t *g = &segments[s];
        const int vt = (int)g->vt;
        if (vt < V_BF16 || vt > V_I8 || (vt == V_I8 && !g->scales) || g->n <= 0) return -1;
        call_t *c = &calls[s];
        memset(c, 0, sizeof *c);
        c->bitmap = g->bitmap, c->offsets = g->offsets, c->values = g->values;
        c->scales = g->scales, c->n = g->n, c->k = k, c->n_ti = n_ti, c->vt = vt;
        c->nnz = g->offsets[(g->n + TILE - 1) / TILE * n_ti];
        c->rows = rows, c->ldo = ldo, c->out_bf16 = x_bf16;
        c->out = (char *)out + (col << (x_bf16 ? 1 : 2));
        col += g->n;
        const int by_pair = x_bf16 && !plain && by_pairs(vt);
        pairs |= by_pair, widened |= x_bf16 && !by_pair;
        fns[s] = band_for(vt, by_pair, plain);
    }
    if (rows <= 0) return 0;
    uint16_t *xb = 0;
    float *xf = 0;
    if (pairs && k % 2) { /* x as bf16 pairs, a zero past the last channel */
        xb = malloc((size_t)rows * (k + 1) * 2);
        if (!xb) return -1;
        for (int64_t r = 0; r < rows; r++) {
            memcpy(xb + r * (k + 1), (const uint16_t *)xv + r * ldx, (size_t)k * 2);
            xb[r * (k + 1) + k] = 0;
        }
    }
    if (widened) {
        xf = malloc((size_t)rows * k * 4);
        if (!xf) {
            free(xb);
            return -1;
        }
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < k; i++)
                xf[r * k + i] = bf16_to_f32(((const uint16_t *)xv)[r * ldx + i]);
    }
    for (int s = 0; s < num_segments; s++) {
        call_t *c = &calls[s];
        if (!x_bf16) { /* fp32 x as it is */
            c->x = xv, c->ldx = ldx;
        } else if (xf) {
            c->x = xf, c->ldx = k;
        }
        if (pairs) { /* even k: x's own rows are whole pairs */
            c->xb = xb ? xb : xv, c->ldxb = xb ? k + 1 : ldx;
        }
    }
    const int status = product(calls, fns, num_segments, rows, num_threads);
    free(xb);
    free(xf);
    return status;
}
