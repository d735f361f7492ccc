/* RMSNorm of a row and SiLU of one value as both the trainer's fused layers (fused_layers_kernels.h) and
 * the engine's decode step (decode_step_kernels.h) compute them, so that trainer and engine round alike.
 * Written over ELEMENT, NAME, LOAD and STORE (per_dtype.h); included by those headers once per dtype (no
 * include guard, on purpose). */

/* out = weight * x * rstd for a row whose rstd is known, rounded once. */
static inline void NAME(rms_norm_scale_row)(ELEMENT *restrict out, const ELEMENT *restrict x,
                                            const ELEMENT *restrict weight, int64_t dim, float rstd) {
#pragma omp simd
    for (int64_t i = 0; i < dim; i++) out[i] = STORE(LOAD(weight[i]) * (LOAD(x[i]) * rstd));
}

/* out = weight * x * rstd, rstd = 1 / sqrt(mean(x^2) + eps), rounded once as torch's F.rms_norm rounds it
 * (for float32 this is HF's RMSNorm exactly); returns rstd. */
static inline float NAME(rms_norm_row)(ELEMENT *restrict out, const ELEMENT *restrict x,
                                       const ELEMENT *restrict weight, int64_t dim, float eps) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < dim; i++) sum += LOAD(x[i]) * LOAD(x[i]);
    float inv = 1.0f / sqrtf(sum / (float)dim + eps);
    NAME(rms_norm_scale_row)(out, x, weight, dim, inv);
    return inv;
}

/* silu(g) = g / (1 + exp(-g)) as torch computes it, rounded to ELEMENT (and widened back), as `F.silu`
 * rounds it before `* up`. */
static inline float NAME(silu_rounded)(float g) {
    return LOAD(STORE(g / (1.0f + exp_clamped(-g))));
}

/* silu(gate) * up as the forward rounds it: silu rounded first, then the product. */
static inline ELEMENT NAME(silu_mul_value)(float gate, float up) {
    return STORE(NAME(silu_rounded)(gate) * up);
}
