/* Row-wise operations for CPUs, each one pass over memory where torch makes several
 * (and allocates a temporary per pass): the residual add fused with RMSNorm,
 * SiLU(gate) * up, and rotary embedding in place. Rows are spread over OpenMP threads;
 * each row's inner loops are vectorised by the compiler.
 *
 * Two storage types share one algorithm per op: fp32, and bf16 (uint16_t bits) computed
 * in fp32 and rounded back to bf16 wherever the torch references (kernels/rms_norm.py,
 * silu_mul.py, rotary.py) round in the model dtype, so the bf16 outputs are theirs to
 * the bit and the engine's tokens do not change with the kernel. That takes torch's
 * exact operations in fp32 too: its order of summation, its exp (SLEEF's expf_u10, as
 * ATen's AVX2 / AVX-512 kernels call it), true division and square root, no fused
 * multiply-adds. The library is built with -ffast-math (native.py), which would allow
 * reassociation, reciprocal approximations and contraction, so this file opts out.
 */
#if defined(__clang__)
#pragma float_control(precise, on)
#pragma clang fp contract(off)
#else
#pragma GCC optimize("no-fast-math", "fp-contract=off", "no-math-errno", "no-trapping-math")
#endif
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef union { float f; uint32_t u; } f32_bits_t;

/* f rounded to bf16 (nearest, ties to even), as fp32 bits with the low half zero; a NaN
 * stays a quiet NaN. Integer arithmetic; f != f holds for NaN since the pragma above
 * takes this file out of -ffast-math. */
static inline uint32_t bf16_rounded_bits(float f) {
    const f32_bits_t b = {.f = f};
    const uint32_t nearest_even = b.u + 0x7fffu + ((b.u >> 16) & 1u);
    return (f != f ? b.u | 0x400000u : nearest_even) & 0xffff0000u;
}

static inline uint16_t f32_to_bf16(float f) { return (uint16_t)(bf16_rounded_bits(f) >> 16); }

static inline float bf16_to_f32(uint16_t h) {
    f32_bits_t b = {.u = (uint32_t)h << 16};
    return b.f;
}

/* Element access for both storage types; `bf16` is a literal at every call site, so
 * each inlined copy keeps one branch. */
static inline float load(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float v, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* v as the model dtype holds it: the rounding torch makes between two ops in bf16. */
static inline float in_dtype(float v, int bf16) {
    if (!bf16) return v;
    const f32_bits_t b = {.u = bf16_rounded_bits(v)};
    return b.f;
}

/* --- RMSNorm ------------------------------------------------------------------------ */

#define SUM_LEVELS 4
#define SUM_ILP 4
#define MAX_SUM_LANES 16

static int ceil_log2(int64_t x) {
    int r = 0;
    while (((int64_t)1 << r) < x) r++;
    return r;
}

/* sum(h[i]^2) in the order of ATen's cascade_sum over a contiguous row (SumKernel.cpp):
 * the row read as vectors of `lanes` floats, 4 vectors at a time into a 4-level cascade
 * of accumulators, the leftover vectors into the first, the 4 partial vectors added,
 * then the leftover scalars and the lanes one by one. Rows shorter than a vector are
 * summed the same way with 1-float vectors. */
static inline __attribute__((always_inline)) float
sum_squares_in(const void *h, int64_t n, int lanes, int bf16) {
    const int width = SUM_ILP * lanes;
    const int64_t num_vectors = n / lanes, num_steps = num_vectors / SUM_ILP;
    int power = ceil_log2(num_steps) / SUM_LEVELS; /* levels of 2^power steps, 16 at least */
    if (power < 4) power = 4;
    const int64_t level_step = (int64_t)1 << power, level_mask = level_step - 1;
    float acc[SUM_LEVELS][SUM_ILP * MAX_SUM_LANES];
    memset(acc, 0, sizeof acc);
    int64_t i = 0;
    while (i + level_step <= num_steps) {
        for (int64_t end = i + level_step; i < end; i++)
            for (int c = 0; c < width; c++) {
                const float v = load(h, i * width + c, bf16);
                acc[0][c] += v * v;
            }
        for (int l = 1; l < SUM_LEVELS; l++) {
            for (int c = 0; c < width; c++) {
                acc[l][c] += acc[l - 1][c];
                acc[l - 1][c] = 0.0f;
            }
            if (i & (level_mask << (l * power))) break;
        }
    }
    for (; i < num_steps; i++)
        for (int c = 0; c < width; c++) {
            const float v = load(h, i * width + c, bf16);
            acc[0][c] += v * v;
        }
    for (int l = 1; l < SUM_LEVELS; l++)
        for (int c = 0; c < width; c++) acc[0][c] += acc[l][c];
    for (int64_t e = num_steps * width; e < num_vectors * lanes; e++) {
        const float v = load(h, e, bf16);
        acc[0][e % lanes] += v * v;
    }
    float *partial = acc[0]; /* [SUM_ILP, lanes] -> [lanes] */
    for (int k = 1; k < SUM_ILP; k++)
        for (int c = 0; c < lanes; c++) partial[c] += partial[k * lanes + c];
    if (lanes == 1) return partial[0];
    float total = 0.0f;
    for (int64_t e = num_vectors * lanes; e < n; e++) {
        const float v = load(h, e, bf16);
        total += v * v;
    }
    for (int c = 0; c < lanes; c++) total += partial[c];
    return total;
}

/* The vector width as a constant in each copy, so the accumulators live in registers. */
static inline __attribute__((always_inline)) float
sum_squares(const void *h, int64_t n, int lanes, int bf16) {
    if (n < lanes) return sum_squares_in(h, n, 1, bf16);
    return lanes == 16 ? sum_squares_in(h, n, 16, bf16) : sum_squares_in(h, n, 8, bf16);
}

/* out = weight * (h * rsqrt(mean(h^2) + eps)) rounded to the dtype before the weight,
 * h = x (+ residual, rounded to the dtype and written to residual_out when residual is
 * not NULL). */
static inline __attribute__((always_inline)) void
rms_norm_row(const void *x, const void *residual, const void *weight, void *out,
             void *residual_out, int hidden, float eps, int sum_lanes, int bf16) {
    const void *h = x;
    if (residual) {
        for (int i = 0; i < hidden; i++)
            store(residual_out, i, load(x, i, bf16) + load(residual, i, bf16), bf16);
        h = residual_out;
    }
    const float mean = sum_squares(h, hidden, sum_lanes, bf16) / (float)hidden;
    const float inv = 1.0f / sqrtf(mean + eps);
    for (int i = 0; i < hidden; i++)
        store(out, i, load(weight, i, bf16) * in_dtype(load(h, i, bf16) * inv, bf16), bf16);
}

/* --- SiLU-mul ----------------------------------------------------------------------- */

static inline float pow2i(int32_t q) {
    f32_bits_t b = {.u = (uint32_t)(q + 0x7f) << 23};
    return b.f;
}

/* SLEEF's expf_u10 (FMA form, as in ATen's Vectorized<float>::exp on AVX2 / AVX-512),
 * step for step: silu's results are then torch's to the bit. */
static inline float sleef_expf(float d) {
    const int32_t q = (int32_t)rintf(d * 1.442695040888963407359924681001892137f);
    float s = fmaf((float)q, -0.693145751953125f, d);
    s = fmaf((float)q, -1.428606765330187045e-06f, s);
    float u = 0.000198527617612853646278381f;
    u = fmaf(u, s, 0.00139304355252534151077271f);
    u = fmaf(u, s, 0.00833336077630519866943359f);
    u = fmaf(u, s, 0.0416664853692054748535156f);
    u = fmaf(u, s, 0.166666671633720397949219f);
    u = fmaf(u, s, 0.5f);
    u = 1.0f + fmaf(s * s, u, s);
    u = u * pow2i(q >> 1) * pow2i(q - (q >> 1));
    u = d < -104.0f ? 0.0f : u;
    return d > 100.0f ? INFINITY : u;
}

/* gate, up [inter] -> out [inter] = silu(gate) (rounded to the dtype) * up */
static inline __attribute__((always_inline)) void
silu_mul_row(const void *gate, const void *up, void *out, int inter, int bf16) {
    for (int i = 0; i < inter; i++) {
        const float g = load(gate, i, bf16);
        const float act = in_dtype(g / (1.0f + sleef_expf(-g)), bf16);
        store(out, i, act * load(up, i, bf16), bf16);
    }
}

/* --- rotary ------------------------------------------------------------------------- */

/* A token's cos or sin row in fp32, read once for all its heads. */
static inline __attribute__((always_inline)) void
load_row(const void *src, float *dst, int n, int bf16) {
    for (int i = 0; i < n; i++) dst[i] = load(src, i, bf16);
}

/* Channels [0, half) and [half, 2 half) of one head: (x1 c - x2 s, x2 c + x1 s), each
 * product rounded to the dtype before the sum, as torch computes it in that dtype. */
static inline __attribute__((always_inline)) void
rotate(void *x, const float *c, const float *s, int half, int bf16) {
    for (int i = 0; i < half; i++) {
        const float x1 = load(x, i, bf16), x2 = load(x, half + i, bf16);
        const float ci = c[i], si = s[i];
        store(x, i, in_dtype(x1 * ci, bf16) - in_dtype(x2 * si, bf16), bf16);
        store(x, half + i, in_dtype(x2 * ci, bf16) + in_dtype(x1 * si, bf16), bf16);
    }
}

/* bf16 heads with AVX-512: the operations of `rotate`, 16 channel pairs a vector, every
 * head of a token against one cos/sin row held in registers (`rotate` goes head by
 * head, each a loop of its own). The rounding is bf16_rounded_bits lane for lane
 * (vcvtneps2bf16 would flush denormals; torch does not). Half-widths 16, 32, 48 and 64
 * (head_dim 32..128); others take `rotate`. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

static inline __attribute__((always_inline)) __m512i bf16_bits16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    return _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
}

static inline __attribute__((always_inline)) __m512 in_bf16_16(__m512 f) {
    return _mm512_castsi512_ps(bf16_bits16(f));
}

static inline __attribute__((always_inline)) __m512 load_bf16_16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __attribute__((always_inline)) void store_bf16_16(uint16_t *p, __m512 f) {
    _mm256_storeu_si256((__m256i *)p,
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits16(f), 16)));
}

/* n heads at x, x + x_h, ... rotated in place by one position's cos/sin rows (bf16) */
static inline __attribute__((always_inline)) void
rotate_heads16(uint16_t *x, int64_t x_h, int n, const uint16_t *cos_row,
               const uint16_t *sin_row, const int C) {
    __m512 c[4], sn[4];
    for (int j = 0; j < C; j++) {
        c[j] = load_bf16_16(cos_row + 16 * j);
        sn[j] = load_bf16_16(sin_row + 16 * j);
    }
    const int half = 16 * C;
    for (int h = 0; h < n; h++) {
        uint16_t *p = x + h * x_h;
        for (int j = 0; j < C; j++) {
            const __m512 x1 = load_bf16_16(p + 16 * j), x2 = load_bf16_16(p + half + 16 * j);
            store_bf16_16(p + 16 * j, _mm512_sub_ps(in_bf16_16(_mm512_mul_ps(x1, c[j])),
                                                    in_bf16_16(_mm512_mul_ps(x2, sn[j]))));
            store_bf16_16(p + half + 16 * j,
                          _mm512_add_ps(in_bf16_16(_mm512_mul_ps(x2, c[j])),
                                        in_bf16_16(_mm512_mul_ps(x1, sn[j]))));
        }
    }
}

/* A token's q and k heads: 1 when rotated here, 0 for a width this does not take. */
static inline int rotate_token16(uint16_t *q, int64_t q_h, int num_heads, uint16_t *k,
                                 int64_t k_h, int num_kv_heads, const uint16_t *cos_row,
                                 const uint16_t *sin_row, int half) {
#define ROTATE_BOTH(C) do {                                                                 \
        rotate_heads16(q, q_h, num_heads, cos_row, sin_row, C);                             \
        rotate_heads16(k, k_h, num_kv_heads, cos_row, sin_row, C);                          \
    } while (0)
    switch (half) {
    case 16: ROTATE_BOTH(1); return 1;
    case 32: ROTATE_BOTH(2); return 1;
    case 48: ROTATE_BOTH(3); return 1;
    case 64: ROTATE_BOTH(4); return 1;
    default: return 0;
    }
#undef ROTATE_BOTH
}
#else
static inline int rotate_token16(uint16_t *q, int64_t q_h, int num_heads, uint16_t *k,
                                 int64_t k_h, int num_kv_heads, const uint16_t *cos_row,
                                 const uint16_t *sin_row, int half) {
    return 0;
}
#endif

/* --- entry points, one set per storage type T -------------------------------------- */

/* rms_norm: x, residual, out, residual_out [rows, hidden] with the given row strides
 *   (elements); residual NULL for none. sum_lanes: the float vector width of torch's
 *   sum kernel, which fixes its order of summation: 8, AVX-512 CPUs included, as ATen
 *   dispatches its sum there to the AVX2 build (kernels/rms_norm.py); 16 is also built.
 * silu_mul: x [rows, 2 * inter] (gate | up) -> out [rows, inter].
 * rotary: in place on q [T, Hq, D] and k [T, Hkv, D] (token and head strides given, D
 *   contiguous); cos/sin [positions, half] with row stride cs_stride, in T as well. */
#define DEFINE_ELEMENTWISE(SUFFIX, T, BF16)                                                 \
void rms_norm_##SUFFIX(const T *x, const T *residual, const T *weight, T *out,             \
                       T *residual_out, int64_t rows, int hidden, float eps,               \
                       int64_t x_stride, int64_t res_stride, int64_t out_stride,           \
                       int64_t res_out_stride, int sum_lanes, int num_threads) {           \
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")                   \
    for (int64_t r = 0; r < rows; r++)                                                      \
        rms_norm_row(x + r * x_stride, residual ? residual + r * res_stride : NULL,        \
                     weight, out + r * out_stride,                                          \
                     residual ? residual_out + r * res_out_stride : NULL, hidden, eps,     \
                     sum_lanes, BF16);                                                      \
}                                                                                           \
                                                                                            \
void silu_mul_##SUFFIX(const T *x, T *out, int64_t rows, int inter, int64_t x_stride,       \
                       int64_t out_stride, int num_threads) {                               \
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")                   \
    for (int64_t r = 0; r < rows; r++)                                                      \
        silu_mul_row(x + r * x_stride, x + r * x_stride + inter, out + r * out_stride,      \
                     inter, BF16);                                                          \
}                                                                                           \
                                                                                            \
void rotary_##SUFFIX(const int64_t *positions, T *q, T *k, const T *cos_t, const T *sin_t,  \
                     int64_t tokens, int num_heads, int num_kv_heads, int half,             \
                     int64_t q_t, int64_t q_h, int64_t k_t, int64_t k_h, int64_t cs_stride, \
                     int num_threads) {                                                     \
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")                   \
    for (int64_t t = 0; t < tokens; t++) {                                                  \
        float c[half], s[half];                                                             \
        load_row(cos_t + positions[t] * cs_stride, c, half, BF16);                          \
        load_row(sin_t + positions[t] * cs_stride, s, half, BF16);                          \
        for (int h = 0; h < num_heads; h++) rotate(q + t * q_t + h * q_h, c, s, half, BF16); \
        for (int h = 0; h < num_kv_heads; h++)                                              \
            rotate(k + t * k_t + h * k_h, c, s, half, BF16);                                \
    }                                                                                       \
}

DEFINE_ELEMENTWISE(f32, float, 0)
DEFINE_ELEMENTWISE(bf16, uint16_t, 1)

/* --- rotary and the KV cache write in one pass -------------------------------------- */

/* Element strides of rotary_cache's tensors (kernels/kv_cache.py CacheStrides). */
typedef struct {
    int64_t q_t, q_h, k_t, k_h, v_t, v_h, kc_b, kc_s, kc_h, vc_b, vc_s, vc_h, cs;
} cache_strides_t;

/* A token's k or v heads [Hkv, D] into its cache slot, head by head (a head's D
 * channels are contiguous on both sides). */
static inline void copy_heads(const char *src, int64_t src_h, char *dst, int64_t dst_h,
                              int num_kv_heads, size_t row_bytes) {
    for (int h = 0; h < num_kv_heads; h++)
        memcpy(dst + h * dst_h, src + h * src_h, row_bytes);
}

/* rotary_cache: rotary as rotary_* above on q [T, Hq, D] and k [T, Hkv, D] (skipped when
 * half == 0), then each token's key and value heads copied to slot slots[t] of the paged
 * caches [N, block_size, Hkv, D] (block slots[t] / block_size, row slots[t] % block_size;
 * strides in elements, so keys and values may share one tensor). A negative slot is a
 * padding token: rotated, not stored. Everything is checked before anything is written:
 * returns 1 when a position is outside the rotary table's num_positions rows, 2 when a
 * slot is at or past num_slots, 0 when done. Steps under 32 tokens stay on the calling
 * thread. A decode step's writes land on scattered slots, each a cache miss and some a
 * fresh page, so from 32 rows on, several threads keep more of those misses in flight
 * and pay for their start (docs/performance.md). */
#define DEFINE_ROTARY_CACHE(SUFFIX, T, BF16)                                                \
int rotary_cache_##SUFFIX(const int64_t *positions, T *q, T *k, const T *v, const T *cos_t, \
                          const T *sin_t, T *k_cache, T *v_cache, const int64_t *slots,     \
                          int64_t tokens, int num_heads, int num_kv_heads, int half,        \
                          int head_dim, const cache_strides_t *st, int64_t num_positions,   \
                          int64_t num_slots, int block_size, int num_threads) {             \
    for (int64_t t = 0; t < tokens; t++) {                                                  \
        if (half > 0 && (positions[t] < 0 || positions[t] >= num_positions)) return 1;     \
        if (slots[t] >= num_slots) return 2;                                                \
    }                                                                                       \
    const size_t row_bytes = (size_t)head_dim * sizeof(T);                                  \
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if(tokens >= 32)") \
    for (int64_t t = 0; t < tokens; t++) {                                                  \
        if (half > 0 && !(BF16 && rotate_token16(                                          \
                (uint16_t *)(q + t * st->q_t), st->q_h, num_heads,                          \
                (uint16_t *)(k + t * st->k_t), st->k_h, num_kv_heads,                       \
                (const uint16_t *)(cos_t + positions[t] * st->cs),                          \
                (const uint16_t *)(sin_t + positions[t] * st->cs), half))) {                \
            float c[half], s[half];                                                         \
            load_row(cos_t + positions[t] * st->cs, c, half, BF16);                         \
            load_row(sin_t + positions[t] * st->cs, s, half, BF16);                         \
            for (int h = 0; h < num_heads; h++)                                             \
                rotate(q + t * st->q_t + h * st->q_h, c, s, half, BF16);                    \
            for (int h = 0; h < num_kv_heads; h++)                                          \
                rotate(k + t * st->k_t + h * st->k_h, c, s, half, BF16);                    \
        }                                                                                   \
        if (slots[t] < 0) continue;                                                         \
        const int64_t block = slots[t] / block_size, row = slots[t] % block_size;           \
        copy_heads((const char *)(k + t * st->k_t), st->k_h * (int64_t)sizeof(T),          \
                   (char *)(k_cache + block * st->kc_b + row * st->kc_s),                   \
                   st->kc_h * (int64_t)sizeof(T), num_kv_heads, row_bytes);                 \
        copy_heads((const char *)(v + t * st->v_t), st->v_h * (int64_t)sizeof(T),          \
                   (char *)(v_cache + block * st->vc_b + row * st->vc_s),                   \
                   st->vc_h * (int64_t)sizeof(T), num_kv_heads, row_bytes);                 \
    }                                                                                       \
    return 0;                                                                               \
}

DEFINE_ROTARY_CACHE(f32, float, 0)
DEFINE_ROTARY_CACHE(bf16, uint16_t, 1)
/* fp16 caches: no rotary (half == 0 only; the rotary tables are fp32 or bf16). */
DEFINE_ROTARY_CACHE(f16, uint16_t, 0)
