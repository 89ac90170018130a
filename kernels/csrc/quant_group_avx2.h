/* quant_group_vnni.c's int8 products on AVX2 (included there for builds without
 * AVX512_VNNI): the same numbers bit for bit, on ymm registers, as quant_avx2.h does for
 * GGUF blocks (NC = 8 columns a chunk; vpdpbusd as dot4's vpmaddubsw + vpmaddwd).
 *
 * No vpmaddubsw pair saturates, so each unit's integer sum is the VNNI form's exact one:
 *   - int4 codes (0..15) times x's codes (-127..127): |pair| <= 2 * 15 * 127 = 3810;
 *   - int8 codes (0..255) are taken as signed c - 128 (-128..127), the unsigned operand
 *     |c - 128| (0..128) and the signed one x * sign(c - 128): |pair| <= 2 * 128 * 127
 *     = 32512; the zero point's term becomes (128 - zero) * sum(q) (0 for symmetric
 *     weights), the same total as the VNNI form's c * q - zero * q. */

/* x quantized: per row k codes, per 32 values d and sum(q) * mult (symmetric weights:
 * mult = the zero point's whole term a sum, -8 for int4, 0 for int8; else 1) */
typedef struct {
    int8_t *q;
    float *d;
    int32_t *s;
    int64_t k;
    int32_t mult;
} xq_t;

/* one row: k bf16 values -> codes, d and mult * sum(q) per 32 */
static void quantize_row(const uint16_t *x, int64_t k, int8_t *q, float *d, int32_t *s,
                         int32_t mult) {
    for (int64_t u = 0; u < k / 32; u++, x += 32, q += 32) {
        int32_t sa, sb;
        d[u] = quantize_block32_avx2(x, q, &sa, &sb);
        s[u] = mult * (sa + sb);
    }
}

/* One 32-channel unit of NC = 8 columns: q[i] holds channels 4i..4i+3 of every column
 * (column c in dword c; int4: unsigned codes, int8: the codes - 128, signed) */
typedef struct {
    __m256i q[8];
} unit_t;

/* A chunk's group constants: per group, each column's fp32 scale and its integer sums'
 * zero-point factor (int4: -zero; int8: 128 - zero) */
typedef struct {
    __m256 s;
    __m256i z;
} gconst_t;

/* unit `unit` of the 8 columns (col: each column's codes) */
static inline __attribute__((always_inline)) void
expand(const int BITS, const uint8_t *const col[NC], int64_t unit, unit_t *u) {
    __m256i T[4], U[4];
    if (BITS == 8) {
        const __m256i flip = _mm256_set1_epi8((char)0x80);
        t8(col, 32 * unit, T);
        t8(col, 32 * unit + 16, U);
        for (int i = 0; i < 4; i++)
            u->q[i] = _mm256_xor_si256(T[i], flip), u->q[4 + i] = _mm256_xor_si256(U[i], flip);
    } else { /* low nibbles: channels 0..15, high: 16..31 */
        const __m256i mask = _mm256_set1_epi8(0xf);
        t8(col, 16 * unit, T);
        for (int i = 0; i < 4; i++)
            u->q[i] = _mm256_and_si256(T[i], mask),
            u->q[4 + i] = _mm256_and_si256(_mm256_srli_epi32(T[i], 4), mask);
    }
}

/* the chunk's columns' scales (fp32) and zero-point factors, group by group */
static void group_consts(const int BITS, const uint16_t *scales, const uint8_t *zeros, int zero,
                         int64_t groups, const int64_t row[NC], gconst_t *gc) {
    for (int64_t g = 0; g < groups; g++) {
        uint16_t h[NC];
        int32_t z[NC];
        for (int c = 0; c < NC; c++) {
            h[c] = scales[row[c] * groups + g];
            z[c] = (BITS == 8 ? 128 : 0) - (zeros ? zeros[row[c] * groups + g] : zero);
        }
        gc[g].s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
        gc[g].z = _mm256_loadu_si256((const __m256i *)z);
    }
}

/* one row's unit against the 8 columns: quant_group_vnni.c's unit_dot */
static inline __attribute__((always_inline)) __m256
unit_dot(const int BITS, const int SYM, const unit_t *u, const gconst_t *gc, const xq_t *xq,
         int64_t row, int64_t unit, __m256 acc) {
    const int64_t at = row * (xq->k / 32) + unit;
    const int8_t *q = xq->q + row * xq->k + unit * 32;
    __m256i i0 = SYM ? _mm256_set1_epi32(xq->s[at])
                     : _mm256_mullo_epi32(gc->z, _mm256_set1_epi32(xq->s[at]));
    __m256i i1 = _mm256_setzero_si256();
    for (int i = 0; i < 8; i += 2) {
        const __m256i x0 = bcast32(q + 4 * i), x1 = bcast32(q + 4 * i + 4);
        if (BITS == 8) {
            i0 = dot4(i0, _mm256_abs_epi8(u->q[i]), _mm256_sign_epi8(x0, u->q[i]));
            i1 = dot4(i1, _mm256_abs_epi8(u->q[i + 1]), _mm256_sign_epi8(x1, u->q[i + 1]));
        } else {
            i0 = dot4(i0, u->q[i], x0);
            i1 = dot4(i1, u->q[i + 1], x1);
        }
    }
    const __m256 sd = _mm256_mul_ps(gc->s, _mm256_set1_ps(xq->d[at]));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(i0, i1)), sd, acc);
}

/* Rows [0, R) against the chunk, each unit expanded in registers as it comes */
static inline __attribute__((always_inline)) void
micro_direct(const int BITS, const int SYM, const int R, const xq_t *xq, const uint8_t *const col[NC],
             const gconst_t *gc, int64_t upg, int64_t row_bytes, uint16_t *out, int64_t ldo,
             int ncols) {
    __m256 acc[RMAX];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const char *next = (const char *)col[0] + NC * row_bytes; /* the next chunk's rows */
    const int64_t nu = xq->k / 32, ub = BITS * 4; /* bytes a unit of one column */
    for (int64_t unit = 0; unit < nu; unit++) {
        for (int64_t b = 0; b < NC * ub; b += 64) _mm_prefetch(next + unit * NC * ub + b, _MM_HINT_T0);
        unit_t u;
        expand(BITS, col, unit, &u);
        for (int r = 0; r < R; r++) acc[r] = unit_dot(BITS, SYM, &u, &gc[unit / upg], xq, r, unit, acc[r]);
    }
    for (int r = 0; r < R; r++) store_row(out + r * ldo, acc[r], ncols);
}

/* Rows [r0, r0 + R) against the chunk's units expanded beforehand */
static inline __attribute__((always_inline)) void
micro_units(const int BITS, const int SYM, const int R, const xq_t *xq, int64_t r0, const unit_t *units,
            const gconst_t *gc, int64_t upg, uint16_t *out, int64_t ldo, int ncols) {
    __m256 acc[RMAX];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const int64_t nu = xq->k / 32;
    for (int64_t unit = 0; unit < nu; unit++)
        for (int r = 0; r < R; r++)
            acc[r] = unit_dot(BITS, SYM, &units[unit], &gc[unit / upg], xq, r0 + r, unit, acc[r]);
    for (int r = 0; r < R; r++) store_row(out + r * ldo, acc[r], ncols);
}

/* every row of x against one chunk of 8 columns */
static inline __attribute__((always_inline)) void
chunk_rows(const int BITS, const int SYM, const xq_t *xq, int64_t rows, const uint8_t *const col[NC],
           const gconst_t *gc, int64_t upg, int64_t row_bytes, unit_t *units, uint16_t *out,
           int64_t ldo, int ncols) {
    int64_t r0 = 0;
    if (rows <= RMAX) {
#define DIRECT(R) micro_direct(BITS, SYM, R, xq, col, gc, upg, row_bytes, out, ldo, ncols)
        RMAX_CASES(rows - r0, DIRECT)
#undef DIRECT
        return;
    }
    const int64_t nu = xq->k / 32;
    const char *next = (const char *)col[0] + NC * row_bytes;
    for (int64_t unit = 0; unit < nu; unit++) {
        for (int64_t b = 0; b < NC * BITS * 4; b += 64)
            _mm_prefetch(next + unit * NC * BITS * 4 + b, _MM_HINT_T1);
        expand(BITS, col, unit, &units[unit]);
    }
    for (; r0 + RMAX <= rows; r0 += RMAX)
        micro_units(BITS, SYM, RMAX, xq, r0, units, gc, upg, out + r0 * ldo, ldo, ncols);
#define UNITS_(R) micro_units(BITS, SYM, R, xq, r0, units, gc, upg, out + r0 * ldo, ldo, ncols)
    RMAX_CASES(rows - r0, UNITS_)
#undef UNITS_
}

typedef struct {
    int bits, group;
    const uint8_t *q;
    const uint16_t *s;
    const uint8_t *z;
    int64_t n, k;
} weight_t;

static int all_chunks(const weight_t *W, const xq_t *xq, int64_t rows, uint16_t *out, int64_t ldo) {
    const int64_t row_bytes = W->k * W->bits / 8, chunks = (W->n + NC - 1) / NC;
    const int64_t groups = W->k / W->group, upg = W->group / 32;
    const size_t unit_bytes = rows > RMAX ? (size_t)(W->k / 32) * sizeof(unit_t) : 0;
    char *mem = aligned_alloc(64, unit_bytes + (size_t)groups * sizeof(gconst_t) + 64);
    const int failed = !mem; /* still takes part in the omp for */
    unit_t *units = (unit_t *)mem;
    gconst_t *gc = (gconst_t *)(mem + unit_bytes);
    _Pragma("omp for schedule(static) nowait") /* the parallel region's end waits */
    for (int64_t ch = 0; ch < chunks; ch++) {
        if (failed) continue;
        const int64_t first = ch * NC;
        const int ncols = W->n - first < NC ? (int)(W->n - first) : NC;
        const uint8_t *col[NC];
        int64_t row[NC];
        for (int c = 0; c < NC; c++) { /* a last chunk's missing columns repeat its last one */
            row[c] = first + (c < ncols ? c : ncols - 1);
            col[c] = W->q + row[c] * row_bytes;
        }
        if (W->bits == 8) group_consts(8, W->s, W->z, 128, groups, row, gc);
        else group_consts(4, W->s, W->z, 8, groups, row, gc);
        uint16_t *o = out + first;
#define CHUNK(B, S) chunk_rows(B, S, xq, rows, col, gc, upg, row_bytes, units, o, ldo, ncols)
        if (W->bits == 8)
            W->z ? CHUNK(8, 0) : CHUNK(8, 1);
        else
            W->z ? CHUNK(4, 0) : CHUNK(4, 1);
#undef CHUNK
    }
    free(mem);
    return failed;
}
