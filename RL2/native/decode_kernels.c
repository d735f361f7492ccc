/* The embedded engine's decode step between the matmuls, for Llama-family layers on CPU, in float32
 * and bf16; and the float32 matmuls themselves (panel_linear).
 *
 * A decode step has one new token per running request, so everything between the four matmuls of a
 * layer works on a few dozen rows. As torch ops that is some 25 small kernels per layer, each costing
 * more in dispatch and threading overhead than in arithmetic, and attention over the cache runs as
 * thousands of tiny batched GEMMs. Here the same arithmetic is four calls per layer (the gain is in
 * docs/benchmarks.md's rows of `benchmarks/bench_engine.py`).
 * Built and loaded by decode_kernels.py; the torch code in llama_forward.py computes the same values
 * and is what runs when this library cannot be built.
 *
 * Layouts (C-contiguous; ELEMENT is float32 or bf16, the model's dtype, and functions end in _f32 or _bf16
 * by it):
 *   hidden, delta       [rows, dim]                                 ELEMENT
 *   qkv                 [rows, (heads + 2 * kv_heads) * head_dim]   ELEMENT: q, k, v projections side by side
 *   cos, sin            [rows, head_dim]                            ELEMENT: the model's rotary cos and sin
 *   q                   [rows, heads, head_dim]                     float32 (a bf16 model's q widened)
 *   keys, values        [cache_rows, kv_heads, cache_len, head_dim] ELEMENT: the engine's SlotKVCache
 *   positions           [rows] int64                                row r writes and sees 0..positions[r]
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h> /* the AVX512 products' intrinsics (AVX512-BF16 implies AVX512F) */
#endif

#include "bf16.h"       /* bf16_to_float, float_to_bf16 */
#include "fast_math.h"  /* exp_clamped */

/* Elements from which the row loops run on all threads (torch's pool, already spinning between the
 * step's ops); below it, waking them costs more than it saves. */
#define PARALLEL_FROM 8192

#define KERNELS "decode_step_kernels.h" /* add_rms_norm, silu_mul, rope_and_store */
#include "per_dtype.h"

/* scores[h * stride + j] = scale * (query[h] . keys[j]) for the group's heads h and first <= j < length.
 * Four keys at a time, every head while they are in L1: one dot product alone is a chain of dependent
 * multiply-adds, four are independent and keep the FPU busy. */
static void score_keys(float *restrict scores, const float *restrict query, const float *restrict keys, int64_t group,
                       int64_t first, int64_t length, int64_t stride, int64_t head_dim, float scale) {
    int64_t j = first;
    for (; j + 4 <= length; j += 4) {
        const float *k0 = keys + j * head_dim, *k1 = k0 + head_dim, *k2 = k1 + head_dim, *k3 = k2 + head_dim;
        for (int64_t h = 0; h < group; h++) {
            const float *qh = query + h * head_dim;
            float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
            for (int64_t i = 0; i < head_dim; i++) {
                d0 += qh[i] * k0[i];
                d1 += qh[i] * k1[i];
                d2 += qh[i] * k2[i];
                d3 += qh[i] * k3[i];
            }
            float *s = scores + h * stride + j;
            s[0] = d0 * scale, s[1] = d1 * scale, s[2] = d2 * scale, s[3] = d3 * scale;
        }
    }
    for (; j < length; j++) {
        for (int64_t h = 0; h < group; h++) {
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < head_dim; i++) dot += query[h * head_dim + i] * keys[j * head_dim + i];
            scores[h * stride + j] = dot * scale;
        }
    }
}

/* out = sum over j < length of weights[j] * values[j]. Eight columns at a time, summed in registers
 * over four keys at once (independent chains again); out is written once. */
static void weigh_values(float *restrict out, const float *restrict weights, const float *restrict values,
                         int64_t length, int64_t head_dim) {
    int64_t c = 0;
    for (; c + 8 <= head_dim; c += 8) {
        float a0[8] = {0}, a1[8] = {0}, a2[8] = {0}, a3[8] = {0};
        int64_t j = 0;
        for (; j + 4 <= length; j += 4) {
            const float *v = values + j * head_dim + c;
            for (int l = 0; l < 8; l++) {
                a0[l] += weights[j] * v[l];
                a1[l] += weights[j + 1] * v[head_dim + l];
                a2[l] += weights[j + 2] * v[2 * head_dim + l];
                a3[l] += weights[j + 3] * v[3 * head_dim + l];
            }
        }
        for (; j < length; j++)
            for (int l = 0; l < 8; l++) a0[l] += weights[j] * values[j * head_dim + c + l];
        for (int l = 0; l < 8; l++) out[c + l] = (a0[l] + a1[l]) + (a2[l] + a3[l]);
    }
    for (; c < head_dim; c++) {  /* a head_dim that is not a multiple of 8 */
        float sum = 0.0f;
        for (int64_t j = 0; j < length; j++) sum += weights[j] * values[j * head_dim + c];
        out[c] = sum;
    }
}

/* Attention's products a vector of keys or of value columns at a time: VL lanes, 16 with AVX512, else 8
 * (AVX2's width). */
#define WEIGH_VECTORS 4 /* value columns per pass: 4 vectors, summed for up to WEIGH_HEADS heads at once */
#ifdef __AVX512F__
#define VL 16
#define WEIGH_HEADS 4 /* 16 of the 32 vector registers */
#else
#define VL 8
#define WEIGH_HEADS 2 /* 8 of 16 (four heads of two vectors each measured slower) */
#endif
/* Loaded unaligned: cached keys and values, and the rows of panel_linear's transpose of x, start on
 * 32-byte boundaries at best. */
typedef float vf __attribute__((vector_size(VL * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));

/* Two vectors of G groups of S partial sums -> one of 2G groups of S/2: each group's two halves added,
 * x's group g becoming group 2g and y's group 2g + 1. */
static inline vf fold(vf x, vf y, vi first_halves, vi second_halves) {
    return __builtin_shuffle(x, y, first_halves) + __builtin_shuffle(x, y, second_halves);
}

/* Lane t of the result: the sum of the VL lanes of v[t]. log2(VL) levels of folds (VL - 1 adds) instead of
 * a horizontal sum per vector; they leave vector t's sum in lane bitreverse(t), which one shuffle undoes. */
static inline vf sum_lanes(const vf v[VL]) {
#if VL == 16
    const vi first16 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const vi second16 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const vi first8 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
    const vi second8 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
    const vi first4 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
    const vi second4 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
    const vi first2 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
    const vi second2 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
    vf a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) a[i] = fold(v[2 * i], v[2 * i + 1], first16, second16);
    for (int i = 0; i < 4; i++) b[i] = fold(a[2 * i], a[2 * i + 1], first8, second8);
    for (int i = 0; i < 2; i++) c[i] = fold(b[2 * i], b[2 * i + 1], first4, second4);
    return __builtin_shuffle(fold(c[0], c[1], first2, second2), (vi){0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15});
#else
    const vi first8 = {0, 1, 2, 3, 8, 9, 10, 11}, second8 = {4, 5, 6, 7, 12, 13, 14, 15};
    const vi first4 = {0, 1, 8, 9, 4, 5, 12, 13}, second4 = {2, 3, 10, 11, 6, 7, 14, 15};
    const vi first2 = {0, 8, 2, 10, 4, 12, 6, 14}, second2 = {1, 9, 3, 11, 5, 13, 7, 15};
    vf b[4], c[2];
    for (int i = 0; i < 4; i++) b[i] = fold(v[2 * i], v[2 * i + 1], first8, second8);
    for (int i = 0; i < 2; i++) c[i] = fold(b[2 * i], b[2 * i + 1], first4, second4);
    return __builtin_shuffle(fold(c[0], c[1], first2, second2), (vi){0, 4, 2, 6, 1, 5, 3, 7});
#endif
}

/* score_keys VL keys at a time (head_dim a multiple of VL) from `first` (a multiple of VL, so that every key
 * takes the same path whatever `first` is): each key's dot product with a query head is VL lanes of partial
 * sums, folded together with the other keys' (sum_lanes); the rest by score_keys. */
static void score_key_vectors(float *restrict scores, const float *restrict query, const float *restrict keys,
                              int64_t group, int64_t first, int64_t length, int64_t stride, int64_t head_dim,
                              float scale) {
    int64_t j = first;
    for (; j + VL <= length; j += VL) {
        const float *block = keys + j * head_dim;
        for (int64_t h = 0; h < group; h++) {
            const float *qh = query + h * head_dim;
            vf acc[VL] = {0};
            for (int64_t i = 0; i < head_dim; i += VL) {
                vf qi = *(const vf *)(qh + i);
#pragma GCC unroll 16
                for (int t = 0; t < VL; t++) acc[t] += qi * *(const vf *)(block + t * head_dim + i);
            }
            *(vf *)(scores + h * stride + j) = sum_lanes(acc) * scale;
        }
    }
    score_keys(scores, query, keys, group, j, length, stride, head_dim, scale);
}

/* weigh_values for `heads` (1 to WEIGH_HEADS) query heads at once (weights[h * stride + j]), over WEIGH_VECTORS
 * vectors of columns from column c and keys first..length-1: each value vector is loaded once for all of them.
 * With `resume`, each sum goes on from what out holds (the same chain of multiply-adds as one call from 0). */
static inline void weigh_value_vectors(float *restrict out, const float *restrict weights, const float *restrict values,
                                       int64_t heads, int64_t first, int64_t length, int64_t stride, int64_t head_dim,
                                       int64_t c, int resume) {
    vf acc[WEIGH_HEADS][WEIGH_VECTORS] = {0};
    if (resume)
        for (int64_t h = 0; h < heads; h++)
            for (int q = 0; q < WEIGH_VECTORS; q++) acc[h][q] = *(const vf *)(out + h * head_dim + c + q * VL);
    for (int64_t j = first; j < length; j++) {
        vf v[WEIGH_VECTORS];
        for (int q = 0; q < WEIGH_VECTORS; q++) v[q] = *(const vf *)(values + j * head_dim + c + q * VL);
#pragma GCC unroll 4
        for (int h = 0; h < WEIGH_HEADS; h++) {
            if (h < heads) {
                float w = weights[h * stride + j];
                for (int q = 0; q < WEIGH_VECTORS; q++) acc[h][q] += w * v[q];
            }
        }
    }
    for (int64_t h = 0; h < heads; h++)
        for (int q = 0; q < WEIGH_VECTORS; q++) *(vf *)(out + h * head_dim + c + q * VL) = acc[h][q];
}

static void widen_bf16(float *restrict out, const bf16 *restrict in, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = bf16_to_float(in[i]);  /* exact */
}

/* *buffer with room for at least `need` floats (what it held is not kept). */
static float *at_least(float **buffer, int64_t *capacity, int64_t need) {
    if (need > *capacity) {
        free(*buffer);
        *buffer = malloc(need * sizeof(float));
        if (!*buffer) abort();  /* out of memory: no way to raise from inside a parallel region */
        *capacity = need;
    }
    return *buffer;
}

/* The keys or values of one row and kv head (from `offset` in the cache) at positions first..length-1 as
 * float32, indexed by position: the cache itself for a float32 model; for a bf16 model, `wide` with those
 * positions widened (exactly). */
static inline const float *positions_as_float(const void *cache, int bf16_model, float *wide, int64_t offset,
                                              int64_t first, int64_t length, int64_t head_dim) {
    if (!bf16_model) return (const float *)cache + offset;
    widen_bf16(wide + first * head_dim, (const bf16 *)cache + offset + first * head_dim, (length - first) * head_dim);
    return wide;
}

/* decode_attention for float32 keys, values and output, or for a bf16 model (`bf16_model`: keys, values and
 * output bf16) as the engine's torch ops compute its attention: scores in float32 over the keys widened
 * (exactly), the probabilities rounded to bf16 before they meet the values, the products summed in float32
 * (keys and values widened to float32 per row and kv head, a few KB that stay in cache, so the cache is
 * read at half the bytes), the output rounded once.
 *
 * The rows of a group (`order[starts[i]..starts[i+1]-1]`: a GRPO group's responses, whose rows hold copies
 * of one prompt's keys and values) read positions 0..shared[i]-1 once, from the group's first row, for all
 * their query heads; each row reads the rest from its own. Every score and every output is the same chain of
 * operations as when each row reads all of its own (the shared span is cut to a multiple of VL, where the
 * scoring's vector blocks start anyway, and the weighted sums go on from where the shared span left them),
 * so the results are bit for bit those of rows read one by one. order == NULL: every row on its own. */
static inline __attribute__((always_inline)) void attention(
    const float *q, const void *keys, const void *values, int bf16_model, const int64_t *positions, void *out,
    int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t cache_len, float scale,
    const int64_t *order, const int64_t *starts, const int64_t *shared, int64_t groups) {
    int64_t group = heads / kv_heads, columns = WEIGH_VECTORS * VL;
    int vector_scores = head_dim % VL == 0, vector_sums = head_dim % columns == 0;
    if (order == NULL) groups = rows;
#pragma omp parallel
    {
        float *scores = NULL, *wide_keys = NULL, *wide_values = NULL, *queries = NULL, *summed = NULL;
        int64_t scores_room = 0, keys_room = 0, values_room = 0, queries_room = 0, summed_room = 0;
#pragma omp for schedule(dynamic)  /* rows of very different lengths */
        for (int64_t item = 0; item < groups * kv_heads; item++) {
            int64_t index = item / kv_heads, g = item % kv_heads;
            const int64_t *members = order ? order + starts[index] : &index;
            int64_t n = order ? starts[index + 1] - starts[index] : 1, longest = 0, shortest = INT64_MAX;
            for (int64_t m = 0; m < n; m++) {
                int64_t length = positions[members[m]] + 1;
                longest = length > longest ? length : longest;
                shortest = length < shortest ? length : shortest;
            }
            int64_t common = n > 1 && vector_scores && vector_sums ? (shared[index] < shortest ? shared[index] : shortest) : 0;
            common -= common % VL;
            int64_t stride = longest, group_heads = n * group;  /* scores[(m * group + h) * stride + j] */
            at_least(&scores, &scores_room, group_heads * stride);
            at_least(&summed, &summed_room, group_heads * head_dim);
            if (bf16_model) {
                at_least(&wide_keys, &keys_room, longest * head_dim);
                at_least(&wide_values, &values_room, longest * head_dim);
            }
            int64_t first_row = (members[0] * kv_heads + g) * cache_len * head_dim;
            if (common) {  /* every member's query heads, side by side, against the shared keys */
                at_least(&queries, &queries_room, group_heads * head_dim);
                for (int64_t m = 0; m < n; m++)
                    memcpy(queries + m * group * head_dim, q + (members[m] * heads + g * group) * head_dim,
                           group * head_dim * sizeof(float));
                const float *k = positions_as_float(keys, bf16_model, wide_keys, first_row, 0, common, head_dim);
                score_key_vectors(scores, queries, k, group_heads, 0, common, stride, head_dim, scale);
            }
            for (int64_t m = 0; m < n; m++) {
                int64_t row = members[m], length = positions[row] + 1;
                const float *query = q + (row * heads + g * group) * head_dim;
                const float *k = positions_as_float(keys, bf16_model, wide_keys, (row * kv_heads + g) * cache_len * head_dim,
                                                    common, length, head_dim);
                float *row_scores = scores + m * group * stride;
                if (vector_scores)
                    score_key_vectors(row_scores, query, k, group, common, length, stride, head_dim, scale);
                else
                    score_keys(row_scores, query, k, group, common, length, stride, head_dim, scale);
                for (int64_t h = 0; h < group; h++) {
                    float *p = row_scores + h * stride, max = p[0], sum = 0.0f;
#pragma omp simd reduction(max : max)
                    for (int64_t j = 1; j < length; j++) max = p[j] > max ? p[j] : max;
#pragma omp simd reduction(+ : sum)
                    for (int64_t j = 0; j < length; j++) {
                        p[j] = exp_clamped(p[j] - max);
                        sum += p[j];
                    }
                    float inv = 1.0f / sum;
                    for (int64_t j = 0; j < length; j++) p[j] *= inv;
                    if (bf16_model)
                        for (int64_t j = 0; j < length; j++) p[j] = bf16_to_float(float_to_bf16(p[j]));
                }
            }
            if (common) {
                const float *v = positions_as_float(values, bf16_model, wide_values, first_row, 0, common, head_dim);
                for (int64_t h = 0; h < group_heads; h += WEIGH_HEADS)
                    for (int64_t c = 0; c < head_dim; c += columns)
                        weigh_value_vectors(summed + h * head_dim, scores + h * stride, v,
                                            group_heads - h < WEIGH_HEADS ? group_heads - h : WEIGH_HEADS, 0, common,
                                            stride, head_dim, c, 0);
            }
            for (int64_t m = 0; m < n; m++) {
                int64_t row = members[m], length = positions[row] + 1;
                const float *v = positions_as_float(values, bf16_model, wide_values,
                                                    (row * kv_heads + g) * cache_len * head_dim, common, length, head_dim);
                float *o = summed + m * group * head_dim;
                const float *weights = scores + m * group * stride;
                if (vector_sums) {
                    for (int64_t h = 0; h < group; h += WEIGH_HEADS)
                        for (int64_t c = 0; c < head_dim; c += columns)
                            weigh_value_vectors(o + h * head_dim, weights + h * stride, v,
                                                group - h < WEIGH_HEADS ? group - h : WEIGH_HEADS, common, length,
                                                stride, head_dim, c, common > 0);
                } else {
                    for (int64_t h = 0; h < group; h++) weigh_values(o + h * head_dim, weights + h * stride, v, length, head_dim);
                }
                int64_t first = (row * heads + g * group) * head_dim;  /* of the row's output for this kv head */
                if (bf16_model)
                    for (int64_t i = 0; i < group * head_dim; i++) ((bf16 *)out)[first + i] = float_to_bf16(o[i]);
                else
                    memcpy((float *)out + first, o, group * head_dim * sizeof(float));
            }
        }
        free(scores);
        free(wide_keys);
        free(wide_values);
        free(queries);
        free(summed);
    }
}

/* One query per row over cache positions 0..positions[r]; out [rows, heads * head_dim].
 *
 * The query heads that share a kv head are scored one after the other while their keys are in cache,
 * and their outputs accumulated together, each value vector loaded once for several heads. Scores
 * and softmax in float32 as SDPA's CPU kernel computes them (max subtracted, sum, divide). Groups of rows
 * (order, starts, shared; NULL: none) read a shared prompt once: see `attention`. */
void decode_attention_f32(const float *q, const float *keys, const float *values, const int64_t *positions,
                          float *out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                          int64_t cache_len, float scale, const int64_t *order, const int64_t *starts,
                          const int64_t *shared, int64_t groups) {
    attention(q, keys, values, 0, positions, out, rows, heads, kv_heads, head_dim, cache_len, scale, order, starts,
              shared, groups);
}

/* decode_attention for a bf16 model: q float32 (widened), keys, values and out bf16. */
void decode_attention_bf16(const float *q, const bf16 *keys, const bf16 *values, const int64_t *positions,
                           bf16 *out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                           int64_t cache_len, float scale, const int64_t *order, const int64_t *starts,
                           const int64_t *shared, int64_t groups) {
    attention(q, keys, values, 1, positions, out, rows, heads, kv_heads, head_dim, cache_len, scale, order, starts,
              shared, groups);
}

/* ---- Linear layers: out = x . W^T (+ bias), for a few dozen rows of x.
 *
 * With 16 rows, each weight read from memory takes part in only 16 multiply-adds, so the product is
 * as much a stream through the weights as arithmetic. Here each weight is read once per call from a
 * layout that streams: W cut into panels of PANEL_ROWS output features, each panel stored k-major
 * ([k][PANEL_ROWS]), and a panel meets the (transposed) rows of x while those sit in cache. The
 * inner step broadcasts one weight of each of a panel's features against 16 rows of x, for two panels at a
 * time where two remain (one core reads two streams from memory faster than one): with AVX2, three
 * features a panel, twelve 8-wide multiply-adds for two loads of x, which the CPU's two FMA units can keep
 * up with; with AVX512, twelve features a panel, twenty-four 16-wide multiply-adds for one load (fewer
 * would leave the FMA units waiting on each chain's previous result). Each output is one chain of
 * multiply-adds over k in order, so both give the same results.
 *
 * Layouts (float32, C-contiguous):
 *   panels  [ceil(n / PANEL_ROWS)][k][PANEL_ROWS]   rows past n are zero (pack_panels writes the rest)
 *   x       [m, k],  out [m, n],  bias [n] or NULL
 */

#ifdef __AVX512F__
#define PANEL_ROWS 12
#define ROW_PADDING 16 /* x's transpose is padded with zero rows to a multiple of this: whole vector loads */
#else
#define PANEL_ROWS 3
#define ROW_PADDING 8
#endif
#define PANELS_AT_ONCE 2 /* panel_block_pair where two panels remain */
#define TOKEN_CHUNK 64 /* rows of x per pass over the weights: their transpose (k x 64) stays in L2 */
/* With the hardware prefetcher alone the product waited on memory, most of all with two ranks streaming
 * their weights at once (docs/benchmarks.md's decode_linears figures), so the weights are requested ahead of use, by the
 * first pass over a pair of panels (the passes over its other rows of x find it in cache). A fixed
 * distance ahead lands, for most k, in the panel the other stream is reading already: each weight
 * requests the one at its place in the next pair instead, read one pair's time later whatever k, into L2
 * (hint 2), not L1, which holds this pair and x's transpose. A prefetch past the end never faults. */
#define PREFETCH_NEXT_PAIR(w, panel_length) __builtin_prefetch((w) + PANELS_AT_ONCE * (panel_length), 0, 2)
/* The same for the two streams of a pair, at w and w2. */
#define PREFETCH_NEXT_PAIRS(w, w2, panel_length) \
    (PREFETCH_NEXT_PAIR(w, panel_length), PREFETCH_NEXT_PAIR(w2, panel_length))

typedef float v8 __attribute__((vector_size(32)));

/* The panels' width in features, for the Python side that allocates them. */
int panel_rows(void) { return PANEL_ROWS; }

/* Writes the `rows` rows of weight [rows, k] into the panels as output features first_row... */
void pack_panels(const float *weight, int64_t rows, int64_t k, int64_t first_row, float *panels) {
    int64_t first_panel = first_row / PANEL_ROWS, end_panel = (first_row + rows + PANEL_ROWS - 1) / PANEL_ROWS;
#pragma omp parallel for if (rows * k >= PARALLEL_FROM)
    for (int64_t p = first_panel; p < end_panel; p++) {
        int64_t lo = p * PANEL_ROWS > first_row ? p * PANEL_ROWS : first_row;
        int64_t hi = (p + 1) * PANEL_ROWS < first_row + rows ? (p + 1) * PANEL_ROWS : first_row + rows;
        float *panel = panels + p * k * PANEL_ROWS;
        const float *src = weight + (lo - first_row) * k;
        if (hi - lo == PANEL_ROWS) {  /* the six rows read side by side, the panel written in order */
            for (int64_t kk = 0; kk < k; kk++)
                for (int r = 0; r < PANEL_ROWS; r++) panel[kk * PANEL_ROWS + r] = src[r * k + kk];
        } else {
            for (int64_t row = lo; row < hi; row++)
                for (int64_t kk = 0; kk < k; kk++) panel[kk * PANEL_ROWS + row % PANEL_ROWS] = src[(row - lo) * k + kk];
        }
    }
}

#ifdef __AVX512F__
/* out[t][r] for one panel's features r and 16 transposed rows t of x (rows past x's end are the zero
 * padding; `half` is for the AVX2 build, whose padding is 8 rows). */
static inline void panel_block(const float *restrict panel, const float *restrict xt, int64_t ld, int64_t k,
                               int half __attribute__((unused)), float out[PANEL_ROWS][16]) {
    vf acc[PANEL_ROWS] = {0};
    for (int64_t kk = 0; kk < k; kk++) {
        vf x = *(const vf *)(xt + kk * ld);
        const float *w = panel + kk * PANEL_ROWS;
#pragma GCC unroll 12
        for (int r = 0; r < PANEL_ROWS; r++) acc[r] += x * w[r];
    }
#pragma GCC unroll 12
    for (int r = 0; r < PANEL_ROWS; r++) *(vf *)out[r] = acc[r];
}

/* panel_block for two neighbouring panels at once: the same chains, but two streams through memory,
 * which one core reads faster than one stream (24 of the 32 vector registers hold the sums); `prefetch`:
 * request the next pair's weights. */
static inline void panel_block_pair(const float *restrict panel, const float *restrict xt, int64_t ld, int64_t k,
                                    int half __attribute__((unused)), int prefetch, float out[2][PANEL_ROWS][16]) {
    vf acc[PANEL_ROWS] = {0}, acc2[PANEL_ROWS] = {0};
    const float *panel2 = panel + k * PANEL_ROWS;
    for (int64_t kk = 0; kk < k; kk++) {
        vf x = *(const vf *)(xt + kk * ld);
        const float *w = panel + kk * PANEL_ROWS, *w2 = panel2 + kk * PANEL_ROWS;
        if (prefetch) PREFETCH_NEXT_PAIRS(w, w2, k * PANEL_ROWS); /* loop-invariant: the loop is unswitched */
#pragma GCC unroll 12
        for (int r = 0; r < PANEL_ROWS; r++) {
            acc[r] += x * w[r];
            acc2[r] += x * w2[r];
        }
    }
#pragma GCC unroll 12
    for (int r = 0; r < PANEL_ROWS; r++) {
        *(vf *)out[0][r] = acc[r];
        *(vf *)out[1][r] = acc2[r];
    }
}
#else
/* out[t][r] for one panel's three features r and 16 (or, with `half`, 8) transposed rows t of x. */
static inline void panel_block(const float *restrict panel, const float *restrict xt, int64_t ld, int64_t k, int half,
                               float out[PANEL_ROWS][16]) {
    v8 a0 = {0}, a1 = {0}, a2 = {0}, b0 = {0}, b1 = {0}, b2 = {0};
    for (int64_t kk = 0; kk < k; kk++) {
        v8 x0 = *(const v8 *)(xt + kk * ld), x1 = half ? (v8){0} : *(const v8 *)(xt + kk * ld + 8);
        const float *w = panel + kk * PANEL_ROWS;
        a0 += x0 * w[0], b0 += x1 * w[0], a1 += x0 * w[1], b1 += x1 * w[1], a2 += x0 * w[2], b2 += x1 * w[2];
    }
    v8 *o = (v8 *)out;
    o[0] = a0, o[1] = b0, o[2] = a1, o[3] = b1, o[4] = a2, o[5] = b2;
}

/* panel_block for two neighbouring panels at once, two streams through memory (12 of the 16 vector
 * registers hold the sums; with `half`, 6); `prefetch`: request the next pair's weights. */
static inline void panel_block_pair(const float *restrict panel, const float *restrict xt, int64_t ld, int64_t k,
                                    int half, int prefetch, float out[2][PANEL_ROWS][16]) {
    v8 a0 = {0}, a1 = {0}, a2 = {0}, b0 = {0}, b1 = {0}, b2 = {0};  /* the first panel's */
    v8 c0 = {0}, c1 = {0}, c2 = {0}, d0 = {0}, d1 = {0}, d2 = {0};  /* the second's */
    const float *panel2 = panel + k * PANEL_ROWS;
    if (half) { /* 8 rows: no second vector of x, and no multiply-adds with its padding */
        for (int64_t kk = 0; kk < k; kk++) {
            v8 x0 = *(const v8 *)(xt + kk * ld);
            const float *w = panel + kk * PANEL_ROWS, *w2 = panel2 + kk * PANEL_ROWS;
            if (prefetch) PREFETCH_NEXT_PAIRS(w, w2, k * PANEL_ROWS);
            a0 += x0 * w[0], a1 += x0 * w[1], a2 += x0 * w[2];
            c0 += x0 * w2[0], c1 += x0 * w2[1], c2 += x0 * w2[2];
        }
    } else {
        for (int64_t kk = 0; kk < k; kk++) {
            v8 x0 = *(const v8 *)(xt + kk * ld), x1 = *(const v8 *)(xt + kk * ld + 8);
            const float *w = panel + kk * PANEL_ROWS, *w2 = panel2 + kk * PANEL_ROWS;
            if (prefetch) PREFETCH_NEXT_PAIRS(w, w2, k * PANEL_ROWS);
            a0 += x0 * w[0], b0 += x1 * w[0], a1 += x0 * w[1], b1 += x1 * w[1], a2 += x0 * w[2], b2 += x1 * w[2];
            c0 += x0 * w2[0], d0 += x1 * w2[0], c1 += x0 * w2[1], d1 += x1 * w2[1], c2 += x0 * w2[2], d2 += x1 * w2[2];
        }
    }
    v8 *o = (v8 *)out[0], *o2 = (v8 *)out[1];
    o[0] = a0, o[1] = b0, o[2] = a1, o[3] = b1, o[4] = a2, o[5] = b2;
    o2[0] = c0, o2[1] = d0, o2[2] = c1, o2[3] = d1, o2[4] = c2, o2[5] = d2;
}
#endif

#ifdef __AVX512F__
#define FEW_ROWS 4 /* up to this many rows of x: few_rows_linear */

/* out[t][0..11] for rows t < `rows` of x and one panel, each row's twelve sums in one vector (four lanes idle). */
static inline __attribute__((always_inline)) void few_rows_panel(const float *restrict panel, int64_t k,
                                                                const float *restrict x, int rows, int64_t features,
                                                                const float *bias, float *restrict out, int64_t n) {
    __m512 acc[FEW_ROWS];
    __mmask16 lanes = (__mmask16)((1u << PANEL_ROWS) - 1), keep = (__mmask16)((1u << features) - 1);
    for (int t = 0; t < rows; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k; kk++) {
        __m512 w = _mm512_maskz_loadu_ps(lanes, panel + kk * PANEL_ROWS);
        __builtin_prefetch(panel + (k + kk) * PANEL_ROWS, 0, 2); /* the next panel's, one panel's time ahead */
        for (int t = 0; t < rows; t++) acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(x[t * k + kk]), w, acc[t]);
    }
    for (int t = 0; t < rows; t++) {
        __m512 sums = bias ? _mm512_add_ps(acc[t], _mm512_maskz_loadu_ps(keep, bias)) : acc[t];
        _mm512_mask_storeu_ps(out + t * n, keep, sums);
    }
}

/* panel_linear for at most FEW_ROWS rows: the panels' usual product pads x to 16 rows, 16 times the multiply-adds
 * of one row, where a step with a few requests left should only stream the weights. Each output is the same
 * chain of multiply-adds over k in order, so the results are the usual product's, bit for bit. */
static void few_rows_linear(const float *x, int64_t m, int64_t k, const float *panels, int64_t n, const float *bias,
                            float *out) {
    int64_t n_panels = (n + PANEL_ROWS - 1) / PANEL_ROWS;
#pragma omp parallel for schedule(static) if (n_panels * k * m >= PARALLEL_FROM)
    for (int64_t p = 0; p < n_panels; p++) {
        int64_t features = n - p * PANEL_ROWS < PANEL_ROWS ? n - p * PANEL_ROWS : PANEL_ROWS;
        const float *panel = panels + p * k * PANEL_ROWS, *panel_bias = bias ? bias + p * PANEL_ROWS : NULL;
        switch (m) { /* a loop unrolled for each count */
        case 1: few_rows_panel(panel, k, x, 1, features, panel_bias, out + p * PANEL_ROWS, n); break;
        case 2: few_rows_panel(panel, k, x, 2, features, panel_bias, out + p * PANEL_ROWS, n); break;
        case 3: few_rows_panel(panel, k, x, 3, features, panel_bias, out + p * PANEL_ROWS, n); break;
        default: few_rows_panel(panel, k, x, 4, features, panel_bias, out + p * PANEL_ROWS, n); break;
        }
    }
}
#endif

/* out = x . W^T (+ bias) with W given as panels. Returns 0, or 1 if the scratch could not be allocated. */
int panel_linear(const float *x, int64_t m, int64_t k, const float *panels, int64_t n, const float *bias, float *out) {
#ifdef __AVX512F__
    if (m <= FEW_ROWS) {
        few_rows_linear(x, m, k, panels, n, bias, out);
        return 0;
    }
#endif
    static __thread float *scratch = NULL; /* x's transpose, 32-byte aligned for the vector loads */
    static __thread int64_t capacity = 0;
    int64_t needed = k * TOKEN_CHUNK;
    if (needed > capacity) {
        free(scratch);
        scratch = aligned_alloc(32, (size_t)needed * sizeof(float)); /* a multiple of 32 bytes: TOKEN_CHUNK is */
        capacity = scratch ? needed : 0;
        if (!scratch) return 1;
    }
    float *xt = scratch; /* `scratch` is this thread's: the pool's threads read it through xt */
    int64_t n_panels = (n + PANEL_ROWS - 1) / PANEL_ROWS;
    for (int64_t t0 = 0; t0 < m; t0 += TOKEN_CHUNK) {
        int64_t width = m - t0 < TOKEN_CHUNK ? m - t0 : TOKEN_CHUNK, ld = (width + ROW_PADDING - 1) / ROW_PADDING * ROW_PADDING;
        for (int64_t kk = 0; kk < k; kk++) {
            for (int64_t t = 0; t < width; t++) xt[kk * ld + t] = x[(t0 + t) * k + kk];
            for (int64_t t = width; t < ld; t++) xt[kk * ld + t] = 0.0f;
        }
#pragma omp parallel for schedule(static) if (n_panels * k * width >= PARALLEL_FROM)
        for (int64_t first = 0; first < n_panels; first += PANELS_AT_ONCE) {
            float block[2][PANEL_ROWS][16] __attribute__((aligned(64)));
            int64_t pair = first + 1 < n_panels;
            for (int64_t b = 0; b < width; b += 16) {
                if (pair)
                    panel_block_pair(panels + first * k * PANEL_ROWS, xt + b, ld, k, width - b <= 8, b == 0, block);
                else
                    panel_block(panels + first * k * PANEL_ROWS, xt + b, ld, k, width - b <= 8, block[0]);
                for (int64_t p = first; p <= first + pair; p++) {
                    int64_t features = n - p * PANEL_ROWS < PANEL_ROWS ? n - p * PANEL_ROWS : PANEL_ROWS;
                    for (int64_t t = b; t < width && t < b + 16; t++) {
                        float *row = out + (t0 + t) * n + p * PANEL_ROWS;
                        for (int64_t r = 0; r < features; r++) row[r] = block[p - first][r][t - b];
                        if (bias)
                            for (int64_t r = 0; r < features; r++) row[r] += bias[p * PANEL_ROWS + r];
                    }
                }
            }
        }
    }
    return 0;
}

/* ---- The same product for a bf16 model, on CPUs with AVX512-BF16.
 *
 * Half the bytes to stream, and its own layout: a vector holds sixteen output features, not sixteen rows
 * of x. Each feature's weights are stored in pairs along k, so one 64-byte load is a pair for each of a
 * panel's sixteen features, and one vdpbf16ps multiplies it with a row's pair of x (broadcast) and adds
 * both products to that row's sixteen float32 sums. A row's sums are then one vector, rounded and stored
 * in place: no transpose of x on the way in nor of the sums on the way out (which the float32 layout above
 * needs, and which cost a fifth of the product). The broadcast is the instruction's own memory operand
 * ({1to16}): as a separate broadcast the two instructions per multiply-add, not the multiply-adds, bound
 * the loop on a core that does two of them a cycle (AMD Zen 5). Up to sixteen rows share each load of the
 * weights, one accumulator each, and a panel meets every row of a 64-row chunk of x while in L1; fewer
 * rows (a decode step's last requests) take the loop with just as many accumulators, each still one
 * dependent chain, at the speed the weights stream in. A product of two bf16 is exact in float32 and each
 * addition rounds once, as a float32 product over the widened values would (with denormals flushed to
 * zero, as the instruction does); the bias (widened) is added to the sums, rounded to bf16 once, as
 * oneDNN's bf16 linear does.
 *
 * Layouts (bf16, C-contiguous), k2 = ceil(k / 2):
 *   panels  [ceil(n / BF16_PANEL_ROWS)][k2][BF16_PANEL_ROWS][2]   an odd k's last pair is (w, 0); features
 *                                                                 past n are zero (pack_panels_bf16 writes
 *                                                                 the rest)
 *   x       [m, k],  out [m, n],  bias [n] or NULL
 */

#define BF16_PANEL_ROWS 16 /* a vector of float32 sums */
#define BF16_ROW_BLOCK 16  /* rows of x that share a load of the weights: an accumulator each */

/* The panels' width in features where panel_linear_bf16 is built (AVX512-BF16); 0 where it is not. */
int bf16_panel_rows(void) {
#ifdef __AVX512BF16__
    return BF16_PANEL_ROWS;
#else
    return 0;
#endif
}

/* Writes the `rows` rows of weight [rows, k] into the panels as output features first_row... */
void pack_panels_bf16(const bf16 *weight, int64_t rows, int64_t k, int64_t first_row, bf16 *panels) {
    int64_t k2 = (k + 1) / 2, width = BF16_PANEL_ROWS;
    int64_t first_panel = first_row / width, end_panel = (first_row + rows + width - 1) / width;
#pragma omp parallel for if (rows * k >= PARALLEL_FROM)
    for (int64_t p = first_panel; p < end_panel; p++) {
        int64_t lo = p * width > first_row ? p * width : first_row;
        int64_t hi = (p + 1) * width < first_row + rows ? (p + 1) * width : first_row + rows;
        uint32_t *panel = (uint32_t *)(panels + p * k2 * width * 2);
        const bf16 *src = weight + (lo - first_row) * k;
        if (hi - lo == width && k % 2 == 0) { /* the panel written in order, its rows read side by side */
            for (int64_t kp = 0; kp < k2; kp++)
#pragma GCC unroll 16
                for (int r = 0; r < BF16_PANEL_ROWS; r++) memcpy(panel + kp * width + r, src + r * k + 2 * kp, 4);
        } else {
            for (int64_t row = lo; row < hi; row++)
                for (int64_t kp = 0; kp < k2; kp++) {
                    const bf16 *pair = src + (row - lo) * k + 2 * kp;
                    panel[kp * width + row % width] = pair[0] | (2 * kp + 1 < k ? (uint32_t)pair[1] << 16 : 0u);
                }
        }
    }
}

#ifdef __AVX512BF16__
/* float_to_bf16 of sixteen sums at once, bit for bit. */
static inline __m256i round_to_bf16(__m512 sums) {
    __m512i bits = _mm512_castps_si512(sums);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(sums, sums, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(rounded);
}

/* out[t][0..15] (the features `keep` marks) = rows t < `rows` of x times one panel, plus `bias` (16 features,
 * or NULL); `prefetch`: the weights to request into L2 meanwhile (the next panel), or NULL. */
static inline __attribute__((always_inline)) void bf16_panel_rows_block(const uint32_t *restrict panel, int64_t k,
                                                                       const bf16 *restrict x, int rows,
                                                                       const bf16 *bias, __mmask16 keep,
                                                                       const uint32_t *prefetch, bf16 *restrict out,
                                                                       int64_t n) {
    __m512 acc[BF16_ROW_BLOCK];
    for (int t = 0; t < rows; t++) acc[t] = _mm512_setzero_ps();
    int64_t whole_pairs = k / 2;
    for (int64_t kp = 0; kp < whole_pairs; kp++) {
        __m512bh weights = (__m512bh)_mm512_load_si512(panel + kp * BF16_PANEL_ROWS);
        if (prefetch) __builtin_prefetch(prefetch + kp * BF16_PANEL_ROWS, 0, 2);
#pragma GCC unroll 16
        for (int t = 0; t < rows; t++)
            __asm__("vdpbf16ps %[pair]%{1to16%}, %[weights], %[acc]"
                    : [acc] "+v"(acc[t])
                    : [weights] "v"(weights), [pair] "m"(*(const int32_t *)(x + t * k + 2 * kp)));
    }
    if (k % 2) { /* the last pair is (x, 0) against (w, 0) */
        __m512bh weights = (__m512bh)_mm512_load_si512(panel + whole_pairs * BF16_PANEL_ROWS);
        for (int t = 0; t < rows; t++)
            acc[t] = _mm512_dpbf16_ps(acc[t], (__m512bh)_mm512_set1_epi32(x[t * k + k - 1]), weights);
    }
    __m512 widened_bias = _mm512_setzero_ps();
    if (bias)
        widened_bias = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, bias)), 16));
    for (int t = 0; t < rows; t++)
        _mm256_mask_storeu_epi16(out + t * n, keep, round_to_bf16(bias ? _mm512_add_ps(acc[t], widened_bias) : acc[t]));
}
#endif

/* out = x . W^T (+ bias) with W given as bf16 panels. Returns 0; 2 where this library was built without
 * AVX512-BF16 (bf16_panel_rows() is then 0). */
int panel_linear_bf16(const bf16 *x, int64_t m, int64_t k, const bf16 *panels, int64_t n, const bf16 *bias,
                      bf16 *out) {
#ifndef __AVX512BF16__
    (void)x, (void)m, (void)k, (void)panels, (void)n, (void)bias, (void)out;
    return 2;
#else
    const uint32_t *pairs = (const uint32_t *)panels;
    int64_t k2 = (k + 1) / 2, n_panels = (n + BF16_PANEL_ROWS - 1) / BF16_PANEL_ROWS;
    for (int64_t t0 = 0; t0 < m; t0 += TOKEN_CHUNK) {
        int64_t end = m - t0 < TOKEN_CHUNK ? m : t0 + TOKEN_CHUNK;
#pragma omp parallel for schedule(static) if (n_panels * k * (end - t0) >= PARALLEL_FROM)
        for (int64_t p = 0; p < n_panels; p++) {
            const uint32_t *panel = pairs + p * k2 * BF16_PANEL_ROWS;
            const uint32_t *next = p + 1 < n_panels ? panel + k2 * BF16_PANEL_ROWS : NULL;
            int64_t features = n - p * BF16_PANEL_ROWS < BF16_PANEL_ROWS ? n - p * BF16_PANEL_ROWS : BF16_PANEL_ROWS;
            __mmask16 keep = (__mmask16)((1u << features) - 1);
            const bf16 *panel_bias = bias ? bias + p * BF16_PANEL_ROWS : NULL;
            for (int64_t t = t0; t < end; t += BF16_ROW_BLOCK) {
                const uint32_t *prefetch = t == t0 ? next : NULL; /* the first block streams the panel in */
                bf16 *block_out = out + t * n + p * BF16_PANEL_ROWS;
                switch (end - t < BF16_ROW_BLOCK ? end - t : BF16_ROW_BLOCK) { /* a loop unrolled for each count */
#define ROWS(r) \
    case r: bf16_panel_rows_block(panel, k, x + t * k, r, panel_bias, keep, prefetch, block_out, n); break;
                    ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
                    ROWS(9) ROWS(10) ROWS(11) ROWS(12) ROWS(13) ROWS(14) ROWS(15) ROWS(16)
#undef ROWS
                }
            }
        }
    }
    return 0;
#endif
}
