/* bf16 matrix products for decode-sized batches on CPUs with AVX512_BF16 (and no AMX):
 * out [M, N] = x [M, K] W^T (+ bias), on the weight oneDNN packed at load.
 *
 * oneDNN's packed bf16 weight on these CPUs is laid out in tiles of 64 output columns,
 * [ceil(N / 64)][ceil(K / 32) * 16][64][2]: for each pair of input channels, the 64
 * columns' two values side by side (its AB16b64a2b format; engine/weights/packed.py
 * checks that layout on a probe before using this kernel). One `vdpbf16ps` multiplies
 * a pair of x's channels, broadcast, into 16 columns' pairs and adds both exact products
 * to 16 fp32 sums. The micro-kernel keeps 6 rows x 64 columns of sums in 24 registers.
 *
 * The result is oneDNN's to the bit: the same instruction over the channel pairs in the
 * same order, the sums of each block of `k_block` channels added to the running sums
 * (oneDNN's K blocking; the probe finds its block size per weight shape), the bias
 * added in fp32, one rounding to bf16 (`vcvtneps2bf16`, as oneDNN rounds).
 *
 * Why not oneDNN for these calls: in a decode step each linear runs after attention
 * has streamed tens of megabytes of KV cache through the caches, and oneDNN's call
 * then costs 40-60 us more than the same call back to back (its dispatch, primitive and
 * scratch state come back from memory). This kernel is a few kilobytes of code and
 * keeps no state; it asks for the next tile's weights while it works on the current
 * one. Threads split the tiles (and the rows, where there are fewer tiles than twice
 * the threads). A tile is read once per 6 rows, from L2 while it fits there: the caller
 * keeps weights of more than 4,096 input channels with oneDNN, which blocks over them.
 */
#include <stdint.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#define MR 6     /* rows per micro-kernel call */
#define TILE 64  /* output columns per weight tile */

/* rows [0, R) of x (row stride ldx) against one weight tile; sums of k_pairs channel
 * pairs, in blocks of block_pairs; columns [0, ncols) of out stored. */
static inline __attribute__((always_inline)) void
micro(const uint16_t *x, int64_t ldx, const uint16_t *tile, const uint16_t *bias,
      uint16_t *out, int64_t ldo, int64_t k_pairs, int odd_k, int64_t block_pairs, int ncols,
      const char *next, int64_t next_lines, const int R) {
    __m512 c[MR][4], s[MR][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) c[r][j] = _mm512_setzero_ps();
    const uint32_t *xr[MR];
    for (int r = 0; r < R; r++) xr[r] = (const uint32_t *)(x + r * ldx);
    int64_t asked = 0;
    for (int64_t k0 = 0; k0 < k_pairs; k0 += block_pairs) {
        const int64_t k1 = k0 + block_pairs < k_pairs ? k0 + block_pairs : k_pairs;
        for (int r = 0; r < R; r++)
            for (int j = 0; j < 4; j++) {
                s[r][j] = c[r][j];
                c[r][j] = _mm512_setzero_ps();
            }
        for (int64_t kk = k0; kk < k1; kk++) {
            const uint16_t *b = tile + kk * 2 * TILE;
            const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b);
            const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + 32);
            const __m512bh b2 = (__m512bh)_mm512_loadu_si512(b + 64);
            const __m512bh b3 = (__m512bh)_mm512_loadu_si512(b + 96);
            /* this call's share of the next tile, spread evenly over its pairs */
            while (asked < next_lines && asked * k_pairs <= kk * next_lines)
                _mm_prefetch(next + 64 * asked++, _MM_HINT_T1);
            /* an odd K's last pair holds one channel: the word past the row is not read */
            const int half = odd_k && kk == k_pairs - 1;
            for (int r = 0; r < R; r++) {
                const uint32_t pair = half ? ((const uint16_t *)xr[r])[2 * kk] : xr[r][kk];
                const __m512bh a = (__m512bh)_mm512_set1_epi32((int)pair);
                c[r][0] = _mm512_dpbf16_ps(c[r][0], a, b0);
                c[r][1] = _mm512_dpbf16_ps(c[r][1], a, b1);
                c[r][2] = _mm512_dpbf16_ps(c[r][2], a, b2);
                c[r][3] = _mm512_dpbf16_ps(c[r][3], a, b3);
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
            bj = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, bias + 16 * j)), 16));
        for (int r = 0; r < R; r++) {
            const __m512 v = bias ? _mm512_add_ps(c[r][j], bj) : c[r][j];
            _mm256_mask_storeu_epi16(out + r * ldo + 16 * j, m, (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}

int gemm_bf16_available(void) { return 1; }

/* x [rows, k] (row stride ldx) . w^T, w the packed [n, k] weight -> out [rows, n] (row
 * stride ldo); bias [n] or NULL. k_block: channels per block of sums (even). */
int gemm_bf16(const uint16_t *x, int64_t rows, int64_t ldx, const uint16_t *w, int64_t n,
              int64_t k, int64_t k_block, const uint16_t *bias, uint16_t *out, int64_t ldo,
              int num_threads) {
    if (rows <= 0 || n <= 0) return 0;
    const int64_t tiles = (n + TILE - 1) / TILE, k_pairs = (k + 1) / 2;
    const int64_t tile_elems = (k + 31) / 32 * 32 * TILE, block_pairs = k_block / 2;
    const int64_t row_blocks = (rows + MR - 1) / MR;
    /* rows split into `chunks` where tiles alone would leave threads idle */
    int64_t chunks = tiles >= 2 * num_threads ? 1 : (2 * num_threads + tiles - 1) / tiles;
    if (chunks > row_blocks) chunks = row_blocks;
    const int64_t per_chunk = (row_blocks + chunks - 1) / chunks;
    const int64_t tile_lines = tile_elems * 2 / 64;
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")
    for (int64_t item = 0; item < tiles * chunks; item++) {
        const int64_t t = item / chunks, first = item % chunks * per_chunk;
        const int64_t last = first + per_chunk < row_blocks ? first + per_chunk : row_blocks;
        const uint16_t *tile = w + t * tile_elems;
        const int ncols = n - t * TILE < TILE ? (int)(n - t * TILE) : TILE;
        const char *next = (const char *)(tile + tile_elems);
        const int64_t calls = last - first;
        /* the next tile (if this item is its thread's last on this tile) asked for
         * over this item's calls */
        const int64_t lines = t + 1 < tiles && calls > 0 ? (tile_lines + calls - 1) / calls : 0;
        for (int64_t i = first; i < last; i++) {
            const int64_t r0 = i * MR;
            const int R = rows - r0 < MR ? (int)(rows - r0) : MR;
            const char *ask = next + (i - first) * lines * 64;
            const int64_t ask_lines = (i - first) * lines < tile_lines ? lines : 0;
            const uint16_t *xb = x + r0 * ldx;
            uint16_t *ob = out + r0 * ldo + t * TILE;
#define MICRO(RR) micro(xb, ldx, tile, bias ? bias + t * TILE : 0, ob, ldo, k_pairs, (int)(k & 1), \
                        block_pairs, ncols, ask, ask_lines, RR)
            switch (R) {
            case 6: MICRO(6); break;
            case 5: MICRO(5); break;
            case 4: MICRO(4); break;
            case 3: MICRO(3); break;
            case 2: MICRO(2); break;
            default: MICRO(1); break;
            }
#undef MICRO
        }
    }
    return 0;
}

#else
int gemm_bf16_available(void) { return 0; }

int gemm_bf16(const uint16_t *x, int64_t rows, int64_t ldx, const uint16_t *w, int64_t n,
              int64_t k, int64_t k_block, const uint16_t *bias, uint16_t *out, int64_t ldo,
              int num_threads) {
    (void)x, (void)rows, (void)ldx, (void)w, (void)n, (void)k, (void)k_block, (void)bias;
    (void)out, (void)ldo, (void)num_threads;
    return -1;
}
#endif
