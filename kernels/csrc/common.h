/* What fusegen's C kernels share: the attention kernels' stride struct and block walk,
 * and the fp16 / bf16 conversions, each written once. bf16 rounding is to nearest even, as torch
 * rounds, and a NaN stays a (quiet) NaN. */
#ifndef FUSEGEN_KERNELS_COMMON_H
#define FUSEGEN_KERNELS_COMMON_H

#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

/* GGML's type ids of the block formats fusegen multiplies (layouts: quant_gguf.c), and
 * X(ID, name, values, bytes) for each: its values and bytes a block */
enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
#define GGUF_FORMATS(X)                                                                  \
    X(Q8_0, q8_0, 32, 34) X(Q4_0, q4_0, 32, 18) X(Q4_1, q4_1, 32, 20)                    \
    X(Q5_0, q5_0, 32, 22) X(Q5_1, q5_1, 32, 24) X(Q4_K, q4_k, 256, 144)                  \
    X(Q5_K, q5_k, 256, 176) X(Q6_K, q6_k, 256, 210)

/* element strides of the paged attention kernels' tensors (kernels/native.py Strides) */
typedef struct {
    int64_t q_t, q_h;      /* q strides: token, head */
    int64_t o_t, o_h;      /* out strides */
    int64_t k_b, k_s, k_h; /* k cache strides: block, slot, head */
    int64_t v_b, v_s, v_h;
    int64_t bt;            /* block_tables row stride */
} strides_t;

/* One sequence's cached positions [pos, len) in a paged KV cache of strides `st`, walked
 * a run at a time, each run the positions that share one cache block: its length, the
 * element offsets of its first key and value rows, and where the next run's block starts
 * (for prefetching it while this run is computed). A sliding window starts the walk at
 * len - window. */
typedef struct {
    const int32_t *table; /* the sequence's block table row */
    const strides_t *st;
    int block_size, pos, len;
    int n;                  /* the current run: its length */
    int64_t k, v;           /* its first key and value rows */
    int has_next;           /* 0 at the last run */
    int64_t k_next, v_next; /* the next run's block's first rows (0 at the last run) */
} walk_t;

/* sequence `seq`'s walk: its row of block_tables, its length seq_lens[seq] */
static inline walk_t walk_seq(const int32_t *block_tables, const strides_t *st, int seq,
                              const int32_t *seq_lens, int block_size, int window) {
    const int len = seq_lens[seq];
    const int first = window > 0 && len > window ? len - window : 0;
    const walk_t w = {block_tables + (int64_t)seq * st->bt, st, block_size, first, len,
                      0, 0, 0, 0, 0, 0};
    return w;
}

/* moves to the next run: 1, or 0 past the end */
static inline int walk_next(walk_t *w) {
    w->pos += w->n;
    if (w->pos >= w->len) return 0;
    const int64_t block = w->table[w->pos / w->block_size];
    const int slot0 = w->pos % w->block_size;
    w->n = w->block_size - slot0 < w->len - w->pos ? w->block_size - slot0 : w->len - w->pos;
    w->k = block * w->st->k_b + (int64_t)slot0 * w->st->k_s;
    w->v = block * w->st->v_b + (int64_t)slot0 * w->st->v_s;
    const int next = w->pos + w->n;
    w->has_next = next < w->len;
    const int64_t next_block = w->has_next ? w->table[next / w->block_size] : 0;
    w->k_next = next_block * w->st->k_b;
    w->v_next = next_block * w->st->v_b;
    return 1;
}

/* CALL(R) with R the constant 1 to 6 that equals `rows` (1 to 6): a micro-kernel inlined
 * into each case sees its row count as a constant, so its loops over rows unroll and its
 * accumulators stay in registers. */
#define FOR_ROWS_1_TO_6(rows, CALL)                                                      \
    switch (rows) {                                                                      \
    case 6: CALL(6); break;                                                              \
    case 5: CALL(5); break;                                                              \
    case 4: CALL(4); break;                                                              \
    case 3: CALL(3); break;                                                              \
    case 2: CALL(2); break;                                                              \
    default: CALL(1); break;                                                             \
    }

static inline float bf16_to_f32(uint16_t x) {
    const uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)(u >> 16 | 0x40); /* NaN */
    return (uint16_t)((u + 0x7fff + (u >> 16 & 1)) >> 16);
}

static inline float fp16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t u;
    if (e == 0x1f) {
        u = sign | 0x7f800000u | man << 13;
    } else if (e == 0) { /* zero or subnormal: man x 2^-24 */
        const float f = (float)man * (1.0f / 16777216.0f);
        return sign ? -f : f;
    } else {
        u = sign | (e + 112) << 23 | man << 13;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

static inline uint32_t load32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

#endif /* FUSEGEN_KERNELS_COMMON_H */
