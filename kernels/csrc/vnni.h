/* What the int8-product kernels (quant_vnni.c: GGUF blocks, quant_group_vnni.c: group
 * codes) share: the AVX512_VNNI feature test, the chunking (NC output columns a chunk, one
 * a dword lane; RMAX rows of x a micro-kernel call), the quantization of a block of 32
 * bf16 activations, the transpose of 16 columns' bytes, and the bf16 stores.
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
#define NC 16  /* columns per chunk: one a dword lane */

/* 32 bf16 values -> their codes in q[32] and (as int32) in *lo, *hi; returns d */
static inline float quantize_block32(const uint16_t *x, int8_t *q, __m512i *lo, __m512i *hi) {
    const __m512i raw = _mm512_loadu_si512(x);
    const __m512 a = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw)), 16));
    const __m512 b = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1)), 16));
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    /* a division (divss): -ffast-math would otherwise multiply by 1 / 127 */
    const float d = _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(amax), _mm_set_ss(127.0f)));
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    *lo = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id)));
    *hi = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(id)));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(*lo));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(*hi));
    return d;
}

/* T[i] dword c = the 4 bytes at col[c] + off + 4 i: 16 columns' 16 bytes transposed */
static inline void t16(const uint8_t *const col[NC], int64_t off, __m512i T[4]) {
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

static inline __m512i bcast32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

static inline void store_row(uint16_t *out, __m512 acc, int ncols) {
    _mm256_mask_storeu_epi16(out, (__mmask16)((1u << ncols) - 1), to_bf16x16(acc));
}
#elif HAS_AVX2_Q8
#define NC 8 /* columns per chunk: one a dword lane of a ymm */

/* 8 int32 (each within int8) -> 8 bytes, in order */
static inline __m128i narrow8(__m256i v) {
    const __m256i w = _mm256_packs_epi32(v, v); /* lane l: v's 4 l.. twice */
    const __m256i b = _mm256_packs_epi16(w, w);
    return _mm_unpacklo_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
}

/* 32 bf16 values -> their codes in q[32] and the sums of the codes 0..15 (*sa) and
 * 16..31 (*sb); returns d: quantize_block32's numbers on ymm registers */
static inline float quantize_block32_avx2(const uint16_t *x, int8_t *q, int32_t *sa, int32_t *sb) {
    __m256 f[4];
    for (int i = 0; i < 4; i++)
        f[i] = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(x + 8 * i))), 16));
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, f[0]), _mm256_andnot_ps(sign, f[1])),
                             _mm256_max_ps(_mm256_andnot_ps(sign, f[2]), _mm256_andnot_ps(sign, f[3])));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    /* a division (divss): -ffast-math would otherwise multiply by 1 / 127 */
    const float d = _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(amax), _mm_set_ss(127.0f)));
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    __m256i c[4];
    for (int i = 0; i < 4; i++) {
        c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(f[i], _mm256_set1_ps(id)));
        _mm_storel_epi64((__m128i *)(q + 8 * i), narrow8(c[i]));
    }
    for (int half = 0; half < 2; half++) {
        const __m256i s = _mm256_add_epi32(c[2 * half], c[2 * half + 1]);
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
        *(half ? sb : sa) = _mm_cvtsi128_si32(t);
    }
    return d;
}

/* T[i] dword c = the 4 bytes at col[c] + off + 4 i: 8 columns' 16 bytes transposed */
static inline void t8(const uint8_t *const col[NC], int64_t off, __m256i T[4]) {
    __m256i z[4]; /* z[g]'s 128-bit lane l: column 4 l + g, so that T's dword c is column c */
    for (int g = 0; g < 4; g++)
        z[g] = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(col[g] + off))),
            _mm_loadu_si128((const __m128i *)(col[4 + g] + off)), 1);
    const __m256i a = _mm256_unpacklo_epi32(z[0], z[1]), b = _mm256_unpackhi_epi32(z[0], z[1]);
    const __m256i c = _mm256_unpacklo_epi32(z[2], z[3]), d = _mm256_unpackhi_epi32(z[2], z[3]);
    T[0] = _mm256_unpacklo_epi64(a, c), T[1] = _mm256_unpackhi_epi64(a, c);
    T[2] = _mm256_unpacklo_epi64(b, d), T[3] = _mm256_unpackhi_epi64(b, d);
}

/* the low 16 bits of each dword, in order (values < 2^16) */
static inline __m128i low16x8(__m256i v) {
    const __m256i w = _mm256_packus_epi32(v, v); /* lane l: dwords 4 l.. twice */
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(w, 0x08));
}

/* 8 floats -> bf16, nearest even (as torch rounds), NaN kept quiet: to_bf16x16's */
static inline __m128i to_bf16x8(__m256 f) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    return low16x8(_mm256_blendv_epi8(r, quiet, nan));
}

static inline __m256i bcast32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

static inline void store_row(uint16_t *out, __m256 acc, int ncols) {
    const __m128i v = to_bf16x8(acc);
    if (ncols == NC) {
        _mm_storeu_si128((__m128i *)out, v);
    } else {
        uint16_t tmp[NC];
        _mm_storeu_si128((__m128i *)tmp, v);
        memcpy(out, tmp, (size_t)ncols * 2);
    }
}

/* acc + the sums of 4 products, unsigned bytes of u times signed bytes of s, per dword
 * (vpdpbusd's): exact where no pair of products leaves int16 (|u| |s| <= 16383 a pair) */
static inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#endif

#endif /* FUSEGEN_KERNELS_VNNI_H */
