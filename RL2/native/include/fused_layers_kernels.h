/* The kernels of fused_layers.c, written once over an element type and included there once per dtype
 * through per_dtype.h (no include guard, on purpose), which defines:
 *   ELEMENT        the type of every tensor but rstd (float32 in both cases)
 *   NAME(base)     the function name for this dtype
 *   LOAD(v)        an ELEMENT as float; STORE(f) a float rounded to an ELEMENT
 * All arithmetic is in float32 (double for the weight gradient's sums), whatever ELEMENT is; each
 * result is rounded to ELEMENT once, except where noted. */

#include "norm_and_silu.h" /* rms_norm_row, rms_norm_scale_row, silu_rounded, silu_mul_value */

/* out = weight * x * rstd with rstd = 1 / sqrt(mean(x^2) + eps), per row; rstd is kept for the
 * backward. One rounding, as torch's F.rms_norm (which the embedded engine runs); for float32 this is
 * HF's RMSNorm exactly. */
void NAME(rms_norm_forward)(const ELEMENT *x, const ELEMENT *weight, ELEMENT *out, float *rstd, int64_t rows,
                            int64_t dim, float eps) {
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_FROM)
    for (int64_t r = 0; r < rows; r++) rstd[r] = NAME(rms_norm_row)(out + r * dim, x + r * dim, weight, dim, eps);
}

/* rms_norm_forward's output again, bit for bit, from the rstd it kept (the input projections that read
 * a norm's output keep the norm's input instead of that output, fused_layers.py). */
void NAME(rms_norm_apply)(const ELEMENT *x, const ELEMENT *weight, const float *rstd, ELEMENT *out, int64_t rows,
                          int64_t dim) {
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_FROM)
    for (int64_t r = 0; r < rows; r++) NAME(rms_norm_scale_row)(out + r * dim, x + r * dim, weight, dim, rstd[r]);
}

/* With n = x * rstd and g = grad_out * weight, per row:
 *   grad_x = rstd * (g - n * mean(g * n)),   grad_weight = sum over rows of grad_out * n.
 * grad_weight is summed in double, per thread, then over the threads in order. Returns 1 when the
 * threads' sums cannot be allocated, 0 otherwise. */
int NAME(rms_norm_backward)(const ELEMENT *x, const ELEMENT *weight, const float *rstd, const ELEMENT *grad_out,
                            ELEMENT *grad_x, ELEMENT *grad_weight, int64_t rows, int64_t dim) {
    int parallel = rows * dim >= PARALLEL_FROM;
    int threads = parallel ? omp_get_max_threads() : 1;
    double *sums = calloc((size_t)threads * (size_t)dim, sizeof(double));
    if (!sums) return 1;
#pragma omp parallel num_threads(threads) if (parallel)
    {
        double *mine = sums + (size_t)omp_get_thread_num() * (size_t)dim;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const ELEMENT *xr = x + r * dim, *go = grad_out + r * dim;
            ELEMENT *gx = grad_x + r * dim;
            float inv = rstd[r], dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < dim; i++) dot += LOAD(go[i]) * LOAD(weight[i]) * (LOAD(xr[i]) * inv);
            float mean = dot / (float)dim;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) {
                float n = LOAD(xr[i]) * inv, g = LOAD(go[i]);
                gx[i] = STORE(inv * (g * LOAD(weight[i]) - n * mean));
                mine[i] += (double)(g * n);
            }
        }
    }
    for (int64_t i = 0; i < dim; i++) {
        double total = 0.0;
        for (int t = 0; t < threads; t++) total += sums[(size_t)t * (size_t)dim + i];
        grad_weight[i] = STORE((float)total);
    }
    free(sums);
    return 0;
}

/* out = silu(gate) * up, silu(g) = g / (1 + exp(-g)) as torch computes it. silu is rounded to ELEMENT
 * before the product, as torch's two ops round it (and the embedded engine runs them), so that trainer
 * and engine agree in bfloat16 too. */
void NAME(silu_mul_forward)(const ELEMENT *gate, const ELEMENT *up, ELEMENT *out, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= PARALLEL_FROM)
    for (int64_t start = 0; start < n; start += BLOCK) {
        int64_t end = start + BLOCK < n ? start + BLOCK : n;
#pragma omp simd
        for (int64_t i = start; i < end; i++) {
            out[i] = NAME(silu_mul_value)(LOAD(gate[i]), LOAD(up[i]));
        }
    }
}

/* With s = sigmoid(gate): grad_gate = grad_out * up * s * (1 + gate * (1 - s)), grad_up = grad_out * silu
 * (silu rounded as the forward used it). */
static inline void NAME(silu_mul_gradients)(float g, float u, float go, ELEMENT *grad_gate, ELEMENT *grad_up) {
    float s = 1.0f / (1.0f + exp_clamped(-g));
    *grad_gate = STORE(go * u * (s * (1.0f + g * (1.0f - s))));
    *grad_up = STORE(go * LOAD(STORE(g * s)));
}

/* The gradients of silu_mul_forward, and, where `out` is not NULL, its output again, exactly as the
 * forward wrote it: the SwiGLU MLP (fused_layers.py) keeps gate and up for its backward, not the
 * product too, and needs the product there for the down projection's weight gradient. */
void NAME(silu_mul_backward)(const ELEMENT *gate, const ELEMENT *up, const ELEMENT *grad_out, ELEMENT *grad_gate,
                             ELEMENT *grad_up, ELEMENT *out, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= PARALLEL_FROM)
    for (int64_t start = 0; start < n; start += BLOCK) {
        int64_t end = start + BLOCK < n ? start + BLOCK : n;
        if (out) {
#pragma omp simd
            for (int64_t i = start; i < end; i++) {
                float g = LOAD(gate[i]), u = LOAD(up[i]);
                NAME(silu_mul_gradients)(g, u, LOAD(grad_out[i]), grad_gate + i, grad_up + i);
                out[i] = NAME(silu_mul_value)(g, u);
            }
        } else {
#pragma omp simd
            for (int64_t i = start; i < end; i++)
                NAME(silu_mul_gradients)(LOAD(gate[i]), LOAD(up[i]), LOAD(grad_out[i]), grad_gate + i, grad_up + i);
        }
    }
}
