/* quant_vnni.c's int8 products on AVX2 (included there for builds without AVX512_VNNI):
 * the same numbers bit for bit, on ymm registers.
 *
 * What differs from the AVX-512 form: a chunk is NC = 8 output columns (one a dword lane
 * of a ymm), and vpdpbusd is vpmaddubsw + vpmaddwd + vpaddd (dot4 in vnni.h, llama.cpp's
 * AVX2 form). vpmaddubsw sums two products of an unsigned and a signed byte in int16 with
 * saturation; no pair saturates here, so each block's integer sum is the exact one the
 * VNNI form takes:
 *   - 4-, 5- and 6-bit codes (0..63) times x's codes (-127..127): |pair| <= 2 * 63 * 127
 *     = 16002;
 *   - Q8_0's codes are signed (-128..127): the unsigned operand is |w| (0..128, vpabsb
 *     giving 0x80 = 128 for -128) and the signed one x * sign(w) (vpsignb, -127..127), so
 *     |pair| <= 2 * 128 * 127 = 32512 and no +128 offset is folded in.
 * The fp32 factors, their products and the fp32 multiply-adds are the VNNI form's, in
 * its order, for every element. */

/* x quantized: per row k codes, per 32 values d and d * sum(q), per 16 values sum(q) */
typedef struct {
    int8_t *q;
    float *d, *ds;
    int32_t *s16;
    int64_t k;
} xq_t;

/* one row: k bf16 values -> codes, d, d * sum, sums per 16 */
static void quantize_row(const uint16_t *x, int64_t k, int8_t *q, float *d, float *ds,
                         int32_t *s16) {
    for (int64_t u = 0; u < k / 32; u++, x += 32, q += 32) {
        int32_t sa, sb;
        const float dx = quantize_block32_avx2(x, q, &sa, &sb);
        d[u] = dx;
        ds[u] = dx * (float)(sa + sb);
        s16[2 * u] = sa, s16[2 * u + 1] = sb;
    }
}

/* One 32-value unit of NC = 8 columns: as quant_vnni.c's unit_t (Q8_0's codes signed) */
typedef struct {
    __m256i q[8];
    __m256 s, t;
} unit_t;

/* the 4 bytes at col[c] + off, dword c (vindex: each column's offset from col[0]) */
static inline __m256i gather(const uint8_t *const col[NC], __m256i vindex, int64_t off) {
    return _mm256_i32gather_epi32((const int *)(col[0] + off), vindex, 1);
}

/* fp16 in the low (high = 0) or high half of each dword -> fp32 */
static inline __m256 halves(__m256i v, const int high) {
    return _mm256_cvtph_ps(low16x8(high ? _mm256_srli_epi32(v, 16)
                                        : _mm256_and_si256(v, _mm256_set1_epi32(0xffff))));
}

static inline __m256i low4(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0xf)); }
static inline __m256i high4(__m256i v) { return low4(_mm256_srli_epi32(v, 4)); }

/* bytes of v where `bit` (one set bit a byte) is set: 16 added */
static inline __m256i add16_where(__m256i q, __m256i v, __m256i bit) {
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
    return _mm256_add_epi8(q, _mm256_and_si256(set, _mm256_set1_epi8(16)));
}

/* bits 4 i .. 4 i + 3 of each dword of qh as 16 added to the 4 bytes of q */
static inline __m256i fifth(__m256i q, __m256i qh, int i) {
    const __m256i spread = _mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0c0c0c0c,
                                             0, 0x04040404, 0x08080808, 0x0c0c0c0c);
    const __m256i bits = _mm256_shuffle_epi8(_mm256_srli_epi32(qh, 4 * i), spread);
    return add16_where(q, bits, _mm256_set1_epi32(0x08040201));
}

/* signed byte `b` of each dword -> fp32 */
static inline __m256 sbyte(__m256i v, int b) {
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * b), 24));
}

/* unsigned bits [shift, shift + width) of each dword */
static inline __m256i bits(__m256i v, int shift, int mask) {
    return _mm256_and_si256(_mm256_srli_epi32(v, shift), _mm256_set1_epi32(mask));
}

/* A repacked group of 16 rows (quant_vnni.c's words): this chunk is its half `half`
 * (rows 8 half ..), its lanes the second 32 bytes of each 64-byte word vector (16 bytes
 * of each fp16 field) for half 1. sb: the group's current block. */
static inline void words(const int RP, const int half, const uint8_t *const col[NC],
                         const uint8_t *sb, int64_t off, __m256i T[4]) {
    if (!RP) {
        t8(col, off, T);
        return;
    }
    for (int i = 0; i < 4; i++)
        T[i] = _mm256_loadu_si256((const __m256i *)(sb + 16 * off + 64 * i + 32 * half));
}

static inline __m256i word(const int RP, const int half, const uint8_t *const col[NC],
                           __m256i vindex, const uint8_t *sb, int64_t off) {
    return RP ? _mm256_loadu_si256((const __m256i *)(sb + 16 * off + 32 * half))
              : gather(col, vindex, off);
}

static inline __m256 fp16s(const int half, const uint8_t *sb, int64_t off) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 16 * off + 16 * half)));
}

/* Units per expansion step, steps per block, and the offset folded into the integer sums */
#define UNITS(QT) ((QT) == Q6_K ? 4 : (QT) == Q4_K || (QT) == Q5_K ? 2 : 1)
#define STEPS(QT) ((QT) == Q6_K ? 2 : (QT) == Q4_K || (QT) == Q5_K ? 4 : 1)
#define OFFSET(QT) ((QT) == Q4_0 ? 8 : (QT) == Q5_0 ? 16 : (QT) == Q6_K ? 32 : 0)
#define HAS_MIN(QT) ((QT) == Q4_1 || (QT) == Q5_1 || (QT) == Q4_K || (QT) == Q5_K)

/* Units [step * UNITS, (step + 1) * UNITS) of the 8 columns' blocks (col: each column's
 * current block): quant_vnni.c's expand */
static inline __attribute__((always_inline)) void
expand(const int QT, const int RP, const int half, const uint8_t *const col[NC], const uint8_t *sb,
       __m256i vindex, int step, unit_t *u) {
    __m256i T[4], U[4];
    if (QT == Q4_0 || QT == Q4_1 || QT == Q5_0 || QT == Q5_1) {
        const int qoff = QT == Q4_0 ? 2 : QT == Q4_1 ? 4 : QT == Q5_0 ? 6 : 8;
        words(RP, half, col, sb, qoff, T);
        for (int i = 0; i < 4; i++) u->q[i] = low4(T[i]), u->q[4 + i] = high4(T[i]);
        if (QT == Q5_0 || QT == Q5_1) {
            const __m256i qh = word(RP, half, col, vindex, sb, QT == Q5_0 ? 2 : 4);
            for (int i = 0; i < 8; i++) u->q[i] = fifth(u->q[i], qh, i);
        }
        if (RP) {
            u->s = fp16s(half, sb, 0);
            u->t = HAS_MIN(QT) ? fp16s(half, sb, 2) : _mm256_setzero_ps();
        } else {
            const __m256i g = gather(col, vindex, 0);
            u->s = halves(g, 0);
            u->t = HAS_MIN(QT) ? halves(g, 1) : _mm256_setzero_ps();
        }
    } else if (QT == Q8_0) {
        words(RP, half, col, sb, 2, T);
        words(RP, half, col, sb, 18, U);
        for (int i = 0; i < 4; i++) u->q[i] = T[i], u->q[4 + i] = U[i];
        u->s = RP ? fp16s(half, sb, 0) : halves(gather(col, vindex, 0), 0);
        u->t = _mm256_setzero_ps();
    } else if (QT == Q4_K || QT == Q5_K) { /* step: sub-blocks 2 step, 2 step + 1 */
        const int qoff = (QT == Q5_K ? 48 : 16) + 32 * step;
        words(RP, half, col, sb, qoff, T);
        words(RP, half, col, sb, qoff + 16, U);
        for (int i = 0; i < 4; i++) {
            u[0].q[i] = low4(T[i]), u[0].q[4 + i] = low4(U[i]);
            u[1].q[i] = high4(T[i]), u[1].q[4 + i] = high4(U[i]);
        }
        if (QT == Q5_K) {
            __m256i H[8];
            words(RP, half, col, sb, 16, H);
            words(RP, half, col, sb, 32, H + 4);
            for (int j = 0; j < 2; j++) {
                const __m256i bit = _mm256_set1_epi8((char)(1 << (2 * step + j)));
                for (int i = 0; i < 8; i++) u[j].q[i] = add16_where(u[j].q[i], H[i], bit);
            }
        }
        __m256 d, dmin;
        if (RP) {
            d = fp16s(half, sb, 0), dmin = fp16s(half, sb, 2);
        } else {
            const __m256i g = gather(col, vindex, 0);
            d = halves(g, 0), dmin = halves(g, 1);
        }
#define WORD(off) word(RP, half, col, vindex, sb, off)
        for (int j = 0; j < 2; j++) { /* sub-block 2 step + j's 6-bit scale and min */
            const int sub = 2 * step + j;
            __m256i sc, mn;
            if (sub < 4) {
                sc = bits(WORD(4), 8 * sub, 63);
                mn = bits(WORD(8), 8 * sub, 63);
            } else {
                const __m256i hi = WORD(12);
                sc = _mm256_or_si256(bits(hi, 8 * (sub - 4), 0xf),
                                     _mm256_slli_epi32(bits(WORD(4), 8 * (sub - 4) + 6, 3), 4));
                mn = _mm256_or_si256(bits(hi, 8 * (sub - 4) + 4, 0xf),
                                     _mm256_slli_epi32(bits(WORD(8), 8 * (sub - 4) + 6, 3), 4));
            }
#undef WORD
            u[j].s = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
            u[j].t = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(mn)));
        }
    } else { /* Q6_K, step: the half of 128 values; unit j its quarter j */
        __m256i L[16], H[8];
        for (int i = 0; i < 4; i++) words(RP, half, col, sb, 64 * step + 16 * i, L + 4 * i);
        words(RP, half, col, sb, 128 + 32 * step, H);
        words(RP, half, col, sb, 128 + 32 * step + 16, H + 4);
        const __m256 d = RP ? fp16s(half, sb, 208) : halves(gather(col, vindex, 206), 1);
        const __m256i sc[2] = {word(RP, half, col, vindex, sb, 192 + 8 * step),
                               word(RP, half, col, vindex, sb, 196 + 8 * step)};
        for (int j = 0; j < 4; j++) {
            for (int i = 0; i < 8; i++) { /* values 4 i.. of the quarter: ql bytes 32 (j & 1) + 4 i */
                const __m256i lo = L[4 * ((j & 1) * 2 + i / 4) + i % 4];
                const __m256i hb = _mm256_and_si256(_mm256_srli_epi32(H[i], 2 * j), _mm256_set1_epi8(3));
                u[j].q[i] = _mm256_or_si256(j >> 1 ? high4(lo) : low4(lo), _mm256_slli_epi32(hb, 4));
            }
            u[j].s = _mm256_mul_ps(d, sbyte(sc[j >> 1], (2 * j) & 3));
            u[j].t = _mm256_mul_ps(d, sbyte(sc[j >> 1], (2 * j + 1) & 3));
        }
    }
}

/* acc + 4 products a dword of the weight codes w and x's broadcast codes xb (Q8_0: w
 * signed, the sign moved onto x) */
static inline __m256i dot_codes(const int QT, __m256i acc, __m256i w, __m256i xb) {
    if (QT == Q8_0) return dot4(acc, _mm256_abs_epi8(w), _mm256_sign_epi8(xb, w));
    return dot4(acc, w, xb);
}

/* one row's unit against the 8 columns: quant_vnni.c's unit_dot */
static inline __attribute__((always_inline)) __m256
unit_dot(const int QT, const unit_t *u, const xq_t *xq, int64_t row, int64_t unit, __m256 acc) {
    const int64_t at = row * (xq->k / 32) + unit;
    const int8_t *q = xq->q + row * xq->k + unit * 32;
    const __m256 dx = _mm256_set1_ps(xq->d[at]);
    const int32_t sa = xq->s16[2 * at], sb = xq->s16[2 * at + 1];
    if (QT == Q6_K) { /* two 16-value halves, each its own scale */
        __m256i ia = _mm256_set1_epi32(-OFFSET(QT) * sa), ib = _mm256_set1_epi32(-OFFSET(QT) * sb);
        for (int i = 0; i < 4; i++) {
            ia = dot_codes(QT, ia, u->q[i], bcast32(q + 4 * i));
            ib = dot_codes(QT, ib, u->q[4 + i], bcast32(q + 16 + 4 * i));
        }
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), _mm256_mul_ps(u->s, dx), acc);
        return _mm256_fmadd_ps(_mm256_cvtepi32_ps(ib), _mm256_mul_ps(u->t, dx), acc);
    }
    __m256i i0 = OFFSET(QT) ? _mm256_set1_epi32(-OFFSET(QT) * (sa + sb)) : _mm256_setzero_si256();
    __m256i i1 = _mm256_setzero_si256();
    for (int i = 0; i < 8; i += 2) {
        i0 = dot_codes(QT, i0, u->q[i], bcast32(q + 4 * i));
        i1 = dot_codes(QT, i1, u->q[i + 1], bcast32(q + 4 * i + 4));
    }
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(i0, i1)), _mm256_mul_ps(u->s, dx), acc);
    if (HAS_MIN(QT)) acc = _mm256_fmadd_ps(u->t, _mm256_set1_ps(xq->ds[at]), acc);
    return acc;
}

/* Rows [r0, r0 + R) against the chunk, each block expanded in registers as it comes */
static inline __attribute__((always_inline)) void
micro_direct(const int QT, const int RP, const int R, const xq_t *xq, int64_t r0,
             const uint8_t *const col0[NC], const uint8_t *sb0, int half, __m256i vindex,
             int64_t nb, int bytes, uint16_t *out, int64_t ldo, int ncols) {
    const int US = UNITS(QT);
    __m256 acc[RMAX];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const char *next = (const char *)col0[0] + NC * nb * bytes; /* the next chunk's rows */
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *col[NC];
        for (int c = 0; c < NC; c++) col[c] = col0[c] + i * bytes;
        for (int64_t b = 0; b < NC * bytes; b += 64) _mm_prefetch(next + i * NC * bytes + b, _MM_HINT_T0);
        for (int step = 0; step < STEPS(QT); step++) {
            unit_t u[4];
            expand(QT, RP, half, col, sb0 + i * 2 * NC * bytes, vindex, step, u);
            for (int j = 0; j < US; j++)
                for (int r = 0; r < R; r++)
                    acc[r] = unit_dot(QT, &u[j], xq, r0 + r, (i * STEPS(QT) + step) * US + j, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) store_row(out + r * ldo, acc[r], ncols);
}

/* Rows [r0, r0 + R) against the chunk's units expanded beforehand (`units`, nu of them) */
static inline __attribute__((always_inline)) void
micro_units(const int QT, const int R, const xq_t *xq, int64_t r0, const unit_t *units, int64_t nu,
            uint16_t *out, int64_t ldo, int ncols) {
    __m256 acc[RMAX];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t unit = 0; unit < nu; unit++)
        for (int r = 0; r < R; r++) acc[r] = unit_dot(QT, &units[unit], xq, r0 + r, unit, acc[r]);
    for (int r = 0; r < R; r++) store_row(out + r * ldo, acc[r], ncols);
}

/* every row of x against one chunk of 8 columns: quant_vnni.c's chunk_rows (RP: the
 * chunk is half `half` of the repacked group at sb0) */
static inline __attribute__((always_inline)) void
chunk_rows(const int QT, const int RP, const xq_t *xq, int64_t rows, const uint8_t *const col[NC],
           const uint8_t *sb0, int half, __m256i vindex, int64_t nb, int bytes, unit_t *units,
           uint16_t *out, int64_t ldo, int ncols) {
    int64_t r0 = 0;
    /* repacked blocks too go through the scratch past RMAX rows: expanding them again for
     * each RMAX rows spills 16 ymm registers */
    if (rows <= RMAX) {
#define DIRECT(R) \
    micro_direct(QT, RP, R, xq, r0, col, sb0, half, vindex, nb, bytes, out + r0 * ldo, ldo, ncols)
        for (; r0 + RMAX <= rows; r0 += RMAX) DIRECT(RMAX);
        RMAX_CASES(rows - r0, DIRECT)
#undef DIRECT
        return;
    }
    const int US = UNITS(QT);
    const char *next = (const char *)col[0] + NC * nb * bytes;
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *c[NC];
        for (int j = 0; j < NC; j++) c[j] = col[j] + i * bytes;
        for (int64_t b = 0; b < NC * bytes; b += 64) _mm_prefetch(next + i * NC * bytes + b, _MM_HINT_T1);
        for (int step = 0; step < STEPS(QT); step++)
            expand(QT, RP, half, c, sb0 + i * 2 * NC * bytes, vindex, step,
                   units + (i * STEPS(QT) + step) * US);
    }
    const int64_t nu = xq->k / 32;
    for (; r0 + RMAX <= rows; r0 += RMAX)
        micro_units(QT, RMAX, xq, r0, units, nu, out + r0 * ldo, ldo, ncols);
#define UNITS_(R) micro_units(QT, R, xq, r0, units, nu, out + r0 * ldo, ldo, ncols)
    RMAX_CASES(rows - r0, UNITS_)
#undef UNITS_
}

/* packed: w's whole groups of 16 rows repacked (quant_gguf_q8_packed_bf16), two chunks a
 * group */
static int all_chunks(int qtype, int packed, const xq_t *xq, int64_t rows, const uint8_t *w,
                      int64_t n, int64_t nb, int bytes, uint16_t *out, int64_t ldo) {
    const int64_t row_bytes = nb * bytes, chunks = (n + NC - 1) / NC;
    unit_t *units = rows > RMAX ? aligned_alloc(64, (size_t)(xq->k / 32) * sizeof(unit_t)) : 0;
    const int failed = rows > RMAX && !units; /* still takes part in the omp for */
    _Pragma("omp for schedule(static) nowait") /* the parallel region's end waits */
    for (int64_t ch = 0; ch < chunks; ch++) {
        if (failed) continue;
        const int64_t first = ch * NC;
        const int ncols = n - first < NC ? (int)(n - first) : NC;
        const uint8_t *col[NC];
        int32_t offsets[NC];
        for (int c = 0; c < NC; c++) { /* a last chunk's missing columns repeat its last one */
            offsets[c] = (int32_t)((c < ncols ? c : ncols - 1) * row_bytes);
            col[c] = w + first * row_bytes + offsets[c];
        }
        const __m256i vindex = _mm256_loadu_si256((const __m256i *)offsets);
        uint16_t *o = out + first;
        const int64_t group = first / (2 * NC) * (2 * NC);
        const int rp = packed && group + 2 * NC <= n, half = (int)(first - group) / NC;
        const uint8_t *sb0 = w + group * row_bytes;
        switch (qtype * 2 + rp) {
#define TYPE(Q)                                                                            \
    case 2 * Q:                                                                            \
        chunk_rows(Q, 0, xq, rows, col, sb0, half, vindex, nb, bytes, units, o, ldo, ncols); \
        break;                                                                             \
    case 2 * Q + 1:                                                                        \
        chunk_rows(Q, 1, xq, rows, col, sb0, half, vindex, nb, bytes, units, o, ldo, ncols); \
        break;
        TYPE(Q4_0) TYPE(Q4_1) TYPE(Q5_0) TYPE(Q5_1) TYPE(Q8_0) TYPE(Q4_K) TYPE(Q5_K) TYPE(Q6_K)
#undef TYPE
        default: break;
        }
    }
    free(units);
    return failed;
}
