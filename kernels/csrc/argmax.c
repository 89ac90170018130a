/* Row-wise argmax of fp32 or bf16 logits: the greedy sampler's token per row.
 *
 * torch's CPU argmax over [N, vocab] logits keeps an index beside every compared
 * value and does not vectorise that loop, milliseconds a decode step at a 32,000-token
 * vocabulary. Two vectorised passes per row instead: the maximum (a plain max
 * reduction), then the first index holding it, which is torch's answer on ties.
 * Logits may be -inf (masked tokens; a row a constraint or a logits processor masks
 * whole), so this file keeps infinities out of -ffast-math's finite-math assumption,
 * under which the compiler may drop the comparison that finds "the first index holding
 * -inf", and the scan would run past the row. NaN is a model fault; the scan still stops at the row's last index.
 * bf16 logits are compared as the fp32 values they widen to, exactly: the answer is
 * argmax_f32's over the widened rows, without writing them. With AVX-512 BW, a bf16
 * row takes one pass over 16-bit keys that order as the values do (32 a vector, where
 * widening gives 16, and no second pass for the index).
 */
#pragma GCC optimize("no-finite-math-only")
#include <stdint.h>
#include <string.h>
#if defined(__AVX512BW__)
#include <immintrin.h>
#endif

static inline float widen(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* One definition per storage type; LOAD gives an element as fp32. */
#define DEFINE_ARGMAX(NAME, T, LOAD)                                                        \
void NAME(const T *x, int64_t *out, int64_t rows, int cols, int64_t stride,                 \
          int num_threads) {                                                                \
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")                   \
    for (int64_t r = 0; r < rows; r++) {                                                    \
        const T *row = x + r * stride;                                                      \
        float best = LOAD(row[0]);                                                          \
        _Pragma("omp simd reduction(max:best)")                                             \
        for (int i = 1; i < cols; i++) best = LOAD(row[i]) > best ? LOAD(row[i]) : best;   \
        int64_t at = 0;                                                                     \
        while (at < cols - 1 && LOAD(row[at]) != best) at++;                                \
        out[r] = at;                                                                        \
    }                                                                                       \
}

#define AS_F32(v) (v)
DEFINE_ARGMAX(argmax_f32, float, AS_F32)

#if defined(__AVX512BW__)
DEFINE_ARGMAX(argmax_bf16_widened, uint16_t, widen)  /* for rows past 2M columns */

/* bf16 bits as int16 keys in the order of their values: the magnitude, negated for a
 * negative sign, so that -0 and +0 tie as they compare equal and -inf is the least
 * value (-0x7f80; lanes past a row's end take INT16_MIN, below it). */
static inline __m512i bf16_keys(__m512i x) {
    const __m512i magnitude = _mm512_and_si512(x, _mm512_set1_epi16(0x7fff));
    const __m512i sign = _mm512_srai_epi16(x, 15);  /* 0 or -1 */
    return _mm512_sub_epi16(_mm512_xor_si512(magnitude, sign), sign);
}

/* One row: per lane the greatest key and the first 32-element chunk holding it, in two
 * interleaved sets (even and odd chunks) so that consecutive chunks do not wait on each
 * other; then the least index among the lanes holding the greatest key. */
static int64_t argmax_bf16_row(const uint16_t *row, int cols) {
    __m512i key[2], chunk[2];
    for (int e = 0; e < 2; e++) {
        key[e] = _mm512_set1_epi16(INT16_MIN);
        chunk[e] = _mm512_setzero_si512();
    }
    const int full = cols / 32;
    int c = 0;
    for (; c + 1 < full; c += 2)
        for (int e = 0; e < 2; e++) {
            const __m512i k = bf16_keys(_mm512_loadu_si512(row + 32 * (c + e)));
            const __mmask32 up = _mm512_cmpgt_epi16_mask(k, key[e]);
            key[e] = _mm512_mask_mov_epi16(key[e], up, k);
            chunk[e] = _mm512_mask_mov_epi16(chunk[e], up, _mm512_set1_epi16((short)(c + e)));
        }
    for (; c * 32 < cols; c++) {  /* an odd last chunk, then a partial one */
        const __mmask32 in = cols - 32 * c >= 32 ? 0xffffffffu : (1u << (cols - 32 * c)) - 1;
        const __m512i k = _mm512_mask_mov_epi16(_mm512_set1_epi16(INT16_MIN), in,
                                                bf16_keys(_mm512_maskz_loadu_epi16(in, row + 32 * c)));
        const __mmask32 up = _mm512_cmpgt_epi16_mask(k, key[0]);
        key[0] = _mm512_mask_mov_epi16(key[0], up, k);
        chunk[0] = _mm512_mask_mov_epi16(chunk[0], up, _mm512_set1_epi16((short)c));
    }
    int16_t keys[64], chunks[64];
    for (int e = 0; e < 2; e++) {
        _mm512_storeu_si512(keys + 32 * e, key[e]);
        _mm512_storeu_si512(chunks + 32 * e, chunk[e]);
    }
    int best = INT16_MIN;
    int64_t at = cols;
    for (int i = 0; i < 64; i++) {
        const int64_t index = (int64_t)(uint16_t)chunks[i] * 32 + i % 32;
        if (keys[i] > best || (keys[i] == best && index < at)) {
            best = keys[i];
            at = index;
        }
    }
    return at;
}

void argmax_bf16(const uint16_t *x, int64_t *out, int64_t rows, int cols, int64_t stride,
                 int num_threads) {
    if (cols > 32 * 65535) {  /* past the chunk counter's reach: no vocabulary is */
        argmax_bf16_widened(x, out, rows, cols, stride, num_threads);
        return;
    }
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_bf16_row(x + r * stride, cols);
}
#else
DEFINE_ARGMAX(argmax_bf16, uint16_t, widen)
#endif
