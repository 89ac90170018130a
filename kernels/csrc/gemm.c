/* fp32 matrix products against a weight packed once, for CPUs: out [M, N] = x [M, K] W^T
 * (+ bias), W a linear's weight [N, K].
 *
 * The weight is packed into panels of 16 output columns, [ceil(N / 16)][K][16] (the last
 * panel padded with zeros), so the inner loop reads one panel's 16 floats for each k as
 * one contiguous run. The micro-kernel keeps a 6 x 16 block of outputs in twelve 8-lane
 * registers: per k, two panel vectors and six broadcast x values, twelve fused multiply-
 * adds (the register shape BLIS uses for AVX2). Threads split the panels; K is walked in
 * blocks of KC so a panel's slice stays in L1/L2 for large K.
 *
 * Every output element is the same sequence of operations whatever M is and wherever
 * its row sits: sum over k in order within each KC block, blocks added in order, the
 * bias last. A row's result is therefore independent of the batch it came in
 * (batch-invariant), which the engine's deterministic mode relies on.
 *
 * The micro-kernel is written with AVX2/FMA intrinsics where the build targets them
 * (-march=native), else with GCC vector extensions (NEON pairs on Arm), where
 * -ffast-math (native.py) lets `c += x * b` contract to a fused multiply-add.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32), aligned(4)));

#define NR 16  /* panel width: output columns per panel */
#define MR 6   /* rows per micro-kernel call */
#define KC 512 /* depth per cache block */

/* w [n, k] row-major -> panels [ceil(n / NR)][k][NR]. */
void gemm_pack_f32(const float *w, float *packed, int64_t n, int64_t k, int num_threads) {
    const int64_t panels = (n + NR - 1) / NR;
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")
    for (int64_t p = 0; p < panels; p++) {
        float *dst = packed + p * k * NR;
        for (int64_t kk = 0; kk < k; kk++)
            for (int j = 0; j < NR; j++) {
                const int64_t col = p * NR + j;
                dst[kk * NR + j] = col < n ? w[col * k + kk] : 0.0f;
            }
    }
}

static inline v8f splat(float v) { return (v8f){v, v, v, v, v, v, v, v}; }

/* Rows past `rows` (a partial block) repeat row 0: computed, never stored. */
#define ROW(r) (x + ((r) < rows ? (r) : 0) * ldx)

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* With intrinsics: GCC's vector-extension form of the same loop runs out of registers
 * (twelve accumulators, two panel vectors, one broadcast) and adds moves to the loop. */
#define MICRO_LOOP(c)                                                                       \
    do {                                                                                    \
        const float *x0 = ROW(0), *x1 = ROW(1), *x2 = ROW(2), *x3 = ROW(3), *x4 = ROW(4),  \
                    *x5 = ROW(5);                                                           \
        __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00,       \
               c21 = c00, c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00; \
        for (int64_t kk = 0; kk < kd; kk++) {                                               \
            const __m256 b0 = _mm256_loadu_ps(panel + kk * NR);                             \
            const __m256 b1 = _mm256_loadu_ps(panel + kk * NR + 8);                         \
            __m256 a = _mm256_broadcast_ss(x0 + kk);                                        \
            c00 = _mm256_fmadd_ps(a, b0, c00); c01 = _mm256_fmadd_ps(a, b1, c01);           \
            a = _mm256_broadcast_ss(x1 + kk);                                               \
            c10 = _mm256_fmadd_ps(a, b0, c10); c11 = _mm256_fmadd_ps(a, b1, c11);           \
            a = _mm256_broadcast_ss(x2 + kk);                                               \
            c20 = _mm256_fmadd_ps(a, b0, c20); c21 = _mm256_fmadd_ps(a, b1, c21);           \
            a = _mm256_broadcast_ss(x3 + kk);                                               \
            c30 = _mm256_fmadd_ps(a, b0, c30); c31 = _mm256_fmadd_ps(a, b1, c31);           \
            a = _mm256_broadcast_ss(x4 + kk);                                               \
            c40 = _mm256_fmadd_ps(a, b0, c40); c41 = _mm256_fmadd_ps(a, b1, c41);           \
            a = _mm256_broadcast_ss(x5 + kk);                                               \
            c50 = _mm256_fmadd_ps(a, b0, c50); c51 = _mm256_fmadd_ps(a, b1, c51);           \
        }                                                                                   \
        const __m256 all[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31},          \
                                   {c40, c41}, {c50, c51}};                                 \
        memcpy(c, all, sizeof all);                                                         \
    } while (0)
#else
#define MICRO_LOOP(c)                                                                       \
    do {                                                                                    \
        v8f acc[MR][2];                                                                     \
        for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = splat(0.0f);                   \
        for (int64_t kk = 0; kk < kd; kk++) {                                               \
            const v8f b0 = *(const v8f *)(panel + kk * NR);                                 \
            const v8f b1 = *(const v8f *)(panel + kk * NR + 8);                             \
            for (int r = 0; r < MR; r++) {                                                  \
                const v8f a = splat(ROW(r)[kk]);                                            \
                acc[r][0] += a * b0;                                                        \
                acc[r][1] += a * b1;                                                        \
            }                                                                               \
        }                                                                                   \
        memcpy(c, acc, sizeof acc);                                                         \
    } while (0)
#endif

/* out rows [0, rows) x panel columns [0, cols) (+)= x rows . panel, over depth kd.
 * accumulate: add to what out holds (a later KC block) instead of starting from zero. */
static inline void micro(const float *x, int64_t ldx, const float *panel, int64_t kd,
                         float *out, int64_t ldo, int rows, int cols, int accumulate) {
    float c[MR][NR] __attribute__((aligned(32)));
    MICRO_LOOP(c);
    for (int r = 0; r < rows; r++) {
        float *o = out + r * ldo;
        if (accumulate)
            for (int j = 0; j < cols; j++) o[j] += c[r][j];
        else
            memcpy(o, c[r], (size_t)cols * sizeof(float));
    }
}

/* The weight does not stay in cache between steps (a decode step reads every layer's
 * weights and every sequence's keys and values), so each panel slice comes from memory
 * once per call. While the rows pass over one slice, the next one is fetched into L2 a
 * few lines per micro-kernel call, so the next slice's misses overlap this one's work. */
#define PREFETCH_LINES 16

static inline void prefetch_lines(const char *next, int64_t offset, const char *stop) {
    for (int q = 0; q < PREFETCH_LINES; q++, offset += 64)
        if (next + offset < stop) __builtin_prefetch(next + offset, 0, 2);
}

/* Rows per cache block for depth k: the block's rows of x (k floats each) fill about
 * 256 KB, half a core's L2, so they stay there while the thread's panels pass over
 * them. A multiple of MR. */
static inline int64_t row_block(int64_t k) {
    int64_t mc = (int64_t)65536 / (k > 0 ? k : 1) / MR * MR;
    return mc < MR ? MR : mc;
}

/* out [m, n] (row stride ldo) = x [m, k] (row stride ldx) . packed^T + bias (NULL: none).
 * Each thread owns a contiguous run of panels; it walks the rows in blocks that stay in
 * L2 and, for each block, its panels, each panel's KC slice staying in L1 while the
 * block's rows pass over it. */
void gemm_f32(const float *x, int64_t m, int64_t ldx, const float *packed, int64_t n,
              int64_t k, const float *bias, float *out, int64_t ldo, int num_threads) {
    const int64_t panels = (n + NR - 1) / NR, mc = row_block(k);
    _Pragma("omp parallel num_threads(num_threads)")
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t p_begin = panels * t / threads, p_end = panels * (t + 1) / threads;
        const char *stop = (const char *)(packed + p_end * k * NR);
        for (int64_t r0 = 0; r0 < m; r0 += mc) {
            const int64_t r_end = r0 + mc < m ? r0 + mc : m;
            for (int64_t p = p_begin; p < p_end; p++) {
                const int cols = (int)(n - p * NR < NR ? n - p * NR : NR);
                for (int64_t k0 = 0; k0 < k; k0 += KC) {
                    const int64_t kd = k - k0 < KC ? k - k0 : KC;
                    const float *panel = packed + (p * k + k0) * NR;
                    /* the thread's next slice of panel memory follows this one */
                    const char *next = (const char *)(panel + kd * NR);
                    int64_t line = 0;
                    for (int64_t r = r0; r < r_end; r += MR, line += PREFETCH_LINES * 64) {
                        prefetch_lines(next, line, stop);
                        micro(x + r * ldx + k0, ldx, panel, kd, out + r * ldo + p * NR, ldo,
                              (int)(r_end - r < MR ? r_end - r : MR), cols, k0 > 0);
                    }
                }
                if (bias)
                    for (int64_t r = r0; r < r_end; r++)
                        for (int j = 0; j < cols; j++)
                            out[r * ldo + p * NR + j] += bias[p * NR + j];
            }
        }
    }
}

/* Greedy decoding's head: idx[r] = the first column of the maximum of row r of
 * x . packed^T + bias (finite values, as argmax_f32 takes them), without writing the [m, n] product (for a vocabulary of 32,000
 * that is 128 KB a row written and read back). Each product is computed exactly as
 * gemm_f32 computes it (same depth blocks, same additions, bias last), so the answer is
 * argmax_f32's over gemm_f32's output, ties included. Threads take contiguous runs of
 * panels in order and their row maxima are merged in that order with a strict `>`,
 * which keeps the first column on ties. scratch: num_threads * m floats and as many
 * int64; returns 2 when it cannot be allocated, else 0. */
int gemm_argmax_f32(const float *x, int64_t m, int64_t ldx, const float *packed, int64_t n,
                    int64_t k, const float *bias, int64_t *idx, int num_threads) {
    const int64_t panels = (n + NR - 1) / NR;
    float *best = malloc(sizeof(float) * (size_t)(num_threads * m));
    int64_t *at = malloc(sizeof(int64_t) * (size_t)(num_threads * m));
    if (!best || !at) { free(best); free(at); return 2; }
    const char *stop = (const char *)(packed + panels * k * NR);
    for (int64_t i = 0; i < num_threads * m; i++) { best[i] = 0.0f; at[i] = -1; }
    _Pragma("omp parallel num_threads(num_threads)")
    {
        const int t = omp_get_thread_num();
        float *my_best = best + t * m;
        int64_t *my_at = at + t * m;
        float tile[MR][NR];
        _Pragma("omp for schedule(static)")
        for (int64_t p = 0; p < panels; p++) {
            const int cols = (int)(n - p * NR < NR ? n - p * NR : NR);
            const char *next = (const char *)(packed + (p + 1) * k * NR);
            for (int64_t r = 0; r < m; r += MR) {
                const int rows = (int)(m - r < MR ? m - r : MR);
                prefetch_lines(next, r / MR * PREFETCH_LINES * 64, stop);
                for (int64_t k0 = 0; k0 < k; k0 += KC) {
                    const int64_t kd = k - k0 < KC ? k - k0 : KC;
                    micro(x + r * ldx + k0, ldx, packed + (p * k + k0) * NR, kd, &tile[0][0],
                          NR, rows, cols, k0 > 0);
                }
                for (int i = 0; i < rows; i++) {
                    float *v = tile[i];
                    if (bias)
                        for (int j = 0; j < cols; j++) v[j] += bias[p * NR + j];
                    float top = v[0];
                    for (int j = 1; j < cols; j++) top = v[j] > top ? v[j] : top;
                    if (my_at[r + i] < 0 || top > my_best[r + i]) {
                        int j = 0;
                        while (v[j] != top) j++;
                        my_best[r + i] = top;
                        my_at[r + i] = p * NR + j;
                    }
                }
            }
        }
    }
    for (int64_t r = 0; r < m; r++) {
        idx[r] = -1;
        float top = 0.0f;
        for (int t = 0; t < num_threads; t++)
            if (at[t * m + r] >= 0 && (idx[r] < 0 || best[t * m + r] > top)) {
                top = best[t * m + r];
                idx[r] = at[t * m + r];
            }
    }
    free(best);
    free(at);
    return 0;
}
