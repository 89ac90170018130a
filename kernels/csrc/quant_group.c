/* Products against a group-quantized weight (docs/quantization.md): out [T, N] =
 * x [T, K] W^T for decode-sized T (at most MAX_ROWS rows; the caller splits larger calls),
 * W [N, K] kept as its codes:
 *
 *   W[o, i] = (q[o, i] - zero[o, i / g]) * scale[o, i / g],  g = 32, 64 or 128
 *
 * q: uint8 codes, int8 one a byte [N, K]; int4 two a byte [N, K / 2], in runs of 32
 * channels (16 bytes) byte k holding channel k in its low nibble and k + 16 in its high
 * (GGUF Q4_0's order). scale: fp16 [N, K / g]; zero: uint8 [N, K / g], or none (symmetric:
 * 128 for int8, 8 for int4). A weight is exact in fp32 (a difference of at most 9 bits
 * times an 11-bit scale), so every expansion below gives the same fp32 value, the value
 * torch's dequantize gives.
 *
 * How: threads split the output rows in groups of NR. Calls of more than DIRECT_ROWS rows
 * (prefill) expand a group's NR weight rows into the thread's scratch (fp32, or bf16 for
 * the bf16 product), once per call, and a micro-kernel multiplies MR rows of x at a time
 * with them, MR x NR vectors of fp32 sums in registers. Calls of up to DIRECT_ROWS rows
 * (decode) expand each run of 32 channels of the NR rows in registers and multiply it at
 * once: the codes are read once, nothing goes through memory. With AVX-512 the scales and
 * zero points of 16 groups are converted at once; an int4 run is a table lookup of its
 * group's 16 values (vpermps for fp32, vpermw for bf16, indexed by the nibbles shifted in
 * place), an int8 run a widening, a conversion and an FMA per 16 values. With AVX2 a run
 * is four ymm of widened, converted codes (decode calls in registers too, prefill through
 * the scratch); plain C is the reference expansion and the only one elsewhere. The bf16
 * product takes an int4 run's channels in the order its bytes' nibbles fall out of four
 * shifts (PERM4), and x is permuted to match once per call.
 *
 * bf16 x: with AVX512_BF16 the weights are rounded to bf16 (nearest even, the values a
 * model dequantized to bf16 holds) and multiplied pairwise by vdpbf16ps (exact products,
 * fp32 sums); elsewhere x is widened to fp32 and multiplied with the weights rounded to
 * bf16 precision (the same exact products). Either way the sums are rounded once to bf16.
 *
 * Every output element is summed in one order, whatever T, the thread count, the path
 * (direct or scratch, vector or plain-C expansion) or the element's place in the batch:
 * lane-wise over K in steps of the vector width (products of channel pairs for
 * vdpbf16ps), then the lanes. A row's result is therefore independent of its batch.
 */
#include <stdlib.h>

/* Sums keep the order written (expand.h): an element's value cannot depend on which
 * inlined copy of a kernel computed it. */
#pragma GCC optimize("no-associative-math")

#include "expand.h"

#define RUN 32 /* channels a step: one int4 run, one vdpbf16ps */
#if HAS_AVX512
/* calls of up to this many rows expand in registers: on Zen 4 (4096 x 4096, one thread)
 * that takes half the scratch path's time at 2-3 rows, as much at 4 (int4) */
#define DIRECT_ROWS 4
#elif HAS_AVX2
#define DIRECT_ROWS 2 /* 4 sums, a run's 4 weight vectors, x, the group's constants */
#else
#define DIRECT_ROWS 0
#endif

/* how the product multiplies: fp32 x and weights; bf16 x widened to fp32 against weights
 * rounded to bf16 precision; bf16 x and bf16 weights by vdpbf16ps */
enum { F32 = 0, F32_ROUNDED = 1, BF16 = 2 };

typedef struct {
    int bits, group;     /* 4 or 8; 32, 64 or 128 */
    const uint8_t *q;    /* codes, row_bytes a row */
    const uint8_t *s;    /* fp16 scales, groups a row */
    const uint8_t *z;    /* zero points, groups a row; 0: symmetric */
    int64_t k, groups, row_bytes;
} layout_t;

static inline float scale_of(const layout_t *L, int64_t o, int64_t g) {
    return fp16(L->s + 2 * (o * L->groups + g));
}

static inline int zero_of(const layout_t *L, int64_t o, int64_t g) {
    return L->z ? L->z[o * L->groups + g] : (L->bits == 8 ? 128 : 8);
}

#if DIRECT_ROWS > 0
/* A decode group: its rows o (a last group's missing rows repeat its last row), their codes
 * q, and R rows of sums c */
typedef struct {
    vf c[DIRECT_ROWS][NR];
    const uint8_t *q[NR];
    int64_t o[NR];
} direct_t;

static inline __attribute__((always_inline)) void
direct_begin(const layout_t *L, int64_t first, int ncols, const int R, direct_t *d) {
    for (int j = 0; j < NR; j++) {
        d->o[j] = first + (j < ncols ? j : ncols - 1);
        d->q[j] = L->q + d->o[j] * L->row_bytes;
        for (int r = 0; r < R; r++) d->c[r][j] = (vf){0};
    }
}
#endif

/* ---- plain-C expansion of weight row o into y[k] (fp32) ------------------------------ */

static void row_plain(const layout_t *L, int64_t o, float *y) {
    const uint8_t *q = L->q + o * L->row_bytes;
    for (int64_t g = 0; g < L->groups; g++) {
        const float s = scale_of(L, o, g);
        const int z = zero_of(L, o, g);
        if (L->bits == 8) {
            for (int j = 0; j < L->group; j++) y[j] = (float)(q[j] - z) * s;
            q += L->group;
        } else { /* low nibbles, then high: one loop each, the form a compiler vectorises */
            for (int r = 0; r < L->group; r += RUN, q += RUN / 2) {
                for (int j = 0; j < 16; j++) y[r + j] = (float)((q[j] & 0xf) - z) * s;
                for (int j = 0; j < 16; j++) y[r + 16 + j] = (float)((q[j] >> 4) - z) * s;
            }
        }
        y += L->group;
    }
}

/* ---- AVX-512 expansion: one run of 32 channels ----------------------------------------- */
#if HAS_AVX512
/* a (row, group)'s constants: int4, its 16 values (fp32 and, duplicated to 32 words, bf16);
 * int8, the scale and -zero * scale (exact: 8 bits times 11) */
typedef struct {
    __m512 lut, s, c;
    __m512i lutw;
} gconst_t;

/* groups [g0, g0 + count) of row o (count <= 16): their scales and -zero * scale */
static inline void group_block(const layout_t *L, int64_t o, int64_t g0, int count, float *s,
                               float *c) {
    const __mmask16 m = (__mmask16)((1u << count) - 1);
    const int64_t at = o * L->groups + g0;
    const __m512 sv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, L->s + 2 * at));
    const __m512 zv = L->z ? _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                 _mm_maskz_loadu_epi8(m, L->z + at)))
                           : _mm512_set1_ps(L->bits == 8 ? 128.0f : 8.0f);
    _mm512_storeu_ps(s, sv);
    _mm512_storeu_ps(c, _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(zv, sv)));
}

static inline __attribute__((always_inline)) gconst_t
group_consts(float s, float c, const int BITS, const int WORDS) {
    gconst_t k;
    if (BITS == 4) { /* q s - zero s: both terms and the sum exact */
        const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        k.lut = _mm512_fmadd_ps(codes, _mm512_set1_ps(s), _mm512_set1_ps(c));
#if HAS_BF16DOT
        if (WORDS) /* the 16 values twice */
            k.lutw = (__m512i)_mm512_cvtne2ps_pbh(k.lut, k.lut);
#endif
    } else {
        k.s = _mm512_set1_ps(s);
        k.c = _mm512_set1_ps(c);
    }
    (void)WORDS;
    return k;
}

/* channels [i, i + 32) of a row (q its codes) as fp32: w[0] the first 16, w[1] the rest */
static inline __attribute__((always_inline)) void
run_f32(const uint8_t *q, int64_t i, const gconst_t *k, const int BITS, __m512 w[2]) {
    if (BITS == 4) { /* vpermps takes the low 4 bits of each index: the low nibble */
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + i / 2)));
        w[0] = _mm512_permutexvar_ps(b, k->lut);
        w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), k->lut);
    } else {
        for (int h = 0; h < 2; h++) {
            const __m128i b = _mm_loadu_si128((const __m128i *)(q + i + 16 * h));
            w[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)), k->s, k->c);
        }
    }
}

#if HAS_BF16DOT
/* The bf16 product takes each int4 run's channels in the order four shifts of its 16 bytes
 * give them (word p of the vector: channel PERM4[p]); x is permuted to match, once per
 * call, and the sums run in that order on every path. */
static const uint16_t PERM4[32] = {0,  2,  4,  6,  8,  10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                                   1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};

static inline __m512i perm4(void) { return _mm512_loadu_si512(PERM4); }

/* the same 32 channels as bf16, nearest even; int4 in PERM4's order */
static inline __attribute__((always_inline)) __m512bh
run_bf16(const uint8_t *q, int64_t i, const gconst_t *k, const int BITS) {
    if (BITS == 4) {
        /* the run's 16 bytes in each 128-bit lane, as 8 words (bytes 2m, 2m + 1); lane L's
         * words shifted by 4L bring byte 2m's low and high nibble, then byte 2m + 1's, to
         * the bottom; vpermw takes the low 5 bits of each index and the table repeats its
         * 16 values, so the bits above a nibble do not matter */
        const __m512i shifts = _mm512_set_epi64(
            0x000c000c000c000c, 0x000c000c000c000c, 0x0008000800080008, 0x0008000800080008,
            0x0004000400040004, 0x0004000400040004, 0, 0);
        const __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(q + i / 2)));
        return (__m512bh)_mm512_permutexvar_epi16(_mm512_srlv_epi16(v, shifts), k->lutw);
    }
    __m512 w[2];
    run_f32(q, i, k, BITS, w);
    return _mm512_cvtne2ps_pbh(w[1], w[0]);
}
#endif

/* row o expanded into y: fp32, or bf16 for TO_BF16 (int4 runs in PERM4's order) */
static inline __attribute__((always_inline)) void
row_bits(const layout_t *L, int64_t o, void *y, const int BITS, const int TO_BF16) {
    const uint8_t *q = L->q + o * L->row_bytes;
    float s[16], c[16];
    for (int64_t g0 = 0, i = 0; g0 < L->groups; g0 += 16) {
        const int count = L->groups - g0 < 16 ? (int)(L->groups - g0) : 16;
        group_block(L, o, g0, count, s, c);
        for (int g = 0; g < count; g++) {
            const gconst_t k = group_consts(s[g], c[g], BITS, TO_BF16);
            for (const int64_t end = i + L->group; i < end; i += RUN) {
#if HAS_BF16DOT
                if (TO_BF16) {
                    _mm512_storeu_si512((uint16_t *)y + i, (__m512i)run_bf16(q, i, &k, BITS));
                    continue;
                }
#endif
                __m512 w[2];
                run_f32(q, i, &k, BITS, w);
                _mm512_storeu_ps((float *)y + i, w[0]);
                _mm512_storeu_ps((float *)y + i + 16, w[1]);
            }
        }
    }
}

#if HAS_BF16DOT
static void row_bf16(const layout_t *L, int64_t o, uint16_t *y) {
    if (L->bits == 4)
        row_bits(L, o, y, 4, 1);
    else
        row_bits(L, o, y, 8, 1);
}
#endif

static void row_avx512(const layout_t *L, int64_t o, float *y) {
    if (L->bits == 4)
        row_bits(L, o, y, 4, 0);
    else
        row_bits(L, o, y, 8, 0);
}
#define row_vector row_avx512
#endif

/* ---- AVX2 expansion ----------------------------------------------------------------- */
#if HAS_AVX2
/* 8 codes (the low 8 bytes of b) -> q s + c */
static inline __m256 eight(__m128i b, __m256 s, __m256 c) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), s, c);
}

static void row_avx2(const layout_t *L, int64_t o, float *y) {
    const uint8_t *q = L->q + o * L->row_bytes;
    const __m128i mask = _mm_set1_epi8(0xf);
    for (int64_t g = 0; g < L->groups; g++) {
        const float s = scale_of(L, o, g);
        const __m256 sv = _mm256_set1_ps(s), cv = _mm256_set1_ps(-(float)zero_of(L, o, g) * s);
        for (int r = 0; r < L->group; r += RUN, y += RUN) {
            if (L->bits == 8) {
                for (int h = 0; h < 2; h++, q += 16) {
                    const __m128i b = _mm_loadu_si128((const __m128i *)q);
                    _mm256_storeu_ps(y + 16 * h, eight(b, sv, cv));
                    _mm256_storeu_ps(y + 16 * h + 8, eight(_mm_srli_si128(b, 8), sv, cv));
                }
            } else {
                const __m128i b = _mm_loadu_si128((const __m128i *)q);
                const __m128i lo = _mm_and_si128(b, mask);
                const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
                _mm256_storeu_ps(y, eight(lo, sv, cv));
                _mm256_storeu_ps(y + 8, eight(_mm_srli_si128(lo, 8), sv, cv));
                _mm256_storeu_ps(y + 16, eight(hi, sv, cv));
                _mm256_storeu_ps(y + 24, eight(_mm_srli_si128(hi, 8), sv, cv));
                q += 16;
            }
        }
    }
}
#define row_vector row_avx2
#endif

typedef void (*row_fn)(const layout_t *, int64_t, float *);

static row_fn expander(int plain) {
#if HAS_AVX512 || HAS_AVX2
    return plain ? row_plain : row_vector;
#else
    (void)plain;
    return row_plain;
#endif
}

/* 1 fp32 x, 2 bf16 x, 4 AVX-512 expansion, 8 bf16 x by vdpbf16ps; 0 for other bits */
int quant_group_available(int bits) {
    if (bits != 4 && bits != 8) return 0;
    return 1 | 2 | (HAS_AVX512 ? 4 : 0) | (HAS_BF16DOT ? 8 : 0);
}

/* ---- the product ---------------------------------------------------------------------- */

/* Rows [first, first + ncols) expanded into `scratch` (NR rows k apart): fp32, rounded to
 * bf16 precision for F32_ROUNDED, or bf16 for BF16 (through `tmp`, one fp32 row). */
static inline __attribute__((always_inline)) void
expand_group(const layout_t *L, row_fn expand, int64_t first, int ncols, void *scratch,
             float *tmp, const int MODE) {
    const int64_t k = L->k;
    for (int j = 0; j < ncols; j++) {
#if HAS_BF16DOT
        if (MODE == BF16) {
            uint16_t *dst = (uint16_t *)scratch + j * k;
            if (expand != row_plain) {
                row_bf16(L, first + j, dst);
                continue;
            }
            expand(L, first + j, tmp); /* channel order: rounded, then int4 permuted */
            for (int64_t i = 0; i < k; i += RUN) {
                const __m512i w = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(tmp + i + 16),
                                                               _mm512_loadu_ps(tmp + i));
                _mm512_storeu_si512(dst + i, L->bits == 4 ? _mm512_permutexvar_epi16(perm4(), w)
                                                          : w);
            }
            continue;
        }
#endif
        float *dst = (float *)scratch + j * k;
        expand(L, first + j, dst);
        if (MODE == F32_ROUNDED) /* finite weights: nearest even to 8 significant bits */
            for (int64_t i = 0; i < k; i++) {
                uint32_t u;
                memcpy(&u, dst + i, 4);
                u = (u + 0x7fff + (u >> 16 & 1)) & 0xffff0000u;
                memcpy(dst + i, &u, 4);
            }
    }
    (void)tmp;
}

#if HAS_AVX512
/* channels [i, i + 32) of the NR rows (codes q, group constants k) into the sums c of R x
 * rows */
static inline __attribute__((always_inline)) void
direct_run(const uint8_t *const q[NR], int64_t i, const gconst_t k[NR], const void *x,
           int64_t ldx, vf c[DIRECT_ROWS][NR], const int R, const int BITS, const int MODE) {
#if HAS_BF16DOT
    if (MODE == BF16) {
        __m512bh a[DIRECT_ROWS];
        for (int r = 0; r < R; r++)
            a[r] = (__m512bh)_mm512_loadu_si512((const uint16_t *)x + r * ldx + i);
        for (int j = 0; j < NR; j++) {
            const __m512bh w = run_bf16(q[j], i, &k[j], BITS);
            for (int r = 0; r < R; r++) c[r][j] = (vf)_mm512_dpbf16_ps((__m512)c[r][j], a[r], w);
        }
        return;
    }
#endif
    for (int j = 0; j < NR; j++) {
        __m512 w[2];
        run_f32(q[j], i, &k[j], BITS, w);
        if (MODE == F32_ROUNDED)
            w[0] = (__m512)round_bf16((vf)w[0]), w[1] = (__m512)round_bf16((vf)w[1]);
        for (int r = 0; r < R; r++) {
            const float *xr = (const float *)x + r * ldx + i;
            c[r][j] = fmav(c[r][j], loadv(xr), (vf)w[0]);
            c[r][j] = fmav(c[r][j], loadv(xr + 16), (vf)w[1]);
        }
    }
}

/* Decode: R (<= DIRECT_ROWS) rows of x against weight rows [first, first + ncols), each run
 * of 32 channels of the NR rows expanded in registers and multiplied at once. The same
 * sums in the same order as expand_group + micro. */
static inline __attribute__((always_inline)) void
direct(const layout_t *L, int64_t first, int ncols, const void *x, int64_t ldx, void *out,
       int64_t ldo, const int R, const int BITS, const int MODE) {
    direct_t d;
    direct_begin(L, first, ncols, R, &d);
    float s[NR][16], cz[NR][16]; /* 16 groups' scales and -zero * scale, per row */
    for (int64_t g0 = 0, i = 0; g0 < L->groups; g0 += 16) {
        const int count = L->groups - g0 < 16 ? (int)(L->groups - g0) : 16;
        for (int j = 0; j < NR; j++) group_block(L, d.o[j], g0, count, s[j], cz[j]);
        for (int g = 0; g < count; g++) {
            gconst_t k[NR];
            for (int j = 0; j < NR; j++)
                k[j] = group_consts(s[j][g], cz[j][g], BITS, MODE == BF16);
            for (const int64_t end = i + L->group; i < end; i += RUN) {
                /* each new 64-byte line of codes: the same line of the next NR rows asked
                 * for (1.2-1.6x from memory at one row, measured; the hardware's
                 * prefetcher keeps too little ahead of four interleaved streams) */
                if (i % (512 / BITS) == 0)
                    for (int j = 0; j < NR; j++)
                        _mm_prefetch((const char *)d.q[j] + i * BITS / 8 + NR * L->row_bytes,
                                     _MM_HINT_T0);
                direct_run(d.q, i, k, x, ldx, d.c, R, BITS, MODE);
            }
        }
    }
    const int64_t es = MODE == BF16 ? 2 : 4;
    for (int r = 0; r < R; r++)
        store_sums(d.c[r], (char *)out + r * ldo * es, ncols, MODE == BF16);
}

static inline __attribute__((always_inline)) void
direct_rows(const layout_t *L, int64_t first, int ncols, const void *x, int64_t rows,
            int64_t ldx, void *out, int64_t ldo, const int MODE) {
#define DIRECT(RR, B) direct(L, first, ncols, x, ldx, out, ldo, RR, B, MODE)
#define BOTH(RR) (L->bits == 4 ? DIRECT(RR, 4) : DIRECT(RR, 8))
    switch (rows) {
    case 4: BOTH(4); break;
    case 3: BOTH(3); break;
    case 2: BOTH(2); break;
    default: BOTH(1); break;
    }
#undef BOTH
#undef DIRECT
}
#endif

/* One call's operands, as each group of NR output rows needs them. */
typedef struct {
    const layout_t *L;
    row_fn expand;     /* into scratch */
    const void *x;     /* [rows, k], row stride ldx; fp32, or bf16 for MODE BF16 */
    void *out;         /* [rows, n], row stride ldo; x's dtype */
    int64_t rows, ldx, n, ldo;
    int in_registers;  /* decode: expand in registers, no scratch */
} call_t;

#if HAS_AVX2
/* Decode with AVX2: as the AVX-512 direct (the same sums as expand_group + micro), each run
 * expanded as row_avx2 expands it, into four ymm */
static inline __attribute__((always_inline)) void
direct(const layout_t *L, int64_t first, int ncols, const void *x, int64_t ldx, void *out,
       int64_t ldo, const int R, const int BITS, const int MODE) {
    direct_t d;
    direct_begin(L, first, ncols, R, &d);
    const __m128i mask = _mm_set1_epi8(0xf);
    for (int64_t g = 0, i = 0; g < L->groups; g++) {
        __m256 sv[NR], cv[NR];
        for (int j = 0; j < NR; j++) {
            const float sc = scale_of(L, d.o[j], g);
            sv[j] = _mm256_set1_ps(sc), cv[j] = _mm256_set1_ps(-(float)zero_of(L, d.o[j], g) * sc);
        }
        for (const int64_t end = i + L->group; i < end; i += RUN) {
            if (i % (512 / BITS) == 0) /* as the AVX-512 direct: the next rows' line */
                for (int j = 0; j < NR; j++)
                    _mm_prefetch((const char *)d.q[j] + i * BITS / 8 + NR * L->row_bytes,
                                 _MM_HINT_T0);
            for (int j = 0; j < NR; j++) {
                __m128i b[4]; /* 8 codes in the low bytes of each */
                if (BITS == 8) {
                    for (int h = 0; h < 4; h++)
                        b[h] = _mm_loadl_epi64((const __m128i *)(d.q[j] + i + 8 * h));
                } else {
                    const __m128i v = _mm_loadu_si128((const __m128i *)(d.q[j] + i / 2));
                    b[0] = _mm_and_si128(v, mask), b[2] = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
                    b[1] = _mm_srli_si128(b[0], 8), b[3] = _mm_srli_si128(b[2], 8);
                }
                for (int h = 0; h < 4; h++) {
                    __m256 w = eight(b[h], sv[j], cv[j]);
                    if (MODE == F32_ROUNDED) w = (__m256)round_bf16((vf)w);
                    for (int r = 0; r < R; r++)
                        d.c[r][j] = fmav(d.c[r][j], loadv((const float *)x + r * ldx + i + 8 * h),
                                       (vf)w);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        store_sums(d.c[r], (char *)out + r * ldo * 4, ncols, 0);
}

static inline __attribute__((always_inline)) void
direct_rows(const layout_t *L, int64_t first, int ncols, const void *x, int64_t rows,
            int64_t ldx, void *out, int64_t ldo, const int MODE) {
    if (rows == 2)
        L->bits == 4 ? direct(L, first, ncols, x, ldx, out, ldo, 2, 4, MODE)
                     : direct(L, first, ncols, x, ldx, out, ldo, 2, 8, MODE);
    else
        L->bits == 4 ? direct(L, first, ncols, x, ldx, out, ldo, 1, 4, MODE)
                     : direct(L, first, ncols, x, ldx, out, ldo, 1, 8, MODE);
}
#endif

/* output rows [g NR, g NR + NR) of the call; `scratch`: NR expanded rows, then one fp32 row */
static inline __attribute__((always_inline)) void
one_group(const call_t *c, int64_t g, char *scratch, int64_t scratch_bytes, const int MODE) {
    const int64_t first = g * NR, es = MODE == BF16 ? 2 : 4;
    const int ncols = c->n - first < NR ? (int)(c->n - first) : NR;
    char *o = (char *)c->out + first * es;
#if HAS_AVX512 || HAS_AVX2
    if (c->in_registers) {
        direct_rows(c->L, first, ncols, c->x, c->rows, c->ldx, o, c->ldo, MODE);
        return;
    }
#endif
    expand_group(c->L, c->expand, first, ncols, scratch, (float *)(scratch + scratch_bytes),
                 MODE);
    rows_against(c->x, c->rows, c->ldx, scratch, c->L->k, o, c->ldo, ncols, MODE == BF16);
}

/* one function per mode: the parallel region's body is compiled apart from its caller, and
 * the mode must be a constant inside the loops */
typedef void (*group_fn)(const call_t *, int64_t, char *, int64_t);
static void group_f32(const call_t *c, int64_t g, char *scratch, int64_t bytes) {
    one_group(c, g, scratch, bytes, F32);
}
static void group_f32_rounded(const call_t *c, int64_t g, char *scratch, int64_t bytes) {
    one_group(c, g, scratch, bytes, F32_ROUNDED);
}
#if HAS_BF16DOT
static void group_bf16(const call_t *c, int64_t g, char *scratch, int64_t bytes) {
    one_group(c, g, scratch, bytes, BF16);
}
#endif

/* x [rows, k] against the codes -> out, threads splitting the groups of NR output rows. */
static int product(const layout_t *L, const void *x, int64_t rows, int64_t ldx, int64_t n,
                   void *out, int64_t ldo, int num_threads, int plain, const int MODE) {
    call_t c = {L, expander(plain), x, out, rows, ldx, n, ldo, !plain && rows <= DIRECT_ROWS};
    group_fn task = MODE == F32 ? group_f32 : group_f32_rounded;
#if HAS_BF16DOT
    if (MODE == BF16) task = group_bf16;
#endif
    const int64_t k = L->k, groups = (n + NR - 1) / NR, es = MODE == BF16 ? 2 : 4;
    const int64_t scratch_bytes = (NR * k * es + 63) / 64 * 64, tmp_bytes = (k * 4 + 63) / 64 * 64;
    int failed = 0;
#if HAS_BF16DOT
    uint16_t *xp = 0; /* int4: x in PERM4's order */
    if (MODE == BF16 && L->bits == 4) {
        if (!(xp = malloc((size_t)rows * k * 2))) return -1;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < k; i += RUN)
                _mm512_storeu_si512(xp + r * k + i, _mm512_permutexvar_epi16(
                    perm4(), _mm512_loadu_si512((const uint16_t *)x + r * ldx + i)));
        c.x = xp, c.ldx = k;
    }
#endif
    _Pragma("omp parallel num_threads(num_threads) reduction(|:failed)")
    {
        /* NR expanded rows (zeroed: a last group's unused rows hold finite values), and
         * for bf16 one fp32 row */
        char *scratch = 0;
        if (!c.in_registers) {
            scratch = aligned_alloc(64, scratch_bytes + (MODE == BF16 ? tmp_bytes : 0));
            if (!scratch)
                failed = 1;
            else
                memset(scratch, 0, scratch_bytes);
        }
        _Pragma("omp for schedule(static)")
        for (int64_t g = 0; g < groups; g++)
            if (scratch || c.in_registers) task(&c, g, scratch, scratch_bytes);
        free(scratch);
    }
#if HAS_BF16DOT
    free(xp);
#endif
    return failed ? -1 : 0;
}

static int make_layout(layout_t *L, int bits, int group, const uint8_t *q, const uint16_t *s,
                       const uint8_t *z, int64_t k) {
    if ((bits != 4 && bits != 8) || (group != 32 && group != 64 && group != 128) || k <= 0 ||
        k % group)
        return -1;
    *L = (layout_t){bits, group, q, (const uint8_t *)s, z, k, k / group, k * bits / 8};
    return 0;
}

/* x [rows, k] fp32 (row stride ldx) . W^T -> out [rows, n] (row stride ldo); W the codes
 * q, scales s and zero points z (0: symmetric) of n rows. plain: the plain-C expansion
 * through the scratch (tests). Returns -1 for bits other than 4 / 8, a group size other
 * than 32 / 64 / 128, k not whole groups, rows > MAX_ROWS or no memory. */
int quant_group_f32(int bits, int group, const float *x, int64_t rows, int64_t ldx,
                    const uint8_t *q, const uint16_t *s, const uint8_t *z, int64_t n, int64_t k,
                    float *out, int64_t ldo, int num_threads, int plain) {
    layout_t L;
    if (make_layout(&L, bits, group, q, s, z, k) || rows > MAX_ROWS) return -1;
    if (rows <= 0 || n <= 0) return 0;
    return product(&L, x, rows, ldx, n, out, ldo, num_threads, plain, F32);
}

/* As quant_group_f32 for bf16 x and out, the sums rounded once to bf16; the weights as
 * bf16 rounds them (vdpbf16ps with AVX512_BF16, else x widened to fp32). */
int quant_group_bf16(int bits, int group, const uint16_t *x, int64_t rows, int64_t ldx,
                     const uint8_t *q, const uint16_t *s, const uint8_t *z, int64_t n,
                     int64_t k, uint16_t *out, int64_t ldo, int num_threads, int plain) {
    layout_t L;
    if (make_layout(&L, bits, group, q, s, z, k) || rows > MAX_ROWS) return -1;
    if (rows <= 0 || n <= 0) return 0;
#if HAS_BF16DOT
    return product(&L, x, rows, ldx, n, out, ldo, num_threads, plain, BF16);
#else
    float *xf = malloc((size_t)rows * k * 4), *of = malloc((size_t)rows * n * 4);
    int status = -1;
    if (xf && of) {
        widen_rows(x, rows, ldx, k, xf);
        status = product(&L, xf, rows, k, n, of, n, num_threads, plain, F32_ROUNDED);
        if (status == 0) round_rows(of, rows, n, out, ldo);
    }
    free(xf);
    free(of);
    return status;
#endif
}

/* The codes of n rows expanded to fp32 out [n, k] (plain: the plain-C expansion).
 * Returns -1 where quant_group_f32 would for the format. */
int quant_group_dequantize_f32(int bits, int group, const uint8_t *q, const uint16_t *s,
                               const uint8_t *z, int64_t n, int64_t k, float *out,
                               int num_threads, int plain) {
    layout_t L;
    if (make_layout(&L, bits, group, q, s, z, k)) return -1;
    const row_fn expand = expander(plain);
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")
    for (int64_t j = 0; j < n; j++) expand(&L, j, out + j * k);
    return 0;
}
