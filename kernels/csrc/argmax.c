/* Row-wise argmax of fp32 or bf16 logits: the greedy sampler's token per row.
 *
 * torch's CPU argmax over [N, vocab] logits keeps an index beside every compared
 * value and does not vectorise that loop: 7-15 ms for 125 rows of 32000 on a 2-core
 * AVX2 machine. Two vectorised passes per row instead: the maximum (a plain max
 * reduction), then the first index holding it, which is torch's answer on ties.
 * Logits are finite (a NaN logit is a model fault, and -ffast-math drops NaN rules).
 * bf16 logits are compared as the fp32 values they widen to, exactly: the answer is
 * argmax_f32's over the widened rows, without writing them.
 */
#include <stdint.h>
#include <string.h>

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
        while (LOAD(row[at]) != best) at++;                                                 \
        out[r] = at;                                                                        \
    }                                                                                       \
}

#define AS_F32(v) (v)
DEFINE_ARGMAX(argmax_f32, float, AS_F32)
DEFINE_ARGMAX(argmax_bf16, uint16_t, widen)
