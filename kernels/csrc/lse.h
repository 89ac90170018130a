/* What the paged attention kernels' `_lse` entry points take beyond the plain ones, for
 * callers that merge partial attentions over disjoint key ranges
 * (kernels/cooperative_attention.py): where to write each query row's log-sum-exp,
 * lse[row * t + head] = m + log(l), the running max and sum of exp(score - m) of the
 * row's scaled scores, natural log (a row that saw no key gets -FLT_MAX: the kernels
 * build with -ffast-math, which assumes no infinities; p NULL: not asked for); and, for
 * the prefill kernel, where each sequence's keys end (kv_end[seq] <= seq_lens[seq]: its
 * rows keep their positions but see no key from there on; NULL: at seq_lens). */
#ifndef FUSEGEN_KERNELS_LSE_H
#define FUSEGEN_KERNELS_LSE_H

#include <float.h>
#include <math.h>
#include <stdint.h>

typedef struct {
    float *p;  /* [T, t] fp32, or NULL */
    int64_t t; /* row stride: the number of query heads */
    const int32_t *kv_end; /* [B] or NULL */
} lse_out_t;

static inline void put_lse(lse_out_t lse, int64_t row, int head, float m, float l) {
    if (lse.p) lse.p[row * lse.t + head] = l > 0.0f ? m + logf(l) : -FLT_MAX;
}

#endif
