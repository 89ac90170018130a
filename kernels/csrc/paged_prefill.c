/* Prefill attention over a paged KV cache, for CPUs (fp32 or bf16, head_dim a multiple
 * of 32).
 *
 * A prefill sequence's n query rows are the last n of its seq_len tokens; their keys and
 * values (the new ones included) are already in the cache. Work items are
 * (sequence, KV head, tile of TILE_Q query positions); an item holds the tile's rows for
 * every query head sharing the KV head (GQA: each key is loaded once for the group)
 * and walks the sequence's blocks in place up to the tile's last position, with an
 * online softmax in fp32. The item's queries are transposed once, so that rows lie in
 * vector lanes: per block, scores are outer products (four key values broadcast against
 * two vectors of rows), the masks and the softmax run across rows in vectors, and the
 * values are accumulated two rows at a time with the accumulators in registers, with no
 * gather of the blocks into a contiguous copy as torch's flash attention would need
 * (docs/performance.md compares the two).
 *
 * bf16 tensors are computed in fp32 as well: an item's queries are widened as they are
 * transposed, each block's keys and values are widened into the item's scratch once (every
 * one of them then serves all R rows), and the output is rounded to bf16 once at the end,
 * where torch's fused attention rounds it. Where the CPU has AVX512_BF16 both products
 * run on vdpbf16ps instead, with half the bytes widened and moved: the scores from the bf16
 * queries and keys as stored (block_scores_dp: the same exact products, summed in fp32 in
 * pairs), the values against the probabilities rounded to bf16 (block_values_dp), as
 * torch's fused CPU attention rounds them for bf16 inputs (its error against the exact
 * attention is no smaller: tests/test_kernels_cpu_prefill.py).
 *
 * Layouts as in paged_decode.c: q, out [T, Hq, D]; caches [N, block_size, Hkv, D];
 * block_tables [B, W] int32, seq_lens [B] int32, query_start_loc [B+1] int32;
 * seq_ids [n] int32 lists the sequences to compute. Returns 0, 1 for a shape it does not
 * take (head_dim not a multiple of 32 or over 256, block_size over 256, heads not a
 * multiple of KV heads), 2 when scratch could not be allocated.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h" /* strides_t, bf16 conversions */
#include "lse.h"
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

/* VL fp32 lanes a vector: 16 where the build targets AVX-512 (twice the work an
 * instruction), else 8 (AVX2; NEON pairs on Arm). A tile holds 2 * VL query positions,
 * so that R = TILE_Q * group rows fill whole pairs of vectors. */
#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
typedef float vf __attribute__((vector_size(VL * 4), aligned(4)));

#define TILE_Q (2 * VL)
#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 256
#define MASKED (-FLT_MAX)

typedef struct {
    int seq, head, tile;
} item_t;

static const float zero_row[MAX_HEAD_DIM];  /* stands in for keys past a block's end */

/* exp(x) for the softmax, x <= 0, with arguments below -80 taken at -80 (a result under
 * 2e-35, beside terms of at least 1: the running max's own); masked scores (-FLT_MAX) and
 * a first block's rescale would otherwise underflow. Cephes' expf in line: x = n ln2 + r
 * with |r| <= ln2 / 2, e^r by its degree-7 polynomial, 2^n put in the exponent bits; within
 * 2 ulp of expf. Written so that the softmax's `omp simd` loops keep it in their vectors:
 * glibc's vector expf is a call, around which the loop's registers are saved, a fifth of
 * the kernel's time. */
static inline float exp_floor(float x) {
    x = x > -80.0f ? x : -80.0f;
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    float r = __builtin_fmaf(n, -0.693359375f, x);  /* ln 2 in two parts, exact n * hi */
    r = __builtin_fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = __builtin_fmaf(p, r, 1.3981999507e-3f);
    p = __builtin_fmaf(p, r, 8.3334519073e-3f);
    p = __builtin_fmaf(p, r, 4.1665795894e-2f);
    p = __builtin_fmaf(p, r, 1.6666665459e-1f);
    p = __builtin_fmaf(p, r, 5.0000001201e-1f);
    p = __builtin_fmaf(p, r * r, r) + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;  /* n >= -116: normal */
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

/* Element i of a row stored as fp32 or bf16; `bf16` is a constant at every call. */
static inline float load_el(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* A bf16 block's rows [n][head_dim] (row stride `stride` elements) widened into fp32
 * rows head_dim apart. */
static inline void widen_rows(const uint16_t *src, int64_t stride, int n, int head_dim,
                              float *dst) {
    for (int j = 0; j < n; j++) {
        const uint16_t *s = src + (int64_t)j * stride;
        float *d = dst + (int64_t)j * head_dim;
        _Pragma("omp simd")
        for (int c = 0; c < head_dim; c++) {
            const uint32_t u = (uint32_t)s[c] << 16;
            memcpy(d + c, &u, 4);
        }
    }
}

/* Transposed scores st[j][r] = k[j] . q[r] for a block's keys j < nk (rounded up to 4;
 * keys past nk read zeros) and all R rows (a multiple of 2 * VL): per head channel d, two
 * vectors of VL rows of the transposed queries, four key values broadcast, eight FMAs. */
static inline void block_scores(const float *qt, const float *kb, int64_t k_s, int nk,
                                float *st, int R, int head_dim) {
    for (int j = 0; j < nk; j += 4) {
        const float *k0 = kb + j * k_s;
        const float *k1 = j + 1 < nk ? k0 + k_s : zero_row;
        const float *k2 = j + 2 < nk ? k0 + 2 * k_s : zero_row;
        const float *k3 = j + 3 < nk ? k0 + 3 * k_s : zero_row;
        for (int r = 0; r < R; r += 2 * VL) {
            vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
            for (int d = 0; d < head_dim; d++) {
                const vf q0 = *(const vf *)(qt + (int64_t)d * R + r);
                const vf q1 = *(const vf *)(qt + (int64_t)d * R + r + VL);
                a0 += k0[d] * q0; b0 += k0[d] * q1;
                a1 += k1[d] * q0; b1 += k1[d] * q1;
                a2 += k2[d] * q0; b2 += k2[d] * q1;
                a3 += k3[d] * q0; b3 += k3[d] * q1;
            }
            vf *out = (vf *)(st + (int64_t)j * R + r);
            const int64_t row = R / VL;
            out[0] = a0; out[1] = b0;
            out[row] = a1; out[row + 1] = b1;
            out[2 * row] = a2; out[2 * row + 1] = b2;
            out[3 * row] = a3; out[3 * row + 1] = b3;
        }
    }
}

#if defined(__AVX512BF16__)
/* block_scores for bf16 on CPUs with AVX512_BF16: the queries stay bf16, as stored,
 * in pairs of head channels ([head_dim / 2][R] 32-bit pairs), and each key's channel pair
 * is read straight from the cache and broadcast, so that one vdpbf16ps adds two channels'
 * exact products for 16 rows: half the instructions of the fp32 FMAs, and the keys are
 * never widened. Scores are scaled once at the end. */
static const uint16_t zero_row_bf16[MAX_HEAD_DIM];

static inline __m512bh bcast_pair(const uint16_t *k, int p) {
    int32_t pair;
    memcpy(&pair, k + 2 * p, 4);
    return (__m512bh)_mm512_set1_epi32(pair);
}

/* v[k] <- lane k of every v[i] (v[k][i] = v[i][k] before): a 16 x 16 transpose of 32-bit
 * elements in registers, 64 shuffles. */
static inline __attribute__((always_inline)) void transpose16(__m512i *v) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        v[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        v[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        v[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        v[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) {
            t[8 * i + j] = _mm512_shuffle_i32x4(v[8 * i + j], v[8 * i + 4 + j], 0x88);
            t[8 * i + 4 + j] = _mm512_shuffle_i32x4(v[8 * i + j], v[8 * i + 4 + j], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        v[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
        v[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
    }
}

static inline __attribute__((always_inline)) void block_scores_dp(
        const uint32_t *qp, const uint16_t *kb, int64_t k_s, int nk, float *st, int R,
        int head_dim, float scale) {
    const __m512 sv = _mm512_set1_ps(scale);
    for (int j = 0; j < nk; j += 4) {
        const uint16_t *k0 = kb + j * k_s;
        const uint16_t *k1 = j + 1 < nk ? k0 + k_s : zero_row_bf16;
        const uint16_t *k2 = j + 2 < nk ? k0 + 2 * k_s : zero_row_bf16;
        const uint16_t *k3 = j + 3 < nk ? k0 + 3 * k_s : zero_row_bf16;
        int r = 0;
        /* 64 rows at a time where R allows (groups of 2 and more): four keys' pairs
         * broadcast once for four row vectors, sixteen independent accumulators */
        for (; r + 64 <= R; r += 64) {
            __m512 a[4][4];
            for (int u = 0; u < 4; u++)
                for (int k = 0; k < 4; k++) a[u][k] = _mm512_setzero_ps();
            for (int p = 0; p < head_dim / 2; p++) {
                const __m512bh c[4] = {bcast_pair(k0, p), bcast_pair(k1, p),
                                       bcast_pair(k2, p), bcast_pair(k3, p)};
                for (int u = 0; u < 4; u++) {
                    const __m512bh qv = (__m512bh)_mm512_loadu_si512(qp + (int64_t)p * R + r + 16 * u);
                    for (int k = 0; k < 4; k++) a[u][k] = _mm512_dpbf16_ps(a[u][k], qv, c[k]);
                }
            }
            for (int k = 0; k < 4; k++)
                for (int u = 0; u < 4; u++)
                    _mm512_storeu_ps(st + (int64_t)(j + k) * R + r + 16 * u,
                                     _mm512_mul_ps(a[u][k], sv));
        }
        for (; r < R; r += 32) {
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            __m512 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            for (int p = 0; p < head_dim / 2; p++) {
                const __m512bh q0 = (__m512bh)_mm512_loadu_si512(qp + (int64_t)p * R + r);
                const __m512bh q1 = (__m512bh)_mm512_loadu_si512(qp + (int64_t)p * R + r + 16);
                const __m512bh c0 = bcast_pair(k0, p), c1 = bcast_pair(k1, p);
                const __m512bh c2 = bcast_pair(k2, p), c3 = bcast_pair(k3, p);
                a0 = _mm512_dpbf16_ps(a0, q0, c0); b0 = _mm512_dpbf16_ps(b0, q1, c0);
                a1 = _mm512_dpbf16_ps(a1, q0, c1); b1 = _mm512_dpbf16_ps(b1, q1, c1);
                a2 = _mm512_dpbf16_ps(a2, q0, c2); b2 = _mm512_dpbf16_ps(b2, q1, c2);
                a3 = _mm512_dpbf16_ps(a3, q0, c3); b3 = _mm512_dpbf16_ps(b3, q1, c3);
            }
            float *out = st + (int64_t)j * R + r;
            _mm512_storeu_ps(out, _mm512_mul_ps(a0, sv));
            _mm512_storeu_ps(out + 16, _mm512_mul_ps(b0, sv));
            _mm512_storeu_ps(out + R, _mm512_mul_ps(a1, sv));
            _mm512_storeu_ps(out + R + 16, _mm512_mul_ps(b1, sv));
            _mm512_storeu_ps(out + 2 * R, _mm512_mul_ps(a2, sv));
            _mm512_storeu_ps(out + 2 * R + 16, _mm512_mul_ps(b2, sv));
            _mm512_storeu_ps(out + 3 * R, _mm512_mul_ps(a3, sv));
            _mm512_storeu_ps(out + 3 * R + 16, _mm512_mul_ps(b3, sv));
        }
    }
}

/* A bf16 block's value rows as pairs for vdpbf16ps: vi[jp][c] = (v[2jp][c], v[2jp+1][c])
 * (the second zero past the block's end), 16 channels at a time. */
static inline __attribute__((always_inline)) void pair_values(
        const uint16_t *vb, int64_t v_s, int nk, int head_dim, uint32_t *vi) {
    for (int jp = 0; 2 * jp < nk; jp++) {
        const uint16_t *va = vb + (int64_t)(2 * jp) * v_s;
        const uint16_t *vz = 2 * jp + 1 < nk ? va + v_s : zero_row_bf16;
        for (int c = 0; c < head_dim; c += 16) {
            const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(va + c)));
            const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vz + c)));
            _mm512_storeu_si512(vi + (int64_t)jp * head_dim + c,
                                _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
}

/* The block's probabilities as bf16 pairs for vdpbf16ps: pp[jp][r] = (p[2jp][r],
 * p[2jp+1][r]) rounded to bf16 (as GPUs' flash attention rounds them before the value
 * product); the softmax's running sum keeps them in fp32. */
static inline __attribute__((always_inline)) void pair_probs(const float *sc, int nk, int R,
                                                             uint32_t *pp) {
    for (int jp = 0; 2 * jp < nk; jp++) {
        const float *x = sc + (int64_t)(2 * jp) * R;
        const int odd = 2 * jp + 1 < nk;
        for (int r = 0; r < R; r += 16) {
            const __m512i lo = _mm512_cvtepu16_epi32(
                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + r)));
            const __m512i hi = odd ? _mm512_cvtepu16_epi32(
                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + R + r))) : _mm512_setzero_si512();
            _mm512_storeu_si512(pp + (int64_t)jp * R + r,
                                _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
}

/* block_values by vdpbf16ps: two rows at once over the block's key pairs, the
 * accumulators (lanes <= 8 vectors a row) in registers. */
static inline __attribute__((always_inline)) void block_values_dp(
        vf *acc_a, vf *acc_b, float alpha_a, float alpha_b, const uint32_t *pa,
        const uint32_t *pb, int R, const uint32_t *vi, int head_dim, int npairs, int lanes) {
    __m512 a[8], b[8];
    const __m512 sa = _mm512_set1_ps(alpha_a), sb = _mm512_set1_ps(alpha_b);
    for (int c = 0; c < lanes; c++) {
        a[c] = _mm512_mul_ps((__m512)acc_a[c], sa);
        b[c] = acc_b ? _mm512_mul_ps((__m512)acc_b[c], sb) : _mm512_setzero_ps();
    }
    for (int jp = 0; jp < npairs; jp++) {
        const __m512bh x = (__m512bh)_mm512_set1_epi32((int)pa[(int64_t)jp * R]);
        const __m512bh y = (__m512bh)_mm512_set1_epi32(acc_b ? (int)pb[(int64_t)jp * R] : 0);
        const uint32_t *vr = vi + (int64_t)jp * head_dim;
        for (int c = 0; c < lanes; c++) {
            const __m512bh v = (__m512bh)_mm512_loadu_si512(vr + 16 * c);
            a[c] = _mm512_dpbf16_ps(a[c], v, x);
            if (acc_b) b[c] = _mm512_dpbf16_ps(b[c], v, y);
        }
    }
    for (int c = 0; c < lanes; c++) {
        acc_a[c] = (vf)a[c];
        if (acc_b) acc_b[c] = (vf)b[c];
    }
}

/* Four rows at once, for head_dim 64 (lanes 4): sixteen accumulators in registers, each
 * pair of value rows loaded once for the four. Rows r..r+3 of acc and of the pairs. */
static inline __attribute__((always_inline)) void block_values_dp4(
        vf *acc, const float *alpha, const uint32_t *pp, int R, const uint32_t *vi,
        int npairs) {
    __m512 a[4][4];
    for (int u = 0; u < 4; u++) {
        const __m512 su = _mm512_set1_ps(alpha[u]);
        for (int c = 0; c < 4; c++) a[u][c] = _mm512_mul_ps((__m512)acc[4 * u + c], su);
    }
    for (int jp = 0; jp < npairs; jp++) {
        const uint32_t *vr = vi + (int64_t)jp * 64;
        const __m512bh v[4] = {(__m512bh)_mm512_loadu_si512(vr),
                               (__m512bh)_mm512_loadu_si512(vr + 16),
                               (__m512bh)_mm512_loadu_si512(vr + 32),
                               (__m512bh)_mm512_loadu_si512(vr + 48)};
        for (int u = 0; u < 4; u++) {
            const __m512bh x = (__m512bh)_mm512_set1_epi32((int)pp[(int64_t)jp * R + u]);
            for (int c = 0; c < 4; c++) a[u][c] = _mm512_dpbf16_ps(a[u][c], v[c], x);
        }
    }
    for (int u = 0; u < 4; u++)
        for (int c = 0; c < 4; c++) acc[4 * u + c] = (vf)a[u][c];
}
#define SCORES_DP 1
#else
#define SCORES_DP 0
#endif

/* Two rows at once: acc_a = acc_a * alpha_a + sum_j pa[j * R] v[j], and the same for b,
 * sharing each loaded value vector (four vectors at a time in registers, then one at a
 * time for the rest). With b == NULL only row a is computed. */
static inline void block_values(vf *acc_a, vf *acc_b, float alpha_a, float alpha_b,
                                const float *pa, const float *pb, int R, const float *vb,
                                int64_t v_s, int nk, int lanes) {
    int c = 0;
    for (; c + 4 <= lanes; c += 4) {
        vf a0 = acc_a[c] * alpha_a, a1 = acc_a[c + 1] * alpha_a;
        vf a2 = acc_a[c + 2] * alpha_a, a3 = acc_a[c + 3] * alpha_a;
        vf b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
        if (acc_b) {
            b0 = acc_b[c] * alpha_b; b1 = acc_b[c + 1] * alpha_b;
            b2 = acc_b[c + 2] * alpha_b; b3 = acc_b[c + 3] * alpha_b;
        }
        for (int j = 0; j < nk; j++) {
            const vf *vp = (const vf *)(vb + (int64_t)j * v_s) + c;
            const vf v0 = vp[0], v1 = vp[1], v2 = vp[2], v3 = vp[3];
            const float x = pa[(int64_t)j * R];
            a0 += x * v0; a1 += x * v1; a2 += x * v2; a3 += x * v3;
            if (acc_b) {
                const float y = pb[(int64_t)j * R];
                b0 += y * v0; b1 += y * v1; b2 += y * v2; b3 += y * v3;
            }
        }
        acc_a[c] = a0; acc_a[c + 1] = a1; acc_a[c + 2] = a2; acc_a[c + 3] = a3;
        if (acc_b) {
            acc_b[c] = b0; acc_b[c + 1] = b1; acc_b[c + 2] = b2; acc_b[c + 3] = b3;
        }
    }
    for (; c < lanes; c++) {
        vf a = acc_a[c] * alpha_a, b = acc_b ? acc_b[c] * alpha_b : (vf){0};
        for (int j = 0; j < nk; j++) {
            const vf v = ((const vf *)(vb + (int64_t)j * v_s))[c];
            a += pa[(int64_t)j * R] * v;
            if (acc_b) b += pb[(int64_t)j * R] * v;
        }
        acc_a[c] = a;
        if (acc_b) acc_b[c] = b;
    }
}

/* One item. `lanes` = head_dim / VL; the wrappers below call it with a constant so the
 * inner loops unroll. Rows are laid out in vector lanes for the softmax: row r is query
 * position t0 + r / group of head head * group + r % group; R = TILE_Q * group rows, the
 * ones past the sequence's end zero and never written out. */
static inline __attribute__((always_inline)) void
prefill_item(const void *q, void *out, const void *kc, const void *vc,
             const int32_t *block_tables, const int32_t *seq_lens,
             const int32_t *query_start_loc, item_t it, int group, int lanes, int block_size,
             int window, float scale, const strides_t *st, float *work, lse_out_t lse,
             int bf16) {
    const int head_dim = lanes * VL, R = TILE_Q * group;
    const int64_t first = query_start_loc[it.seq];
    const int n = query_start_loc[it.seq + 1] - (int)first, len = seq_lens[it.seq];
    const int t0 = it.tile * TILE_Q, tq = n - t0 < TILE_Q ? n - t0 : TILE_Q;
    const int rows = tq * group;
    const int pos_lo = len - n + t0, pos_hi = pos_lo + tq - 1;
    float *qt = work;                                  /* [head_dim, R] scaled queries^T */
    vf *acc = (vf *)(qt + (int64_t)head_dim * R);      /* [R, lanes] */
    float *sc = (float *)(acc + (int64_t)R * lanes);   /* [block_size + 3, R] scores^T */
    float *m = sc + (int64_t)(block_size + 3) * R, *l = m + R, *alpha = l + R;
    int *last = (int *)(alpha + R), *first_key = last + R;  /* visible key range per row */
    /* bf16: the block's keys and values widened, [block_size, head_dim] each */
    float *kw = (float *)(first_key + R), *vw = kw + (int64_t)block_size * head_dim;
    /* dp values: the block's probability and value pairs */
#if SCORES_DP
    uint32_t *pp = (uint32_t *)(vw + (int64_t)block_size * head_dim);
    uint32_t *vi = pp + (int64_t)(block_size / 2 + 1) * R;
#endif
    const int64_t es = bf16 ? 2 : 4;  /* bytes per element */
    const int dp = SCORES_DP && bf16;  /* scores by vdpbf16ps (block_scores_dp) */
    const int dp_values = dp && lanes <= 8;  /* and values (block_values_dp) */
#if SCORES_DP
    uint32_t *qpairs = (uint32_t *)qt;               /* dp: [head_dim / 2, R] bf16 pairs */
#endif
#if SCORES_DP
    if (dp)  /* the queries' channel pairs transposed sixteen rows at a time */
        for (int r0 = 0; r0 < R; r0 += 16)
            for (int p0 = 0; p0 < head_dim / 2; p0 += 16) {
                __m512i v[16];
                for (int i = 0; i < 16; i++) {
                    const int r = r0 + i, t = t0 + r / group, h = it.head * group + r % group;
                    v[i] = r < rows ? _mm512_loadu_si512(
                        (const uint16_t *)q + (first + t) * st->q_t + (int64_t)h * st->q_h + 2 * p0)
                        : _mm512_setzero_si512();
                }
                transpose16(v);
                for (int i = 0; i < 16; i++)
                    _mm512_storeu_si512(qpairs + (int64_t)(p0 + i) * R + r0, v[i]);
            }
#endif
    for (int r = 0; r < R; r++) {
        const int t = t0 + r / group, h = it.head * group + r % group;
        const char *qp = (const char *)q + ((first + t) * st->q_t + (int64_t)h * st->q_h) * es;
        if (!dp)
            for (int d = 0; d < head_dim; d++)
                qt[(int64_t)d * R + r] = r < rows ? load_el(qp, d, bf16) * scale : 0.0f;
        for (int c = 0; c < lanes; c++) acc[r * lanes + c] = (vf){0};
        m[r] = MASKED;
        l[r] = 0.0f;
        last[r] = r < rows ? pos_lo + r / group : -1;  /* padded rows see nothing */
        first_key[r] = window > 0 ? last[r] - window + 1 : 0;
    }
    const int32_t *table = block_tables + (int64_t)it.seq * st->bt;
    int pos = window > 0 && pos_lo - window + 1 > 0 ? pos_lo - window + 1 : 0;
    pos -= pos % block_size;
    const int kv_end = lse.kv_end ? lse.kv_end[it.seq] : len;  /* keys end here */
    for (; pos <= pos_hi && pos < kv_end; pos += block_size) {
        const int64_t block = table[pos / block_size];
        const int nk = kv_end - pos < block_size ? kv_end - pos : block_size;
        const int64_t k_at = block * st->k_b + (int64_t)it.head * st->k_h;
        const int64_t v_at = block * st->v_b + (int64_t)it.head * st->v_h;
        const float *kb = (const float *)kc + k_at, *vb = (const float *)vc + v_at;
        int64_t k_s = st->k_s, v_s = st->v_s;
#if SCORES_DP
        if (dp)
            block_scores_dp(qpairs, (const uint16_t *)kc + k_at, k_s, nk, sc, R, head_dim,
                            scale);
#endif
#if SCORES_DP
        if (dp_values) pair_values((const uint16_t *)vc + v_at, v_s, nk, head_dim, vi);
#endif
        if (bf16) {
            if (!dp) widen_rows((const uint16_t *)kc + k_at, k_s, nk, head_dim, kw);
            if (!dp_values) widen_rows((const uint16_t *)vc + v_at, v_s, nk, head_dim, vw);
            kb = kw, vb = vw, k_s = v_s = head_dim;
        }
        if (!dp) block_scores(qt, kb, k_s, nk, sc, R, head_dim);
        /* causal and window masks, for the blocks that need them: a block before the
         * tile's first position and inside every row's window is seen whole by all of
         * its rows (the padded rows past `rows` are never written out) */
        const int whole = pos + nk - 1 <= pos_lo && (window <= 0 || pos >= pos_hi - window + 1);
        for (int j = 0; j < (whole ? 0 : nk); j++) {
            float *sj = sc + (int64_t)j * R;
            _Pragma("omp simd")
            for (int r = 0; r < R; r++)
                sj[r] = (pos + j <= last[r] && pos + j >= first_key[r]) ? sj[r] : MASKED;
        }
        /* new running max (gathered in alpha, key by key across the rows' vector lanes);
         * alpha then rescales the old terms */
        memcpy(alpha, m, sizeof(float) * R);
        for (int j = 0; j < nk; j++) {
            const float *sj = sc + (int64_t)j * R;
            _Pragma("omp simd")
            for (int r = 0; r < R; r++) alpha[r] = sj[r] > alpha[r] ? sj[r] : alpha[r];
        }
        _Pragma("omp simd")
        for (int r = 0; r < R; r++) {
            const float top = alpha[r];
            alpha[r] = exp_floor(m[r] - top);
            m[r] = top;
            l[r] *= alpha[r];
        }
        for (int j = 0; j < nk; j++) {
            float *sj = sc + (int64_t)j * R;
            _Pragma("omp simd")
            for (int r = 0; r < R; r++) {
                const float e = exp_floor(sj[r] - m[r]);
                sj[r] = sj[r] > MASKED ? e : 0.0f;
                l[r] += sj[r];
            }
        }
#if SCORES_DP
        if (dp_values) {
            pair_probs(sc, nk, R, pp);
            int r = 0;
            if (lanes == 4)
                for (; r + 4 <= rows; r += 4)
                    block_values_dp4(acc + r * lanes, alpha + r, pp + r, R, vi, (nk + 1) / 2);
            for (; r < rows; r += 2) {
                const int pair = r + 1 < rows;
                block_values_dp(acc + r * lanes, pair ? acc + (r + 1) * lanes : NULL, alpha[r],
                                pair ? alpha[r + 1] : 0.0f, pp + r, pp + r + 1, R, vi,
                                head_dim, (nk + 1) / 2, lanes);
            }
            continue;
        }
#endif
        for (int r = 0; r < rows; r += 2) {
            const int pair = r + 1 < rows;
            block_values(acc + r * lanes, pair ? acc + (r + 1) * lanes : NULL, alpha[r],
                         pair ? alpha[r + 1] : 0.0f, sc + r, sc + r + 1, R, vb, v_s, nk,
                         lanes);
        }
    }
    for (int r = 0; r < rows; r++) {
        const int t = t0 + r / group, h = it.head * group + r % group;
        const int64_t at = (first + t) * st->o_t + (int64_t)h * st->o_h;
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        if (bf16) {
            const float *a = (const float *)(acc + r * lanes);
            uint16_t *op = (uint16_t *)out + at;
            for (int d = 0; d < head_dim; d++) op[d] = f32_to_bf16(a[d] * inv);
        } else {
            vf *op = (vf *)((float *)out + at);
            for (int c = 0; c < lanes; c++) op[c] = acc[r * lanes + c] * inv;
        }
        put_lse(lse, first + t, h, m[r], l[r]);
    }
}

/* Specialised items: a constant `lanes` unrolls the inner loops, a constant `bf16`
 * drops the other storage type's code. */
#define LANES_A (64 / VL)
#define LANES_B (128 / VL)
#define LANES_0 0
#define ITEM_FOR(WHICH, SUFFIX, BF16)                                                       \
static void prefill_item_##WHICH##_##SUFFIX(const void *q, void *out, const void *kc,       \
                                            const void *vc, const int32_t *bt,              \
                                            const int32_t *sl, const int32_t *qsl, item_t it,\
                                            int group, int lanes, int bs, int w, float scale,\
                                            const strides_t *st, float *work, lse_out_t lse) {\
    prefill_item(q, out, kc, vc, bt, sl, qsl, it, group, LANES_##WHICH ? LANES_##WHICH : lanes,\
                 bs, w, scale,                                                             \
                 st, work, lse, BF16);                                                     \
}
/* head_dim 64 and 128 */
ITEM_FOR(A, f32, 0)
ITEM_FOR(B, f32, 0)
ITEM_FOR(0, f32, 0)
ITEM_FOR(A, bf16, 1)
ITEM_FOR(B, bf16, 1)
ITEM_FOR(0, bf16, 1)

typedef void (*item_fn)(const void *, void *, const void *, const void *, const int32_t *,
                        const int32_t *, const int32_t *, item_t, int, int, int, int, float,
                        const strides_t *, float *, lse_out_t);

static int prefill(const void *q, void *out, const void *kc, const void *vc,
                   const int32_t *block_tables, const int32_t *seq_lens,
                   const int32_t *query_start_loc, const int32_t *seq_ids, int num_seqs,
                   int num_heads, int num_kv_heads, int head_dim, int block_size, int window,
                   float scale, const strides_t *st, int num_threads, float *lse_p,
                   const int32_t *kv_end, int bf16) {
    const lse_out_t lse = {lse_p, num_heads, kv_end};
    const int group = num_kv_heads > 0 ? num_heads / num_kv_heads : 0;
    /* fp32 rows are read as vectors: their head strides keep 32-byte multiples */
    const int64_t align = bf16 ? 1 : 8;
    if (head_dim % 32 || head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK || group < 1
        || group > MAX_GROUP || num_heads % num_kv_heads || st->q_h % align || st->o_h % align
        || st->v_s % align || st->v_h % align || st->k_s % align || st->k_h % align)
        return 1;
    int num_items = 0;
    for (int i = 0; i < num_seqs; i++) {
        const int s = seq_ids[i], n = query_start_loc[s + 1] - query_start_loc[s];
        num_items += (n + TILE_Q - 1) / TILE_Q * num_kv_heads;
    }
    item_t *items = malloc(sizeof(item_t) * (num_items > 0 ? num_items : 1));
    if (!items) return 2;
    /* Longest tiles first (the last tiles of the longest sequences see the most keys),
     * so dynamic scheduling ends evenly. */
    int k = 0;
    for (int i = 0; i < num_seqs; i++) {
        const int s = seq_ids[i], n = query_start_loc[s + 1] - query_start_loc[s];
        for (int t = (n + TILE_Q - 1) / TILE_Q - 1; t >= 0; t--)
            for (int h = 0; h < num_kv_heads; h++) items[k++] = (item_t){s, h, t};
    }
    const int lanes = head_dim / VL;
    const int64_t R = (int64_t)TILE_Q * group;
    const int64_t work_floats = R * head_dim * 2 + (block_size + 3) * R + 5 * R +
                                2 * (int64_t)block_size * head_dim +
                                (block_size / 2 + 1) * (R + (int64_t)head_dim);
    const item_fn item = bf16 ? (lanes == LANES_A ? prefill_item_A_bf16 : lanes == LANES_B ?
                                 prefill_item_B_bf16 : prefill_item_0_bf16)
                              : (lanes == LANES_A ? prefill_item_A_f32 : lanes == LANES_B ?
                                 prefill_item_B_f32 : prefill_item_0_f32);
    int out_of_memory = 0;
    _Pragma("omp parallel num_threads(num_threads)")
    {
        float *work = aligned_alloc(32, ((size_t)work_floats * 4 + 31) / 32 * 32);
        _Pragma("omp for schedule(dynamic, 1)")
        for (int i = 0; i < num_items; i++) {
            if (!work) { out_of_memory = 1; continue; }
            item(q, out, kc, vc, block_tables, seq_lens, query_start_loc, items[i], group,
                 lanes, block_size, window, scale, st, work, lse);
        }
        free(work);
    }
    free(items);
    return out_of_memory ? 2 : 0;
}

#define DEFINE_PREFILL(SUFFIX, T, BF16)                                                     \
int paged_prefill_##SUFFIX(const T *q, T *out, const T *kc, const T *vc,                   \
                           const int32_t *block_tables, const int32_t *seq_lens,           \
                           const int32_t *query_start_loc, const int32_t *seq_ids,         \
                           int num_seqs, int num_heads, int num_kv_heads, int head_dim,    \
                           int block_size, int window, float scale, const strides_t *st,   \
                           int num_threads) {                                              \
    return prefill(q, out, kc, vc, block_tables, seq_lens, query_start_loc, seq_ids,       \
                   num_seqs, num_heads, num_kv_heads, head_dim, block_size, window, scale,  \
                   st, num_threads, NULL, NULL, BF16);                                     \
}                                                                                          \
int paged_prefill_##SUFFIX##_lse(const T *q, T *out, const T *kc, const T *vc,               \
                               const int32_t *block_tables, const int32_t *seq_lens,       \
                               const int32_t *query_start_loc, const int32_t *seq_ids,     \
                               int num_seqs, int num_heads, int num_kv_heads, int head_dim,\
                               int block_size, int window, float scale,                    \
                               const strides_t *st, int num_threads, float *lse,           \
                               const int32_t *kv_end) {                                    \
    return prefill(q, out, kc, vc, block_tables, seq_lens, query_start_loc, seq_ids,       \
                   num_seqs, num_heads, num_kv_heads, head_dim, block_size, window, scale,  \
                   st, num_threads, lse, kv_end, BF16);                                    \
}
DEFINE_PREFILL(f32, float, 0)
DEFINE_PREFILL(bf16, uint16_t, 1)
