/* The decode step's work between the matmuls (decode_kernels.c), written once over an element type and
 * included there once per dtype through per_dtype.h (no include guard, on purpose), which defines:
 *   ELEMENT        the type of hidden, delta, the norms' weights, qkv, cos, sin, gate_up and the cached values
 *   NAME(base)     the function name for this dtype
 *   LOAD(v)        an ELEMENT as float; STORE(f) a float rounded to an ELEMENT
 * q_out and the cached keys are float32 in both (SlotKVCache keeps keys in float32; a bf16 model's are
 * bf16 values widened, exactly). All arithmetic is in float32; a result is rounded to ELEMENT wherever
 * the torch ops of llama_forward.py round a bf16 model's tensors, so for bf16 both compute the same
 * (up to the order of a row's sums), and for float32 STORE rounds nothing. */

#include "norm_and_silu.h" /* rms_norm_row, silu_mul_value */

/* hidden += delta (when delta is not NULL; the sum rounded, as `hidden + delta`), then
 * out = RMSNorm(hidden) * weight. */
void NAME(add_rms_norm)(ELEMENT *hidden, const ELEMENT *delta, const ELEMENT *weight, ELEMENT *out, int64_t rows,
                        int64_t dim, float eps) {
#pragma omp parallel for if (rows * dim >= PARALLEL_FROM)
    for (int64_t r = 0; r < rows; r++) {
        ELEMENT *h = hidden + r * dim;
        if (delta) {
            const ELEMENT *d = delta + r * dim;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) h[i] = STORE(LOAD(h[i]) + LOAD(d[i]));
        }
        NAME(rms_norm_row)(out + r * dim, h, weight, dim, eps);
    }
}

/* out = silu(gate) * up, where gate_up is [rows, 2 * width] with gate first; out is [rows, width]. As
 * `F.silu(gate) * up`: silu's result is rounded before the product. */
void NAME(silu_mul)(const ELEMENT *gate_up, ELEMENT *out, int64_t rows, int64_t width) {
#pragma omp parallel for if (rows * width >= PARALLEL_FROM)
    for (int64_t r = 0; r < rows; r++) {
        const ELEMENT *restrict gate = gate_up + r * 2 * width, *restrict up = gate + width;
        ELEMENT *restrict o = out + r * width;
#pragma omp simd
        for (int64_t i = 0; i < width; i++) {
            o[i] = NAME(silu_mul_value)(LOAD(gate[i]), LOAD(up[i]));
        }
    }
}

/* HF's x * cos + rotate_half(x) * sin for one head, rotate_half(x) = cat(-x[half:], x[:half]), as
 * `addcmul(x * cos, roll(x), [-sin, sin])`: x * cos rounded, then the sum rounded. */
static void NAME(rotate_head)(float *restrict out, const ELEMENT *restrict x, const ELEMENT *restrict cos,
                              const ELEMENT *restrict sin, int64_t head_dim) {
    int64_t half = head_dim / 2;
    for (int64_t i = 0; i < half; i++) {
        float low = LOAD(x[i]), high = LOAD(x[i + half]);
        out[i] = LOAD(STORE(LOAD(STORE(low * LOAD(cos[i]))) - high * LOAD(sin[i])));
        out[i + half] = LOAD(STORE(LOAD(STORE(high * LOAD(cos[i + half]))) + low * LOAD(sin[i + half])));
    }
}

/* Rotates q into q_out [rows, heads, head_dim]; rotates k and writes it, and v, into the cache at
 * position positions[r] of cache row r. q_norm and k_norm (Qwen3's per-head RMSNorm before the
 * rotation, weights [head_dim]) may be NULL. */
void NAME(rope_and_store)(const ELEMENT *qkv, const ELEMENT *cos, const ELEMENT *sin, const int64_t *positions,
                          const ELEMENT *q_norm, const ELEMENT *k_norm, float eps, float *q_out, ELEMENT *keys,
                          ELEMENT *values, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                          int64_t cache_len) {
    int64_t width = (heads + 2 * kv_heads) * head_dim;
#pragma omp parallel for if (rows * width >= PARALLEL_FROM)
    for (int64_t r = 0; r < rows; r++) {
        const ELEMENT *row = qkv + r * width, *c = cos + r * head_dim, *s = sin + r * head_dim;
        ELEMENT normed[head_dim];
        float rotated[head_dim];
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            const ELEMENT *x = row + h * head_dim;
            const ELEMENT *norm = h < heads ? q_norm : k_norm;
            if (norm) {
                NAME(rms_norm_row)(normed, x, norm, head_dim, eps);
                x = normed;
            }
            if (h < heads) {
                NAME(rotate_head)(q_out + (r * heads + h) * head_dim, x, c, s, head_dim);
            } else {
                NAME(rotate_head)(rotated, x, c, s, head_dim);
                ELEMENT *dst = keys + ((r * kv_heads + (h - heads)) * cache_len + positions[r]) * head_dim;
                for (int64_t i = 0; i < head_dim; i++) dst[i] = STORE(rotated[i]); /* exact: already rounded */
            }
        }
        for (int64_t g = 0; g < kv_heads; g++) {
            const ELEMENT *v = row + (heads + kv_heads + g) * head_dim;
            ELEMENT *dst = values + ((r * kv_heads + g) * cache_len + positions[r]) * head_dim;
            for (int64_t i = 0; i < head_dim; i++) dst[i] = v[i];
        }
    }
}

/* One token per row drawn from softmax(logits / temperatures[r]) by inverse CDF: tokens[r] is the first whose
 * cumulative weight exceeds uniform[r] times the row's total (torch.searchsorted(cumsum, u * total, right=True) in
 * sampling.py), logprobs[r] its log-probability at that temperature. Two passes over a row, where the torch ops take
 * five: its largest logit, then the weights exp((l - max) / T) summed by blocks (a weight below exp(-87) counts as 0,
 * so a -inf logit is never drawn); the draw walks the block sums and reads one block again. */
#ifndef SAMPLE_BLOCK
#define SAMPLE_BLOCK 512
#endif
/* A logit's weight exp((l - max) / T) in the draw; 0 below exp(-87) and for NaN. */
static inline float NAME(sample_weight)(ELEMENT logit, float max, float inverse_t) {
    float x = (LOAD(logit) - max) * inverse_t;
    return x > -87.0f ? exp_clamped(x) : 0.0f;
}

void NAME(sample_rows)(const ELEMENT *logits, int64_t rows, int64_t vocab, const float *temperatures,
                       const double *uniform, int64_t *tokens, float *logprobs) {
#pragma omp parallel for if (rows * vocab >= PARALLEL_FROM)
    for (int64_t r = 0; r < rows; r++) {
        const ELEMENT *l = logits + r * vocab;
        float inverse_t = 1.0f / temperatures[r], max = -INFINITY;
        int64_t nans = 0;  /* a NaN logit makes the row's log-probability NaN, as softmax's would be */
#pragma omp simd reduction(max : max) reduction(+ : nans)
        for (int64_t i = 0; i < vocab; i++) {
            float x = LOAD(l[i]);
            max = x > max ? x : max;
            nans += x != x;
        }
        int64_t blocks = (vocab + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
        float sums[blocks];
        double total = 0.0;
        for (int64_t b = 0; b < blocks; b++) {
            int64_t end = (b + 1) * SAMPLE_BLOCK < vocab ? (b + 1) * SAMPLE_BLOCK : vocab;
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t i = b * SAMPLE_BLOCK; i < end; i++) sum += NAME(sample_weight)(l[i], max, inverse_t);
            sums[b] = sum;
            total += sum;
        }
        double target = uniform[r] * total, below = 0.0;
        int64_t b = 0, token = -1;
        while (b < blocks - 1 && below + sums[b] <= target) below += sums[b++];
        int64_t end = (b + 1) * SAMPLE_BLOCK < vocab ? (b + 1) * SAMPLE_BLOCK : vocab;
        for (int64_t i = b * SAMPLE_BLOCK; i < end; i++) {
            float weight = NAME(sample_weight)(l[i], max, inverse_t);
            if (weight == 0.0f) continue;
            token = i;  /* the last token of weight > 0 so far: the draw where rounding leaves the target unreached */
            below += weight;
            if (below > target) break;
        }
        while (token < 0 && b > 0) {  /* only where the target's block held no weight at all: an earlier one did */
            b--;
            for (int64_t i = b * SAMPLE_BLOCK; i < b * SAMPLE_BLOCK + SAMPLE_BLOCK; i++)
                if (NAME(sample_weight)(l[i], max, inverse_t) > 0.0f) token = i;
        }
        token = token < 0 ? 0 : token;  /* no weight anywhere: logits all -inf or NaN, and the log-probability says so */
        tokens[r] = token;
        logprobs[r] = nans ? NAN : (LOAD(l[token]) - max) * inverse_t - (float)log(total);
    }
}
