/* What the int8-product kernels (quant_vnni.c: GGUF blocks, quant_group_vnni.c: group
 * codes) share: the feature test, the chunking (NC output columns a chunk, one a dword
 * lane; RMAX rows of x a micro-kernel call), and a vector layer the kernels are written
 * against once: the types vi (int32 lanes) and vf (fp32 lanes), their operations, the
 * quantization of a block of 32 bf16 activations, the transpose of NC columns' bytes, the
 * int8 dot products and the bf16 stores. AVX512_VNNI builds take the zmm layer below (NC
 * = 16, vpdpbusd); AVX2 builds quant_avx2.h's ymm one (NC = 8, vpmaddubsw + vpmaddwd),
 * which gives the same bits.
 *
 * Activations, as llama.cpp's Q8_0: per 32 values d = amax / 127 (fp32, IEEE division),
 * q = round(x * (1 / d)) to the nearest, ties to even (vcvtps2dq), d = 0 giving q = 0. */
#ifndef FUSEGEN_KERNELS_VNNI_H
#define FUSEGEN_KERNELS_VNNI_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__) && defined(__F16C__)
#define HAS_VNNI 1
#define HAS_AVX2_Q8 0
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* AVX2 CPUs (and AVX-512 ones without VNNI): the same products on ymm registers,
 * vpmaddubsw + vpmaddwd in place of vpdpbusd (llama.cpp's AVX2 form) */
#define HAS_VNNI 0
#define HAS_AVX2_Q8 1
#include <immintrin.h>
#else
#define HAS_VNNI 0
#define HAS_AVX2_Q8 0
#endif

#if HAS_VNNI || HAS_AVX2_Q8
#define RMAX 4 /* rows of x per micro-kernel call (6 or 8 measured no faster) */
#define SERIAL_QUANTIZE 65536 /* values of x quantized by the calling thread alone */

/* CALL(R) with R the constant rows - r0 (1 .. RMAX), for micro-kernels specialised by R */
_Static_assert(RMAX == 4, "RMAX_CASES lists 1 .. 4");
#define RMAX_CASES(left, CALL)                                                              \
    switch ((int)(left)) {                                                                  \
    case 4: CALL(4); break;                                                                 \
    case 3: CALL(3); break;                                                                 \
    case 2: CALL(2); break;                                                                 \
    case 1: CALL(1); break;                                                                 \
    default: break;                                                                         \
    }

/* x's codes [rows, k] in one allocation, followed (64-byte aligned, at *tail) by
 * `per_unit` 4-byte values a row and 32 values (the scales and sums a kernel keeps); NULL
 * without memory. free() the codes. */
static inline int8_t *alloc_codes(int64_t rows, int64_t k, int per_unit, void **tail) {
    char *mem = malloc((size_t)(rows * k + rows * (k / 32) * 4 * per_unit + 64));
    if (mem) *tail = mem + (rows * k + 63) / 64 * 64;
    return (int8_t *)mem;
}

/* The body of an entry point: x quantized by QUANTIZE_ROWS(x, rows, ldx, &xq) (before
 * the threads start for decode-sized x: one barrier fewer a call), then ALL_CHUNKS (1 on
 * failure) on every thread; x's codes freed; -1 on failure, else 0. */
#define QUANTIZE_THEN_MULTIPLY(QUANTIZE_ROWS, xq, x, rows, ldx, k, num_threads, ALL_CHUNKS)  \
    do {                                                                                    \
        const int serial_ = (rows) * (k) <= SERIAL_QUANTIZE;                                \
        if (serial_) QUANTIZE_ROWS(x, rows, ldx, &(xq));                                    \
        int failed_ = 0;                                                                    \
        _Pragma("omp parallel num_threads(num_threads) reduction(|:failed_)")               \
        {                                                                                   \
            if (!serial_) QUANTIZE_ROWS(x, rows, ldx, &(xq)); /* its omp for's barrier */   \
            failed_ = (ALL_CHUNKS);                                                         \
        }                                                                                   \
        free((xq).q);                                                                       \
        return failed_ ? -1 : 0;                                                            \
    } while (0)
#endif

#if HAS_VNNI
#define NC 16 /* columns per chunk: one a dword lane of a zmm */
/* 8-bit weight codes are multiplied as unsigned bytes (vpdpbusd's): signed codes shifted
 * by +128, the offset folded into the integer sums */
#define CODES8_SIGNED 0
/* repacked blocks expand from their loads in a few operations: again for each RMAX rows
 * rather than through the per-thread scratch */
#define REPACKED_DIRECT 1

#define VW 512 /* the vector width, for vnni.h's plain operations: _mm512_* */
typedef __m512i vi;
typedef __m512 vf;

/* a 128-bit lane of dwords a, b, c, d (lowest first) in every lane */
static inline vi vi_lanes32(int32_t a, int32_t b, int32_t c, int32_t d) {
    return _mm512_set4_epi32(d, c, b, a);
}
static inline vf vf_load_fp16(const void *p) { /* NC fp16 values -> fp32 */
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* 32 bf16 values -> their codes in q[32] and the sums of the codes 0..15 (*sa) and
 * 16..31 (*sb); returns d */
static inline float quantize_block32(const uint16_t *x, int8_t *q, int32_t *sa, int32_t *sb) {
    const __m512i raw = _mm512_loadu_si512(x);
    const __m512 a = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw)), 16));
    const __m512 b = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1)), 16));
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    /* a division (divss): -ffast-math would otherwise multiply by 1 / 127 */
    const float d = _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(amax), _mm_set_ss(127.0f)));
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const __m512i lo = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id)));
    const __m512i hi = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(id)));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(lo));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(hi));
    *sa = _mm512_reduce_add_epi32(lo), *sb = _mm512_reduce_add_epi32(hi);
    return d;
}

/* T[i] dword c = the 4 bytes at col[c] + off + 4 i: NC columns' 16 bytes transposed */
static inline void transpose_cols(const uint8_t *const col[NC], int64_t off, vi T[4]) {
    __m512i z[4]; /* z[g]'s 128-bit lane l: column 4 l + g, so that T's dword c is column c */
    for (int g = 0; g < 4; g++) {
        z[g] = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(col[g] + off)));
        for (int l = 1; l < 4; l++)
            z[g] = _mm512_inserti32x4(
                z[g], _mm_loadu_si128((const __m128i *)(col[4 * l + g] + off)), l);
    }
    const __m512i a = _mm512_unpacklo_epi32(z[0], z[1]), b = _mm512_unpackhi_epi32(z[0], z[1]);
    const __m512i c = _mm512_unpacklo_epi32(z[2], z[3]), d = _mm512_unpackhi_epi32(z[2], z[3]);
    T[0] = _mm512_unpacklo_epi64(a, c), T[1] = _mm512_unpackhi_epi64(a, c);
    T[2] = _mm512_unpacklo_epi64(b, d), T[3] = _mm512_unpackhi_epi64(b, d);
}

/* the 4 bytes at col[c] + off, dword c (vindex: each column's offset from col[0]) */
static inline vi gather(const uint8_t *const col[NC], vi vindex, int64_t off) {
    return _mm512_i32gather_epi32(vindex, (const void *)(col[0] + off), 1);
}

/* fp16 in the low (high = 0) or high half of each dword -> fp32 */
static inline vf halves(vi v, const int high) {
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(high ? _mm512_srli_epi32(v, 16) : v));
}

/* q + 16 in the bytes where v has `bit` (one set bit a byte) set */
static inline vi add16_where(vi q, vi v, vi bit) {
    return _mm512_mask_add_epi8(q, _mm512_test_epi8_mask(v, bit), q, _mm512_set1_epi8(16));
}

/* acc + the sums of 4 products, unsigned bytes of u times signed bytes of s, per dword */
static inline vi dot4(vi acc, vi u, vi s) { return _mm512_dpbusd_epi32(acc, u, s); }
/* dot4 with 8-bit weight codes w (unsigned here: CODES8_SIGNED) */
static inline vi dot8(vi acc, vi w, vi s) { return _mm512_dpbusd_epi32(acc, w, s); }
/* dot4 against the dword of x's codes at p in every lane: the broadcast folded into
 * vpdpbusd's memory operand ({1to16}), where the intrinsics give a vpbroadcastd apiece */
static inline vi dot4_at(vi acc, vi u, const int8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const int32_t *)p));
    return acc;
}
static inline vi dot8_at(vi acc, vi w, const int8_t *p) { return dot4_at(acc, w, p); }

/* 16 floats -> bf16, nearest even (as torch rounds), NaN kept quiet */
static inline __m256i to_bf16x16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

static inline vi bcast32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* the first ncols lanes of acc as bf16 */
static inline void store_row(uint16_t *out, vf acc, int ncols) {
    _mm256_mask_storeu_epi16(out, (__mmask16)((1u << ncols) - 1), to_bf16x16(acc));
}
#elif HAS_AVX2_Q8
#include "quant_avx2.h" /* the same layer on ymm registers */
#endif

#if HAS_VNNI || HAS_AVX2_Q8
/* The layer's plain operations, one intrinsic each: _mm512_* or _mm256_* by VW */
#define MM_(w, op) _mm##w##_##op
#define MM(w, op) MM_(w, op)
#define MMSI_(w, op) _mm##w##_##op##_si##w
#define MMSI(w, op) MMSI_(w, op)
static inline vi vi_zero(void) { return MMSI(VW, setzero)(); }
static inline vf vf_zero(void) { return MM(VW, setzero_ps)(); }
static inline vi vi_set8(char v) { return MM(VW, set1_epi8)(v); }
static inline vi vi_set32(int32_t v) { return MM(VW, set1_epi32)(v); }
static inline vf vf_set(float v) { return MM(VW, set1_ps)(v); }
static inline vi vi_load(const void *p) { return MMSI(VW, loadu)((const vi *)p); }
static inline vi vi_and(vi a, vi b) { return MMSI(VW, and)(a, b); }
static inline vi vi_or(vi a, vi b) { return MMSI(VW, or)(a, b); }
static inline vi vi_xor(vi a, vi b) { return MMSI(VW, xor)(a, b); }
static inline vi vi_add32(vi a, vi b) { return MM(VW, add_epi32)(a, b); }
static inline vi vi_mullo32(vi a, vi b) { return MM(VW, mullo_epi32)(a, b); }
static inline vi vi_srl32(vi v, int n) { return MM(VW, srli_epi32)(v, n); }
static inline vi vi_sll32(vi v, int n) { return MM(VW, slli_epi32)(v, n); }
static inline vi vi_sra32(vi v, int n) { return MM(VW, srai_epi32)(v, n); }
static inline vi vi_shuffle8(vi v, vi idx) { return MM(VW, shuffle_epi8)(v, idx); }
static inline vf vf_from_i32(vi v) { return MM(VW, cvtepi32_ps)(v); }
static inline vf vf_mul(vf a, vf b) { return MM(VW, mul_ps)(a, b); }
static inline vf vf_sub(vf a, vf b) { return MM(VW, sub_ps)(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return MM(VW, fmadd_ps)(a, b, c); }
#endif

#endif /* FUSEGEN_KERNELS_VNNI_H */
