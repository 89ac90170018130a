/* vnni.h's vector layer on AVX2 (included there for builds without AVX512_VNNI): the same
 * operations on ymm registers, so that quant_vnni.c and quant_group_vnni.c give the same
 * bits on either.
 *
 * What differs from the AVX-512 layer: a chunk is NC = 8 output columns (one a dword lane
 * of a ymm), loads and transposes take 8 columns, and vpdpbusd is vpmaddubsw + vpmaddwd +
 * vpaddd (dot4, llama.cpp's AVX2 form). vpmaddubsw sums two products of an unsigned and a
 * signed byte in int16 with saturation; no pair saturates here, so each block's integer
 * sum is the exact one the VNNI form takes:
 *   - 4-, 5- and 6-bit codes (0..63) times x's codes (-127..127): |pair| <= 2 * 63 * 127
 *     = 16002;
 *   - 8-bit codes are multiplied signed (CODES8_SIGNED: GGUF Q8_0's as stored, group
 *     codes c as c - 128): the unsigned operand is |w| (0..128, vpabsb giving 0x80 = 128
 *     for -128) and the signed one x * sign(w) (vpsignb, -127..127), so |pair| <= 2 * 128
 *     * 127 = 32512, and the kernels fold in the offsets that go with signed codes.
 * The fp32 factors, their products and the fp32 multiply-adds are the VNNI form's, in its
 * order, for every element. */

#define NC 8 /* columns per chunk: one a dword lane of a ymm */
#define CODES8_SIGNED 1
/* repacked blocks past RMAX rows go through the per-thread scratch, as stored ones do:
 * expanding them again for each RMAX rows spills the 16 ymm registers */
#define REPACKED_DIRECT 0

#define VW 256 /* the vector width, for vnni.h's plain operations: _mm256_* */
typedef __m256i vi;
typedef __m256 vf;

/* a 128-bit lane of dwords a, b, c, d (lowest first) in both lanes */
static inline vi vi_lanes32(int32_t a, int32_t b, int32_t c, int32_t d) {
    return _mm256_setr_epi32(a, b, c, d, a, b, c, d);
}
static inline vf vf_load_fp16(const void *p) { /* NC fp16 values -> fp32 */
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* 8 int32 (each within int8) -> 8 bytes, in order */
static inline __m128i narrow8(__m256i v) {
    const __m256i w = _mm256_packs_epi32(v, v); /* lane l: v's 4 l.. twice */
    const __m256i b = _mm256_packs_epi16(w, w);
    return _mm_unpacklo_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
}

/* 32 bf16 values -> their codes in q[32] and the sums of the codes 0..15 (*sa) and
 * 16..31 (*sb); returns d: the AVX-512 layer's numbers */
static inline float quantize_block32(const uint16_t *x, int8_t *q, int32_t *sa, int32_t *sb) {
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

/* T[i] dword c = the 4 bytes at col[c] + off + 4 i: NC columns' 16 bytes transposed */
static inline void transpose_cols(const uint8_t *const col[NC], int64_t off, vi T[4]) {
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

/* the 4 bytes at col[c] + off, dword c (vindex: each column's offset from col[0]) */
static inline vi gather(const uint8_t *const col[NC], vi vindex, int64_t off) {
    return _mm256_i32gather_epi32((const int *)(col[0] + off), vindex, 1);
}

/* the low 16 bits of each dword, in order (values < 2^16) */
static inline __m128i low16x8(__m256i v) {
    const __m256i w = _mm256_packus_epi32(v, v); /* lane l: dwords 4 l.. twice */
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(w, 0x08));
}

/* fp16 in the low (high = 0) or high half of each dword -> fp32 */
static inline vf halves(vi v, const int high) {
    return _mm256_cvtph_ps(low16x8(high ? _mm256_srli_epi32(v, 16)
                                        : _mm256_and_si256(v, _mm256_set1_epi32(0xffff))));
}

/* q + 16 in the bytes where v has `bit` (one set bit a byte) set */
static inline vi add16_where(vi q, vi v, vi bit) {
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
    return _mm256_add_epi8(q, _mm256_and_si256(set, _mm256_set1_epi8(16)));
}

/* acc + the sums of 4 products, unsigned bytes of u times signed bytes of s, per dword
 * (vpdpbusd's): exact where no pair of products leaves int16 (|u| |s| <= 16383 a pair) */
static inline vi dot4(vi acc, vi u, vi s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
/* dot4 with 8-bit weight codes w (signed here: CODES8_SIGNED), the sign moved onto s */
static inline vi dot8(vi acc, vi w, vi s) {
    return dot4(acc, _mm256_abs_epi8(w), _mm256_sign_epi8(s, w));
}

/* dot4 / dot8 against the dword of x's codes at p in every lane */
static inline vi dot4_at(vi acc, vi u, const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return dot4(acc, u, _mm256_set1_epi32(v));
}
static inline vi dot8_at(vi acc, vi w, const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return dot8(acc, w, _mm256_set1_epi32(v));
}

/* 8 floats -> bf16, nearest even (as torch rounds), NaN kept quiet */
static inline __m128i to_bf16x8(__m256 f) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    return low16x8(_mm256_blendv_epi8(r, quiet, nan));
}

static inline vi bcast32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* the first ncols lanes of acc as bf16 */
static inline void store_row(uint16_t *out, vf acc, int ncols) {
    const __m128i v = to_bf16x8(acc);
    if (ncols == NC) {
        _mm_storeu_si128((__m128i *)out, v);
    } else {
        uint16_t tmp[NC];
        _mm_storeu_si128((__m128i *)tmp, v);
        memcpy(out, tmp, (size_t)ncols * 2);
    }
}
