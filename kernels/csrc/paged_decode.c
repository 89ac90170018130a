/* Decode attention over a paged KV cache, for CPUs.
 *
 * One query token per sequence attends to the sequence's keys and values where they
 * lie, block by block, through its block table: nothing is gathered into a dense copy,
 * so each key and value is read from memory once per step. Softmax is online (a
 * running max and sum per query head, rescaled once per block), in fp32 whatever the
 * cache dtype. Work items are (sequence, range of KV heads), spread over OpenMP
 * threads with dynamic scheduling because sequence lengths differ.
 *
 * Layouts (element strides given by the caller, the head dimension contiguous):
 *   q, out        [T, Hq, D]  the decode sequence i's query row is query_start_loc[i]
 *   k/v cache     [N, block_size, Hkv, D]
 *   block_tables  [B, W] int32, seq_lens [B] int32, query_start_loc [B+1] int32
 *   seq_ids       [n] int32: the sequences to compute (NULL: 0..n-1)
 * Returns 0, 1 for a shape it does not take (head_dim or block_size over 256, heads
 * not a multiple of KV heads), 2 when per-thread scratch could not be allocated.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h" /* strides_t, bf16 conversions */
#include "lse.h"    /* lse_out_t: the rows' log-sum-exp, where asked for */
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define MAX_HEAD_DIM 256
#define MAX_BLOCK 256

/* The scalar item's walk over one run of a block, for its key pass and its value pass:
 * for each slot j of the run and KV head h of the item, that row of CACHE (kc or vc, X
 * its strides' letter) widened to fp32 in kv[], then BODY once for each query head i of
 * h's group. */
#define EACH_ROW(T, LOAD, CACHE, X, ...)                                                    \
    for (int j = 0; j < n; j++)                                                             \
        for (int h = h0; h < h1; h++) {                                                     \
            const T *row_ = CACHE + w.X + (int64_t)j * st->X##_s + (int64_t)h * st->X##_h;  \
            for (int d = 0; d < head_dim; d++) kv[d] = LOAD(row_[d]);                       \
            for (int i = (h - h0) * group; i < (h - h0 + 1) * group; i++) __VA_ARGS__      \
        }

/* One definition per cache dtype: T is the element type, LOAD/STORE convert to and
 * from fp32; VECTOR_ITEM, when not 0, serves head dimensions that are multiples of 8. */
#define DEFINE_DECODE(NAME, T, LOAD, STORE, VECTOR_ITEM)                                    \
static void NAME##_item(const T *q, T *out, const T *kc, const T *vc,                      \
                        const int32_t *block_tables, const int32_t *seq_lens,              \
                        const int32_t *query_start_loc, int seq, int h0, int h1,           \
                        int group, int head_dim, int block_size, int window, float scale,  \
                        const strides_t *st, float *work, lse_out_t lse) {                 \
    const int nq = (h1 - h0) * group;            /* query heads of this item */             \
    float *qf = work;                            /* [nq, D] scaled queries */              \
    float *acc = qf + (int64_t)nq * head_dim;    /* [nq, D] */                             \
    float *m = acc + (int64_t)nq * head_dim;     /* [nq] running max */                    \
    float *l = m + nq;                           /* [nq] running sum */                    \
    float *s = l + nq;                           /* [nq, block_size] scores */             \
    const int64_t row = query_start_loc[seq];                                              \
    for (int i = 0; i < nq; i++) {                                                          \
        const T *qp = q + row * st->q_t + (int64_t)(h0 * group + i) * st->q_h;             \
        for (int d = 0; d < head_dim; d++) qf[i * head_dim + d] = LOAD(qp[d]) * scale;     \
        memset(acc + (int64_t)i * head_dim, 0, sizeof(float) * head_dim);                  \
        m[i] = -FLT_MAX; /* -inf would break under -ffast-math */                         \
        l[i] = 0.0f;                                                                        \
    }                                                                                       \
    float kv[MAX_HEAD_DIM];                                                                 \
    for (walk_t w = walk_seq(block_tables, st, seq, seq_lens, block_size, window);          \
         walk_next(&w);) {                                                                  \
        const int n = w.n;                                                                  \
        EACH_ROW(T, LOAD, kc, k, {                                                          \
            const float *qi = qf + (int64_t)i * head_dim;                                   \
            float dot = 0.0f;                                                               \
            _Pragma("omp simd reduction(+:dot)")                                            \
            for (int d = 0; d < head_dim; d++) dot += qi[d] * kv[d];                        \
            s[i * block_size + j] = dot;                                                    \
        })                                                                                  \
        for (int i = 0; i < nq; i++) {                                                      \
            float *si = s + i * block_size;                                                 \
            float top = m[i];                                                               \
            for (int j = 0; j < n; j++) top = si[j] > top ? si[j] : top;                    \
            const float alpha = expf(m[i] - top); /* 0 on the first block */                \
            float sum = 0.0f;                                                               \
            for (int j = 0; j < n; j++) { si[j] = expf(si[j] - top); sum += si[j]; }        \
            l[i] = l[i] * alpha + sum;                                                      \
            m[i] = top;                                                                     \
            float *ai = acc + (int64_t)i * head_dim;                                        \
            if (alpha != 1.0f)                                                              \
                for (int d = 0; d < head_dim; d++) ai[d] *= alpha;                          \
        }                                                                                   \
        EACH_ROW(T, LOAD, vc, v, {                                                          \
            const float p = s[i * block_size + j];                                          \
            float *ai = acc + (int64_t)i * head_dim;                                        \
            _Pragma("omp simd")                                                             \
            for (int d = 0; d < head_dim; d++) ai[d] += p * kv[d];                          \
        })                                                                                  \
    }                                                                                       \
    for (int i = 0; i < nq; i++) {                                                          \
        T *op = out + row * st->o_t + (int64_t)(h0 * group + i) * st->o_h;                 \
        const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;                                 \
        for (int d = 0; d < head_dim; d++) op[d] = STORE(acc[i * head_dim + d] * inv);     \
        put_lse(lse, row, h0 * group + i, m[i], l[i]);                                      \
    }                                                                                       \
}                                                                                           \
                                                                                            \
int NAME##_lse(const T *q, T *out, const T *kc, const T *vc, const int32_t *block_tables,  \
         const int32_t *seq_lens, const int32_t *query_start_loc, const int32_t *seq_ids,   \
         int num_items, int num_heads, int num_kv_heads, int head_dim, int block_size,     \
         int window, float scale, const strides_t *st, int num_threads, float *lse_p) {     \
    const lse_out_t lse = {lse_p, num_heads, NULL};                                         \
    if (head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK || num_heads % num_kv_heads)     \
        return 1;                                                                           \
    const int group = num_heads / num_kv_heads;                                             \
    /* Few sequences: split each one's KV heads over the threads as well. */               \
    const int head_split = num_items >= 4 * num_threads ? 1 : num_kv_heads;                \
    const int heads_per = num_kv_heads / head_split;                                        \
    const int64_t work_floats = (int64_t)heads_per * group * (2 * head_dim + 2 + block_size); \
    const int total = num_items * head_split;                                               \
    const int vector = (VECTOR_ITEM != 0) && head_dim % 8 == 0                              \
                       && st->q_h % 8 == 0 && st->o_h % 8 == 0;                             \
    int out_of_memory = 0;                                                                  \
    _Pragma("omp parallel num_threads(num_threads)")                                        \
    {                                                                                       \
        /* Per-thread scratch on the heap: large head counts would overflow the small  \
         * stacks of OpenMP worker threads. */                                              \
        float *work = aligned_alloc(32, ((size_t)work_floats * 4 + 31) / 32 * 32);          \
        _Pragma("omp for schedule(dynamic, 1)")                                             \
        for (int item = 0; item < total; item++) {                                          \
            const int b = item / head_split;                                                \
            const int h0 = (item % head_split) * heads_per;                                 \
            const int seq = seq_ids ? seq_ids[b] : b;                                       \
            if (!work) { out_of_memory = 1; continue; }                                     \
            (vector ? VECTOR_ITEM : NAME##_item)(                                           \
                q, out, kc, vc, block_tables, seq_lens, query_start_loc, seq, h0,           \
                h0 + heads_per, group, head_dim, block_size, window, scale, st, work, lse); \
        }                                                                                   \
        free(work);                                                                         \
    }                                                                                       \
    return out_of_memory ? 2 : 0;                                                           \
}                                                                                           \
                                                                                            \
int NAME(const T *q, T *out, const T *kc, const T *vc, const int32_t *block_tables,        \
         const int32_t *seq_lens, const int32_t *query_start_loc, const int32_t *seq_ids,   \
         int num_items, int num_heads, int num_kv_heads, int head_dim, int block_size,     \
         int window, float scale, const strides_t *st, int num_threads) {                   \
    return NAME##_lse(q, out, kc, vc, block_tables, seq_lens, query_start_loc, seq_ids,    \
                      num_items, num_heads, num_kv_heads, head_dim, block_size, window,    \
                      scale, st, num_threads, NULL);                                        \
}

/* fp32 and bf16 with a head dimension that is a multiple of 8: the same algorithm in
 * 8-lane vectors (GCC vector extensions: AVX on x86, pairs of NEON registers on Arm). */
typedef float v8f __attribute__((vector_size(32), aligned(4)));
#define MAX_LANES (MAX_HEAD_DIM / 8)

static inline float hsum8(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* Eight elements of a row stored as fp32 or bf16, as fp32 lanes; `bf16` is a constant at
 * every call. bf16 widens exactly: its bits are the high half of the fp32 value's. */
typedef uint16_t v8h __attribute__((vector_size(16), aligned(2)));
typedef uint32_t v8u __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) v8f load8(const void *p, int64_t i, int bf16) {
    v8f f;
    if (bf16) {
#if defined(__AVX2__)
        /* one widening load and a shift (GCC splits the generic form below in halves) */
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
        f = (v8f)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#else
        v8h h;
        memcpy(&h, (const uint16_t *)p + i, sizeof h);
        const v8u u = __builtin_convertvector(h, v8u) << 16;
        memcpy(&f, &u, sizeof f);
#endif
    } else {
#if defined(__AVX2__)
        /* one unaligned load: for AVX2 targets (-march=znver3, haswell) GCC can turn the
         * memcpy into two 16-byte halves stored to the stack and read back as one
         * 32-byte vector, a failed store forward per row that slows the KV read several
         * times over (docs/performance.md) */
        f = (v8f)_mm256_loadu_ps((const float *)p + i);
#else
        memcpy(&f, (const float *)p + i, sizeof f);
#endif
    }
    return f;
}

/* acc [lanes] += sum over the block's n slots of p[j] * v row j (rows v_s elements
 * apart). One query at a time, slot after slot: with `lanes` a constant the compiler
 * keeps acc in registers instead of loading and storing it for every slot. */
static inline __attribute__((always_inline)) void accumulate_values(
        v8f *acc, const float *p, const void *v, int64_t v_s, int n, const int lanes,
        const int bf16, const char *next) {
    v8f a[MAX_LANES];
    const int64_t es = bf16 ? 2 : 4, row_bytes = (int64_t)lanes * 8 * es;
    for (int c = 0; c < lanes; c++) a[c] = acc[c];
    for (int j = 0; j < n; j++) {
        if (next)  /* the next block's row j of this head */
            for (int64_t c = 0; c < row_bytes; c += 64)
                __builtin_prefetch(next + (int64_t)j * v_s * es + c);
        for (int c = 0; c < lanes; c++) a[c] += p[j] * load8(v, (int64_t)j * v_s + 8 * c, bf16);
    }
    for (int c = 0; c < lanes; c++) acc[c] = a[c];
}

/* Two queries of a group over the same values (bf16, head_dim 64): each value row is
 * widened once for both, the sixteen accumulators in registers (AVX-512 has 32). */
static inline __attribute__((always_inline)) void accumulate_values_pair(
        v8f *acc0, v8f *acc1, const float *p0, const float *p1, const void *v, int64_t v_s,
        int n, const char *next) {
    v8f a[8], b[8];
    for (int c = 0; c < 8; c++) a[c] = acc0[c], b[c] = acc1[c];
    for (int j = 0; j < n; j++)
        for (int c = 0; c < 8; c++) {
            if (next && c % 4 == 0)  /* 128 bytes a row: two lines */
                __builtin_prefetch(next + (int64_t)j * v_s * 2 + 16 * c);
            const v8f x = load8(v, (int64_t)j * v_s + 8 * c, 1);
            a[c] += p0[j] * x;
            b[c] += p1[j] * x;
        }
    for (int c = 0; c < 8; c++) acc0[c] = a[c], acc1[c] = b[c];
}

/* One query's scores of a block, s[0..n), turned into exp(s - max) in place: the running
 * max m and sum l move on, and the returned factor rescales what was accumulated before. */
static inline __attribute__((always_inline)) float softmax_block(float *si, int n, float *m,
                                                                 float *l) {
    float top = *m;
    for (int j = 0; j < n; j++) top = si[j] > top ? si[j] : top;
    const float alpha = expf(*m - top);
    float sum = 0.0f;
    _Pragma("omp simd reduction(+:sum)")
    for (int j = 0; j < n; j++) { si[j] = expf(si[j] - top); sum += si[j]; }
    *l = *l * alpha + sum;
    *m = top;
    return alpha;
}

/* The item in 8-lane vectors, for head dimensions that are multiples of 8; the cache and
 * the queries and output in fp32 or bf16 (`bf16` a constant in each wrapper below). */
static inline __attribute__((always_inline)) void decode_x8_item(
        const void *q, void *out, const void *kc, const void *vc,
        const int32_t *block_tables, const int32_t *seq_lens, const int32_t *query_start_loc,
        int seq, int h0, int h1, int group, int head_dim, int block_size, int window,
        float scale, const strides_t *st, float *work, lse_out_t lse, const int bf16,
        const int lanes) {
    const int nq = (h1 - h0) * group;
    /* the strides as locals: read through `st`, every store to the scores would make
     * the compiler load them again */
    const int64_t k_s = st->k_s, k_h = st->k_h;
    const int64_t v_s = st->v_s, v_h = st->v_h;
    const int64_t es = bf16 ? 2 : 4;            /* bytes per element */
    v8f *qv = (v8f *)work;                  /* [nq, lanes] scaled queries */
    v8f *acc = qv + (int64_t)nq * lanes;    /* [nq, lanes] */
    float *m = (float *)(acc + (int64_t)nq * lanes);
    float *l = m + nq;
    float *s = l + nq;                      /* [nq, block_size] */
    const int64_t row = query_start_loc[seq];
    for (int i = 0; i < nq; i++) {
        const int64_t at = row * st->q_t + (int64_t)(h0 * group + i) * st->q_h;
        for (int c = 0; c < lanes; c++) {
            qv[i * lanes + c] = load8(q, at + 8 * c, bf16) * scale;
            acc[i * lanes + c] = (v8f){0};
        }
        m[i] = -FLT_MAX;
        l[i] = 0.0f;
    }
    for (walk_t w = walk_seq(block_tables, st, seq, seq_lens, block_size, window); walk_next(&w);) {
        const int n = w.n, has_next = w.has_next;
        /* The next block is elsewhere in the cache (its id comes from the table), where
         * the hardware prefetcher cannot follow: ask for its rows while this one runs,
         * its keys during the key pass and its values during the value pass. A core has
         * few misses in flight (its L1 miss buffers); asking for both in the key pass
         * would fill them there and leave the value pass with nothing in flight
         * (docs/performance.md). */
        const char *kn = (const char *)kc + w.k_next * es;
        const char *vn = (const char *)vc + w.v_next * es;
        for (int j = 0; j < n; j++) {
            for (int h = h0; h < h1; h++) {
                if (has_next)
                    for (int64_t c = 0; c < head_dim * es; c += 64)
                        __builtin_prefetch(kn + ((int64_t)j * k_s + (int64_t)h * k_h) * es + c);
                const int64_t kp = w.k + (int64_t)j * k_s + (int64_t)h * k_h;
                /* bf16: the key widened once for the whole group (fp32 keys are read
                 * straight from memory, where AVX2's 16 registers would spill them) */
                v8f kw[MAX_LANES];
                if (bf16)
                    for (int c = 0; c < lanes; c++) kw[c] = load8(kc, kp + 8 * c, 1);
#define K(c) (bf16 ? kw[c] : load8(kc, kp + 8 * (c), 0))
                for (int g = 0; g < group; g++) {
                    const int i = (h - h0) * group + g;
                    const v8f *qi = qv + i * lanes;
                    v8f a = qi[0] * K(0), b = (v8f){0};
                    int c = 1;
                    for (; c + 1 < lanes; c += 2) {
                        b += qi[c] * K(c);
                        a += qi[c + 1] * K(c + 1);
                    }
                    if (c < lanes) b += qi[c] * K(c);
#undef K
                    s[i * block_size + j] = hsum8(a + b);
                }
            }
        }
        for (int i = 0; i < nq; i++) {
            const float alpha = softmax_block(s + i * block_size, n, m + i, l + i);
            if (alpha != 1.0f)
                for (int c = 0; c < lanes; c++) acc[i * lanes + c] *= alpha;
        }
        for (int h = h0; h < h1; h++) {
#if defined(__AVX512F__)
            if (bf16 && lanes == 8 && group == 2) {
                const int i = (h - h0) * 2;
                accumulate_values_pair(acc + i * 8, acc + (i + 1) * 8, s + i * block_size,
                                       s + (i + 1) * block_size,
                                       (const uint16_t *)vc + w.v + (int64_t)h * v_h,
                                       v_s, n, has_next ? vn + (int64_t)h * v_h * es : NULL);
                continue;
            }
#endif
            for (int g = 0; g < group; g++) {
                const int i = (h - h0) * group + g;
                const char *vh = (const char *)vc + (w.v + (int64_t)h * v_h) * es;
                /* the head's rows of the next block, asked for by its first query */
                const char *ahead = has_next && g == 0 ? vn + (int64_t)h * v_h * es : NULL;
                if (lanes == 8)  /* head_dim 64: the accumulator stays in registers */
                    accumulate_values(acc + i * 8, s + i * block_size, vh, v_s, n, 8, bf16,
                                      ahead);
                else if (lanes == 16)  /* head_dim 128 */
                    accumulate_values(acc + i * 16, s + i * block_size, vh, v_s, n, 16, bf16,
                                      ahead);
                else
                    accumulate_values(acc + i * lanes, s + i * block_size, vh, v_s, n, lanes,
                                      bf16, ahead);
            }
        }
    }
    for (int i = 0; i < nq; i++) {
        const int64_t at = row * st->o_t + (int64_t)(h0 * group + i) * st->o_h;
        const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
        for (int c = 0; c < lanes; c++) {
            const v8f o = acc[i * lanes + c] * inv;
            if (bf16)
                for (int e = 0; e < 8; e++) ((uint16_t *)out)[at + 8 * c + e] = f32_to_bf16(o[e]);
            else
                memcpy((float *)out + at + 8 * c, &o, sizeof o);
        }
        put_lse(lse, row, h0 * group + i, m[i], l[i]);
    }
}

#if defined(__AVX512BF16__)
/* bf16 with head_dim 64 or 128 (L = head_dim / 16 vectors a row) where the CPU has
 * AVX512_BF16: the scores by vdpbf16ps on the bf16 queries and keys as stored (exact
 * products summed in fp32, 32 channels an instruction; no key is widened), scaled once;
 * the values widened into 16-lane vectors once for two queries of the group, whose
 * accumulators stay in registers. Taken for groups of 2 query heads and more, where it
 * is faster than the 8-lane item (docs/performance.md has the group sizes measured). */
static inline __attribute__((always_inline)) __m512 widen16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __attribute__((always_inline)) void decode_dp_item(
        const uint16_t *q, uint16_t *out, const uint16_t *kc, const uint16_t *vc,
        const int32_t *block_tables, const int32_t *seq_lens, const int32_t *query_start_loc,
        int seq, int h0, int h1, int group, int block_size, int window, float scale,
        const strides_t *st, float *work, lse_out_t lse, const int L) {
    const int head_dim = 16 * L, nq = (h1 - h0) * group;
    const int64_t k_s = st->k_s, k_h = st->k_h;
    const int64_t v_s = st->v_s, v_h = st->v_h;
    float *acc = work;                                  /* [nq, head_dim] */
    float *m = acc + (int64_t)nq * head_dim, *l = m + nq;
    float *s = l + nq;                                  /* [nq, block_size] */
    __m512bh qb[64 * 4];                                /* up to 64 queries of head_dim 128 */
    const int64_t row = query_start_loc[seq];
    const int pairs = head_dim / 32;                    /* 32 channels a vdpbf16ps */
    for (int i = 0; i < nq; i++) {
        const uint16_t *qp = q + row * st->q_t + (int64_t)(h0 * group + i) * st->q_h;
        for (int c = 0; c < pairs; c++)
            qb[i * pairs + c] = (__m512bh)_mm512_loadu_si512(qp + 32 * c);
        for (int c = 0; c < head_dim; c++) acc[(int64_t)i * head_dim + c] = 0.0f;
        m[i] = -FLT_MAX;
        l[i] = 0.0f;
    }
    for (walk_t w = walk_seq(block_tables, st, seq, seq_lens, block_size, window); walk_next(&w);) {
        const int n = w.n, has_next = w.has_next;
        /* the next block's rows asked for while this one runs (see decode_x8_item) */
        const uint16_t *kn = kc + w.k_next, *vn = vc + w.v_next;
        for (int j = 0; j < n; j++)
            for (int h = h0; h < h1; h++) {
                if (has_next)
                    for (int c = 0; c < head_dim; c += 32)
                        __builtin_prefetch(kn + (int64_t)j * k_s + (int64_t)h * k_h + c);
                const uint16_t *kp = kc + w.k + (int64_t)j * k_s + (int64_t)h * k_h;
                __m512bh kv[4];
                for (int c = 0; c < pairs; c++) kv[c] = (__m512bh)_mm512_loadu_si512(kp + 32 * c);
                for (int g = 0; g < group; g++) {
                    const int i = (h - h0) * group + g;
                    __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[i * pairs], kv[0]);
                    for (int c = 1; c < pairs; c++)
                        a = _mm512_dpbf16_ps(a, qb[i * pairs + c], kv[c]);
                    s[i * block_size + j] = _mm512_reduce_add_ps(a) * scale;
                }
            }
        for (int i = 0; i < nq; i++) {
            const float alpha = softmax_block(s + i * block_size, n, m + i, l + i);
            if (alpha != 1.0f) {
                const __m512 av = _mm512_set1_ps(alpha);
                for (int c = 0; c < L; c++) {
                    float *ap = acc + (int64_t)i * head_dim + 16 * c;
                    _mm512_storeu_ps(ap, _mm512_mul_ps(_mm512_loadu_ps(ap), av));
                }
            }
        }
        for (int h = h0; h < h1; h++) {
            const uint16_t *vh = vc + w.v + (int64_t)h * v_h;
            for (int g = 0; g < group; g += 2) {
                const int i = (h - h0) * group + g, two = g + 1 < group;
                float *a0p = acc + (int64_t)i * head_dim, *a1p = a0p + head_dim;
                const float *p0 = s + i * block_size, *p1 = p0 + block_size;
                __m512 a0[8], a1[8];
                for (int c = 0; c < L; c++) {
                    a0[c] = _mm512_loadu_ps(a0p + 16 * c);
                    a1[c] = two ? _mm512_loadu_ps(a1p + 16 * c) : _mm512_setzero_ps();
                }
                for (int j = 0; j < n; j++) {
                    /* the head's next rows (as in the x8 item), spread over its pairs */
                    if (has_next && j % ((group + 1) / 2) == g / 2)
                        for (int c = 0; c < head_dim; c += 32)
                            __builtin_prefetch(vn + (int64_t)j * v_s + (int64_t)h * v_h + c);
                    const __m512 x0 = _mm512_set1_ps(p0[j]);
                    const __m512 x1 = _mm512_set1_ps(two ? p1[j] : 0.0f);
                    const uint16_t *vr = vh + (int64_t)j * v_s;
                    for (int c = 0; c < L; c++) {
                        const __m512 v = widen16(vr + 16 * c);
                        a0[c] = _mm512_fmadd_ps(x0, v, a0[c]);
                        if (two) a1[c] = _mm512_fmadd_ps(x1, v, a1[c]);
                    }
                }
                for (int c = 0; c < L; c++) {
                    _mm512_storeu_ps(a0p + 16 * c, a0[c]);
                    if (two) _mm512_storeu_ps(a1p + 16 * c, a1[c]);
                }
            }
        }
    }
    for (int i = 0; i < nq; i++) {
        const int64_t at = row * st->o_t + (int64_t)(h0 * group + i) * st->o_h;
        const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
        for (int c = 0; c < head_dim; c++)
            out[at + c] = f32_to_bf16(acc[(int64_t)i * head_dim + c] * inv);
        put_lse(lse, row, h0 * group + i, m[i], l[i]);
    }
}
#define DECODE_DP 1
#else
#define DECODE_DP 0
#endif

#if DECODE_DP
/* The dp item for the wrappers below, with L a constant; it is only called for bf16. */
static void decode_dp_bf16(const void *q, void *out, const void *kc, const void *vc,
                           const int32_t *block_tables, const int32_t *seq_lens,
                           const int32_t *query_start_loc, int seq, int h0, int h1, int group,
                           int head_dim, int block_size, int window, float scale,
                           const strides_t *st, float *work, lse_out_t lse) {
    if (head_dim == 64)
        decode_dp_item(q, out, kc, vc, block_tables, seq_lens, query_start_loc, seq, h0, h1,
                       group, block_size, window, scale, st, work, lse, 4);
    else
        decode_dp_item(q, out, kc, vc, block_tables, seq_lens, query_start_loc, seq, h0, h1,
                       group, block_size, window, scale, st, work, lse, 8);
}
#else
#define decode_dp_bf16(...) ((void)0)  /* never taken: DECODE_DP guards the call */
#endif

#define DEFINE_X8_ITEM(NAME, T, BF16)                                                       \
static void NAME(const T *q, T *out, const T *kc, const T *vc, const int32_t *block_tables, \
                 const int32_t *seq_lens, const int32_t *query_start_loc, int seq, int h0,  \
                 int h1, int group, int head_dim, int block_size, int window, float scale,  \
                 const strides_t *st, float *work, lse_out_t lse) {                        \
    /* head_dim 64 and 128 with `lanes` a constant: the loops over it unroll */           \
    if (BF16 && DECODE_DP && (head_dim == 64 || head_dim == 128) && group >= 2            \
        && (h1 - h0) * group <= 64)                                                         \
        decode_dp_bf16(q, out, kc, vc, block_tables, seq_lens, query_start_loc, seq, h0, h1,\
                       group, head_dim, block_size, window, scale, st, work, lse);         \
    else if (head_dim == 64)                                                                \
        decode_x8_item(q, out, kc, vc, block_tables, seq_lens, query_start_loc, seq, h0, h1,\
                       group, head_dim, block_size, window, scale, st, work, lse, BF16, 8);\
    else if (head_dim == 128)                                                               \
        decode_x8_item(q, out, kc, vc, block_tables, seq_lens, query_start_loc, seq, h0, h1,\
                       group, head_dim, block_size, window, scale, st, work, lse, BF16, 16);\
    else                                                                                    \
        decode_x8_item(q, out, kc, vc, block_tables, seq_lens, query_start_loc, seq, h0, h1,\
                       group, head_dim, block_size, window, scale, st, work, lse, BF16,     \
                       head_dim / 8);                                                       \
}
DEFINE_X8_ITEM(paged_decode_f32x8_item, float, 0)
DEFINE_X8_ITEM(paged_decode_bf16x8_item, uint16_t, 1)

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)
#define STORE_BF16(x) f32_to_bf16(x)
#define LOAD_F16(x) ((float)(x))
#define STORE_F16(x) ((_Float16)(x))

DEFINE_DECODE(paged_decode_f32, float, LOAD_F32, STORE_F32, paged_decode_f32x8_item)
DEFINE_DECODE(paged_decode_bf16, uint16_t, LOAD_BF16, STORE_BF16, paged_decode_bf16x8_item)
DEFINE_DECODE(paged_decode_f16, _Float16, LOAD_F16, STORE_F16, 0)
