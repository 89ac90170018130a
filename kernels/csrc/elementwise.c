/* Row-wise fp32 operations for CPUs, each one pass over memory where torch makes
 * several (and allocates a temporary per pass): the residual add fused with RMSNorm,
 * SiLU(gate) * up, and rotary embedding in place. Rows are spread over OpenMP threads;
 * each row's inner loop is vectorised by the compiler.
 *
 * The arithmetic follows the torch references (kernels/rms_norm.py, silu_mul.py,
 * rotary.py): RMSNorm squares, averages and scales in fp32 and multiplies by the
 * weight last; rotary rotates the first 2 * half channels of each head as
 * (x1 c - x2 s, x2 c + x1 s).
 */
#include <math.h>
#include <stdint.h>

/* out = weight * (h / sqrt(mean(h^2) + eps)), h = x (+ residual, also written to
 * residual_out when residual is not NULL). Strides are per row, in elements. */
void rms_norm_f32(const float *x, const float *residual, const float *weight, float *out,
                  float *residual_out, int64_t rows, int hidden, float eps, int64_t x_stride,
                  int64_t res_stride, int64_t out_stride, int64_t res_out_stride,
                  int num_threads) {
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * out_stride;
        const float *h = xr;
        if (residual) {
            const float *rr = residual + r * res_stride;
            float *ro = residual_out + r * res_out_stride;
            _Pragma("omp simd")
            for (int i = 0; i < hidden; i++) ro[i] = xr[i] + rr[i];
            h = ro;
        }
        float sum = 0.0f;
        _Pragma("omp simd reduction(+:sum)")
        for (int i = 0; i < hidden; i++) sum += h[i] * h[i];
        const float inv = 1.0f / sqrtf(sum / hidden + eps);
        _Pragma("omp simd")
        for (int i = 0; i < hidden; i++) o[i] = weight[i] * (h[i] * inv);
    }
}

/* x [rows, 2 * inter] (gate | up) -> out [rows, inter] = silu(gate) * up */
void silu_mul_f32(const float *x, float *out, int64_t rows, int inter, int64_t x_stride,
                  int64_t out_stride, int num_threads) {
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")
    for (int64_t r = 0; r < rows; r++) {
        const float *g = x + r * x_stride, *u = g + inter;
        float *o = out + r * out_stride;
        _Pragma("omp simd")
        for (int i = 0; i < inter; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* In place on q [T, Hq, D] and k [T, Hkv, D]: channels [0, half) and [half, 2 half) of
 * each head rotate by the angle of the token's position; cos/sin are [positions, half]
 * with row stride cs_stride. */
static inline void rotate(float *x, const float *c, const float *s, int half) {
    _Pragma("omp simd")
    for (int i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[half + i];
        x[i] = x1 * c[i] - x2 * s[i];
        x[half + i] = x2 * c[i] + x1 * s[i];
    }
}

void rotary_f32(const int64_t *positions, float *q, float *k, const float *cos_t,
                const float *sin_t, int64_t tokens, int num_heads, int num_kv_heads, int half,
                int64_t q_t, int64_t q_h, int64_t k_t, int64_t k_h, int64_t cs_stride,
                int num_threads) {
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_t + positions[t] * cs_stride, *s = sin_t + positions[t] * cs_stride;
        for (int h = 0; h < num_heads; h++) rotate(q + t * q_t + h * q_h, c, s, half);
        for (int h = 0; h < num_kv_heads; h++) rotate(k + t * k_t + h * k_h, c, s, half);
    }
}
