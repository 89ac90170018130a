/* Matrix products for decode-sized batches on AVX-512 CPUs, on the weight oneDNN packed
 * at load: out [M, N] = x [M, K] W^T (+ bias), in bf16 (with AVX512_BF16) or fp32.
 *
 * oneDNN packs a linear's weight on these CPUs in tiles of 64 output columns, each a run
 * of 256-byte steps: bf16, [ceil(K / 32) * 16][64][2], a pair of input channels for the
 * 64 columns side by side (its AB16b64a2b format); fp32, [ceil(K / 16) * 16][64], one
 * channel for the 64 columns (AB16b64a). engine/weights/packed.py checks the layout on a
 * probe before using these kernels. A step's 4 bytes of an x row (a bf16 channel pair,
 * or one fp32 channel) is broadcast and multiplied into the step's 64 columns: one
 * `vdpbf16ps` (both exact products added to 16 fp32 sums) or one FMA per 16 columns.
 * The micro-kernel keeps 6 rows x 64 columns of fp32 sums in 24 registers.
 *
 * The result is oneDNN's to the bit: the same instructions over the same steps in the
 * same order, the sums of each block of `k_block` channels added to the running sums
 * (oneDNN's blocking over K; the probe finds the block size per weight shape, and for
 * fp32 separately for one row, which oneDNN blocks differently), the bias added in
 * fp32, bf16 rounded once (`vcvtneps2bf16`, as oneDNN rounds).
 *
 * Why not oneDNN for these calls: in a decode step each linear runs after attention has
 * streamed tens of megabytes of KV cache through the caches, and oneDNN's call then
 * costs far more than the same call back to back: its dispatch, primitive and scratch
 * state come back from memory. These kernels are a few kilobytes of code and
 * keep no state; they ask for the next tile's weights while they work on the current
 * one. Threads split the tiles (and the rows, where there are fewer tiles than twice the
 * threads). A tile is read once per 6 rows, from L2 while it fits there: the caller
 * keeps larger tiles (more input channels) with oneDNN, which blocks over them.
 */
#include <stdint.h>

#include "common.h" /* FOR_ROWS_1_TO_6 */

/* which kernels this build has: 1 bf16, 2 fp32 */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define HAS_F32 2
#if defined(__AVX512BF16__)
#define HAS_BF16 1
#else
#define HAS_BF16 0
#endif
#else
#define HAS_F32 0
#define HAS_BF16 0
#endif

int gemm_tiles_available(void) { return HAS_BF16 | HAS_F32; }

#if HAS_F32
#define MR 6       /* rows per micro-kernel call */
#define TILE 64    /* output columns per weight tile */
#define STEP 256   /* bytes of a tile per step (channel pair, or channel) */

/* One call's operands (bytes where the element size differs) and how its work splits:
 * tiles of 64 columns and, where tiles alone would leave threads idle, `chunks` runs of
 * row blocks per tile. */
typedef struct {
    const char *x, *w, *bias;
    char *out;
    int64_t rows, x_row, out_row, n, steps, odd, tile_bytes, block_steps, row_blocks,
        chunks, per_chunk;
} gemm_t;

/* rows [0, R) of the call against one tile; columns [0, ncols) stored. BF16 a constant:
 * each entry point has its own copy. */
static inline __attribute__((always_inline)) void
micro(const gemm_t *g, const char *x, const char *tile, const char *bias, char *out,
      int ncols, const char *next, int64_t next_lines, const int R, const int BF16) {
    __m512 c[MR][4], s[MR][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) c[r][j] = _mm512_setzero_ps();
    const int64_t steps = g->steps, block = g->block_steps;
    const int odd = BF16 && g->odd;
    const char *xr[MR];
    for (int r = 0; r < R; r++) xr[r] = x + r * g->x_row;
    int64_t asked = 0;
    for (int64_t k0 = 0; k0 < steps; k0 += block) {
        const int64_t k1 = k0 + block < steps ? k0 + block : steps;
        for (int r = 0; r < R; r++)
            for (int j = 0; j < 4; j++) {
                s[r][j] = c[r][j];
                c[r][j] = _mm512_setzero_ps();
            }
        for (int64_t kk = k0; kk < k1; kk++) {
            const char *b = tile + kk * STEP;
            const __m512i b0 = _mm512_loadu_si512(b), b1 = _mm512_loadu_si512(b + 64);
            const __m512i b2 = _mm512_loadu_si512(b + 128), b3 = _mm512_loadu_si512(b + 192);
            /* this call's share of the next tile, spread evenly over its steps */
            while (asked < next_lines && asked * steps <= kk * next_lines)
                _mm_prefetch(next + 64 * asked++, _MM_HINT_T1);
            /* bf16 with an odd K: the last pair holds one channel, and the word past
             * the row is not read */
            const int half = odd && kk == steps - 1;
            for (int r = 0; r < R; r++) {
                uint32_t word;
                if (half)
                    word = *(const uint16_t *)(xr[r] + 4 * kk);
                else
                    __builtin_memcpy(&word, xr[r] + 4 * kk, 4);
                const __m512i a = _mm512_set1_epi32((int)word);
#if HAS_BF16
                if (BF16) {
                    c[r][0] = _mm512_dpbf16_ps(c[r][0], (__m512bh)a, (__m512bh)b0);
                    c[r][1] = _mm512_dpbf16_ps(c[r][1], (__m512bh)a, (__m512bh)b1);
                    c[r][2] = _mm512_dpbf16_ps(c[r][2], (__m512bh)a, (__m512bh)b2);
                    c[r][3] = _mm512_dpbf16_ps(c[r][3], (__m512bh)a, (__m512bh)b3);
                    continue;
                }
#endif
                const __m512 af = _mm512_castsi512_ps(a);
                c[r][0] = _mm512_fmadd_ps(af, _mm512_castsi512_ps(b0), c[r][0]);
                c[r][1] = _mm512_fmadd_ps(af, _mm512_castsi512_ps(b1), c[r][1]);
                c[r][2] = _mm512_fmadd_ps(af, _mm512_castsi512_ps(b2), c[r][2]);
                c[r][3] = _mm512_fmadd_ps(af, _mm512_castsi512_ps(b3), c[r][3]);
            }
        }
        if (k0 > 0)
            for (int r = 0; r < R; r++)
                for (int j = 0; j < 4; j++) c[r][j] = _mm512_add_ps(s[r][j], c[r][j]);
    }
    for (int j = 0; j < 4 && 16 * j < ncols; j++) {
        const int n = ncols - 16 * j < 16 ? ncols - 16 * j : 16;
        const __mmask16 m = (__mmask16)((1u << n) - 1);
        __m512 bj = _mm512_setzero_ps();
        if (bias)
            bj = BF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                            _mm256_maskz_loadu_epi16(m, bias + 32 * j)), 16))
                      : _mm512_maskz_loadu_ps(m, bias + 64 * j);
        for (int r = 0; r < R; r++) {
            const __m512 v = bias ? _mm512_add_ps(c[r][j], bj) : c[r][j];
            char *o = out + r * g->out_row;
#if HAS_BF16
            if (BF16) {
                _mm256_mask_storeu_epi16(o + 32 * j, m, (__m256i)_mm512_cvtneps_pbh(v));
                continue;
            }
#endif
            _mm512_mask_storeu_ps(o + 64 * j, m, v);
        }
    }
}

/* Work item `item`: one tile against one run of row blocks. */
static inline __attribute__((always_inline)) void
work(const gemm_t *g, int64_t item, const int BF16) {
    const int64_t es = BF16 ? 2 : 4;
    const int64_t t = item / g->chunks, first = item % g->chunks * g->per_chunk;
    const int64_t last = first + g->per_chunk < g->row_blocks ? first + g->per_chunk
                                                              : g->row_blocks;
    const char *tile = g->w + t * g->tile_bytes;
    const char *bias = g->bias ? g->bias + t * TILE * es : 0;
    const int ncols = g->n - t * TILE < TILE ? (int)(g->n - t * TILE) : TILE;
    const int64_t tiles = (g->n + TILE - 1) / TILE, tile_lines = g->tile_bytes / 64;
    const int64_t calls = last - first;
    /* the next tile asked for over this item's calls */
    const int64_t lines = t + 1 < tiles && calls > 0 ? (tile_lines + calls - 1) / calls : 0;
    for (int64_t i = first; i < last; i++) {
        const int64_t r0 = i * MR;
        const int R = g->rows - r0 < MR ? (int)(g->rows - r0) : MR;
        const char *ask = tile + g->tile_bytes + (i - first) * lines * 64;
        const int64_t ask_lines = (i - first) * lines < tile_lines ? lines : 0;
        const char *x = g->x + r0 * g->x_row;
        char *out = g->out + r0 * g->out_row + t * TILE * es;
#define MICRO(RR) micro(g, x, tile, bias, out, ncols, ask, ask_lines, RR, BF16)
        FOR_ROWS_1_TO_6(R, MICRO);
#undef MICRO
    }
}

static gemm_t plan(const void *x, int64_t rows, int64_t ldx, const void *w, int64_t n,
                   int64_t k, int64_t k_block, const void *bias, void *out, int64_t ldo,
                   int num_threads, int bf16) {
    const int64_t es = bf16 ? 2 : 4, per_step = bf16 ? 2 : 1, pad = bf16 ? 32 : 16;
    gemm_t g = {.x = x, .w = w, .bias = bias, .out = out, .rows = rows, .n = n};
    g.x_row = ldx * es;
    g.out_row = ldo * es;
    g.steps = (k + per_step - 1) / per_step;
    g.odd = bf16 && (k & 1);
    g.tile_bytes = (k + pad - 1) / pad * pad * TILE * es;
    g.block_steps = k_block / per_step > 0 ? k_block / per_step : g.steps;  /* 0: one block */
    g.row_blocks = (rows + MR - 1) / MR;
    const int64_t tiles = (n + TILE - 1) / TILE;
    g.chunks = tiles >= 2 * num_threads ? 1 : (2 * num_threads + tiles - 1) / tiles;
    if (g.chunks > g.row_blocks) g.chunks = g.row_blocks;
    g.per_chunk = (g.row_blocks + g.chunks - 1) / g.chunks;
    return g;
}
#endif

/* x [rows, k] (row stride ldx elements) . w^T, w oneDNN's packed [n, k] weight -> out
 * [rows, n] (row stride ldo); bias [n] or NULL. k_block: channels per block of sums
 * (even for bf16). Returns -1 where this build has no such kernel. One definition per
 * dtype, each with its parallel region: BF16 must be a literal inside the region (GCC
 * outlines the region before it inlines, and a flag passed in would stay a variable). */
#define DEFINE_GEMM(NAME, T, HAS, BF16)                                                     \
int NAME(const T *x, int64_t rows, int64_t ldx, const T *w, int64_t n, int64_t k,          \
         int64_t k_block, const T *bias, T *out, int64_t ldo, int num_threads) {           \
    if (!(HAS)) return -1;                                                                  \
    if (rows <= 0 || n <= 0) return 0;                                                      \
    RUN(BF16);                                                                              \
    return 0;                                                                               \
}

#if HAS_F32
#define RUN(BF16)                                                                           \
    do {                                                                                    \
        const gemm_t g = plan(x, rows, ldx, w, n, k, k_block, bias, out, ldo, num_threads,  \
                              BF16);                                                        \
        _Pragma("omp parallel for num_threads(num_threads) schedule(static)")               \
        for (int64_t item = 0; item < (g.n + TILE - 1) / TILE * g.chunks; item++)          \
            work(&g, item, BF16);                                                           \
    } while (0)
#else
#define RUN(BF16) (void)x, (void)ldx, (void)w, (void)k, (void)k_block, (void)bias, (void)out, \
                  (void)ldo, (void)num_threads
#endif

DEFINE_GEMM(gemm_tiles_bf16, uint16_t, HAS_BF16, 1)
DEFINE_GEMM(gemm_tiles_f32, float, HAS_F32, 0)
