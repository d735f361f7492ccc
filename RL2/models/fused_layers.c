/* The trainer's float32 RMSNorm and SwiGLU activation on CPU, forward and backward, one pass each.
 *
 * As torch ops, HF's RMSNorm is some ten kernels forward and backward, and silu(gate) * up five; each
 * reads and writes whole [tokens, width] tensors, so between the matmuls of a decoder layer the core
 * mostly waits on memory. Here each is one pass over its inputs (the gain is in the README's table of
 * `benchmarks/bench_fused_layers.py`). Built and loaded by fused_layers.py; where it cannot be built,
 * the models run HF's own code.
 *
 * All tensors are float32 and C-contiguous: x, out, grad_x, grad_out [rows, dim]; rstd [rows];
 * weight, grad_weight [dim]; gate, up and their gradients are flat, n elements each.
 */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "fast_math.h" /* exp_clamped */

/* Elements from which the loops run on all threads; below it, waking them costs more than it saves. */
#define PARALLEL_FROM 32768
/* Elements per block of the flat loops: a block of each input stays in L1. */
#define BLOCK 2048

/* out = weight * (x * rstd) with rstd = 1 / sqrt(mean(x^2) + eps), per row, as HF's RMSNorm; rstd is
 * kept for the backward. */
void rms_norm_forward(const float *x, const float *weight, float *out, float *rstd, int64_t rows, int64_t dim,
                      float eps) {
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_FROM)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < dim; i++) sum += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        rstd[r] = inv;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] = weight[i] * (xr[i] * inv);
    }
}

/* With n = x * rstd and g = grad_out * weight, per row:
 *   grad_x = rstd * (g - n * mean(g * n)),   grad_weight = sum over rows of grad_out * n.
 * grad_weight is summed in double, per thread, then over the threads in order. Returns 1 when the
 * threads' sums cannot be allocated, 0 otherwise. */
int rms_norm_backward(const float *x, const float *weight, const float *rstd, const float *grad_out, float *grad_x,
                      float *grad_weight, int64_t rows, int64_t dim) {
    int parallel = rows * dim >= PARALLEL_FROM;
    int threads = parallel ? omp_get_max_threads() : 1;
    double *sums = calloc((size_t)threads * (size_t)dim, sizeof(double));
    if (!sums) return 1;
#pragma omp parallel num_threads(threads) if (parallel)
    {
        double *mine = sums + (size_t)omp_get_thread_num() * (size_t)dim;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const float *xr = x + r * dim, *go = grad_out + r * dim;
            float *gx = grad_x + r * dim;
            float inv = rstd[r], dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < dim; i++) dot += go[i] * weight[i] * (xr[i] * inv);
            float mean = dot / (float)dim;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) {
                float n = xr[i] * inv;
                gx[i] = inv * (go[i] * weight[i] - n * mean);
                mine[i] += (double)(go[i] * n);
            }
        }
    }
    for (int64_t i = 0; i < dim; i++) {
        double total = 0.0;
        for (int t = 0; t < threads; t++) total += sums[(size_t)t * (size_t)dim + i];
        grad_weight[i] = (float)total;
    }
    free(sums);
    return 0;
}

/* out = silu(gate) * up, silu(g) = g / (1 + exp(-g)) as torch computes it. */
void silu_mul_forward(const float *gate, const float *up, float *out, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= PARALLEL_FROM)
    for (int64_t start = 0; start < n; start += BLOCK) {
        int64_t end = start + BLOCK < n ? start + BLOCK : n;
#pragma omp simd
        for (int64_t i = start; i < end; i++) {
            float g = gate[i];
            out[i] = g / (1.0f + exp_clamped(-g)) * up[i];
        }
    }
}

/* With s = sigmoid(gate): grad_gate = grad_out * up * s * (1 + gate * (1 - s)), grad_up = grad_out * gate * s. */
void silu_mul_backward(const float *gate, const float *up, const float *grad_out, float *grad_gate, float *grad_up,
                       int64_t n) {
#pragma omp parallel for schedule(static) if (n >= PARALLEL_FROM)
    for (int64_t start = 0; start < n; start += BLOCK) {
        int64_t end = start + BLOCK < n ? start + BLOCK : n;
#pragma omp simd
        for (int64_t i = start; i < end; i++) {
            float g = gate[i], s = 1.0f / (1.0f + exp_clamped(-g)), go = grad_out[i];
            grad_gate[i] = go * up[i] * (s * (1.0f + g * (1.0f - s)));
            grad_up[i] = go * g * s;
        }
    }
}
