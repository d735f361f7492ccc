/* Attention of a packed row whose sequences share prefixes (shared_prefix.py), forward and backward, in
 * float32 arithmetic on float32 or bf16 tensors, on CPU.
 *
 * Every query token t sees two runs of keys: a prefix run [prefix_start[t], prefix_end[t]) (empty for a
 * token of a prefix or of a sequence that shares none) and its own run [own_start[t], t], causally. As
 * torch ops that is one SDPA call per prefix and per branch (a group of 4 responses: 5 calls, and a
 * concatenation of keys per branch, per layer), each too small for SDPA's blocked kernel to run at
 * speed, with bf16 inputs upcast per call. Here a whole row is one call: queries are taken a tile at a
 * time (up to TILE consecutive tokens that see the same runs, times the query heads of one kv head), and
 * the products are small matrix products over the keys of the tile's runs, held in float32 in cache.
 *
 * Forward keeps the log-sum-exp of every query's scores; backward recomputes the probabilities from it
 * (as flash attention does) and takes delta = sum_j P_j dP_j, the exact value of dO . O, so the output
 * itself is not kept.
 *
 * Layouts (C-contiguous; ELEMENT float32 or bf16 by the `bf16` flag):
 *   q, grad_q          [T, heads, head_dim]      ELEMENT
 *   k, v, grad_k/v     [T, kv_heads, head_dim]   ELEMENT
 *   out, grad_out      [T, heads, head_dim]      ELEMENT
 *   lse                [T, heads]                float32
 *   runs               [3, T] int64: prefix_start, prefix_end, own_start
 * head_dim must be a multiple of COLUMNS (prefix_attention_columns()).
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"      /* bf16, bf16_to_float, float_to_bf16 */
#include "fast_math.h" /* exp_clamped */

/* Block sizes: rows of weigh_rows and keys of accumulate_rows (BLOCK, times four vectors of columns),
 * query rows of dot_columns (ROW_BLOCK, times two vectors), as many accumulators as the vector
 * registers hold beside the operands; the AVX2 ones were the fastest of the sizes around them on W1's
 * row (benchmarks/bench_prefix_attention.py --isa avx2). */
#ifdef __AVX512F__
#define VL 16
#define BLOCK 4     /* 16 of the 32 vector registers */
#define ROW_BLOCK 6 /* 12 */
#else
#define VL 8
#define BLOCK 3     /* 12 of AVX2's 16 */
#define ROW_BLOCK 4 /* 8 */
#endif
#define COLUMNS (4 * VL) /* head_dim is taken this many columns at a time: four vectors */
#define TILE 4            /* query tokens per tile */

typedef float vf __attribute__((vector_size(VL * 4), aligned(4)));

int prefix_attention_columns(void) { return COLUMNS; }

/* n consecutive elements of x (float32 or bf16) from element `first`, as float32 into dst. */
static void widen_run(float *restrict dst, const void *x, int64_t first, int64_t n, int bf16_data) {
    if (!bf16_data) {
        memcpy(dst, (const float *)x + first, n * sizeof(float));
        return;
    }
    const bf16 *src = (const bf16 *)x + first;
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_float(src[i]);
}

/* n float32 values of src into x (float32 or bf16) from element `first`, rounded once. */
static void narrow_run(void *x, int64_t first, const float *restrict src, int64_t n, int bf16_data) {
    if (!bf16_data) {
        memcpy((float *)x + first, src, n * sizeof(float));
        return;
    }
    bf16 *dst = (bf16 *)x + first;
    for (int64_t i = 0; i < n; i++) dst[i] = float_to_bf16(src[i]);
}

#define TRANSPOSE_BLOCK 16 /* tokens per pass of widen_head: one cache line of each transposed row */

/* One kv head of k or v [T, kv_heads, D] as float32, rows [T][D] and/or transposed [D][ld] (ld >= T + VL,
 * the columns past T zero, so that whole vectors may be read past a run's end). The transpose goes
 * TRANSPOSE_BLOCK tokens at a time, so that each of its stores fills a cache line rather than touching
 * a new one D * ld floats apart. */
static void widen_head(const void *x, int64_t g, int64_t T, int64_t kv_heads, int64_t D, int bf16_data, float *rows,
                       float *transposed, int64_t ld) {
    float block[TRANSPOSE_BLOCK * D];
    for (int64_t t0 = 0; t0 < T; t0 += TRANSPOSE_BLOCK) {
        int64_t n = T - t0 < TRANSPOSE_BLOCK ? T - t0 : TRANSPOSE_BLOCK;
        float *widened = rows ? rows + t0 * D : block;
        for (int64_t i = 0; i < n; i++) widen_run(widened + i * D, x, ((t0 + i) * kv_heads + g) * D, D, bf16_data);
        if (transposed)
            for (int64_t d = 0; d < D; d++)
                for (int64_t i = 0; i < n; i++) transposed[d * ld + t0 + i] = widened[i * D + d];
    }
    if (transposed)
        for (int64_t d = 0; d < D; d++) memset(transposed + d * ld + T, 0, (ld - T) * sizeof(float));
}

/* The products below run in blocks of a size fixed at compile time (always inlined with constant
 * `rows`/`vectors`/`keys`), so that the compiler keeps every accumulator in a register and unrolls the
 * block; a loop bound or a branch known only at run time inside the block spills them to the stack.
 * A partial block at the end goes one row (or key) at a time. */
#define INLINE static inline __attribute__((always_inline))

/* s[r][0 .. vectors * VL) = scale * (a[r] . column[d * ld_b + ...]) for r < rows. */
INLINE void dot_block(float *restrict s, int64_t ld_s, const float *restrict a, int rows, int64_t D,
                      const float *restrict column, int64_t ld_b, int vectors, float scale) {
    vf acc[ROW_BLOCK][2] = {0};
    for (int64_t d = 0; d < D; d++) {
        vf b[2];
#pragma GCC unroll 2
        for (int v = 0; v < vectors; v++) b[v] = *(const vf *)(column + d * ld_b + v * VL);
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            float x = a[r * D + d];
#pragma GCC unroll 2
            for (int v = 0; v < vectors; v++) acc[r][v] += x * b[v];
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 2
        for (int v = 0; v < vectors; v++) *(vf *)(s + r * ld_s + v * VL) = acc[r][v] * scale;
}

INLINE void dot_rows(float *restrict s, int64_t ld_s, const float *restrict a, int64_t rows, int64_t D,
                     const float *restrict column, int64_t ld_b, int vectors, float scale) {
    int64_t r = 0;
    for (; r + ROW_BLOCK <= rows; r += ROW_BLOCK)
        dot_block(s + r * ld_s, ld_s, a + r * D, ROW_BLOCK, D, column, ld_b, vectors, scale);
    for (; r < rows; r++) dot_block(s + r * ld_s, ld_s, a + r * D, 1, D, column, ld_b, vectors, scale);
}

/* s[r][c] = scale * (a[r] . b[:, first + c]) for r < rows, c < n: a [rows][D], b transposed [D][ld].
 * Two vectors of columns for ROW_BLOCK rows at a time; whole vectors are written, up to VL - 1 columns
 * past n (s has room for them). */
static void dot_columns(float *restrict s, int64_t ld_s, const float *restrict a, int64_t rows, int64_t D,
                        const float *restrict b, int64_t ld_b, int64_t first, int64_t n, float scale) {
    int64_t c = 0;
    for (; c + VL < n; c += 2 * VL) dot_rows(s + c, ld_s, a, rows, D, b + first + c, ld_b, 2, scale);
    if (c < n) dot_rows(s + c, ld_s, a, rows, D, b + first + c, ld_b, 1, scale);
}

/* acc[i] = sum over j < n of w[i * w_i + j * w_j] * x[j] for i < count, over COLUMNS columns of the rows
 * x[j] (D apart): each row of x loaded once for all `count` sums. */
INLINE void weighted_sums(vf acc[BLOCK][4], const float *restrict w, int64_t w_i, int64_t w_j, int count,
                          const float *restrict x, int64_t n, int64_t D) {
    for (int64_t j = 0; j < n; j++) {
        vf row[4];
#pragma GCC unroll 4
        for (int q = 0; q < 4; q++) row[q] = *(const vf *)(x + j * D + q * VL);
#pragma GCC unroll 4
        for (int i = 0; i < count; i++) {
            float weight = w[i * w_i + j * w_j];
#pragma GCC unroll 4
            for (int q = 0; q < 4; q++) acc[i][q] += weight * row[q];
        }
    }
}

/* out[r][cols] (+)= sum over c < n of w[r][c] * b[c][cols] for r < rows, COLUMNS columns. */
INLINE void weigh_block(float *restrict out, const float *restrict w, int64_t ld_w, int rows,
                        const float *restrict b, int64_t n, int64_t D, int accumulate) {
    vf acc[BLOCK][4] = {0};
    weighted_sums(acc, w, ld_w, 1, rows, b, n, D);
#pragma GCC unroll 4
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 4
        for (int q = 0; q < 4; q++) {
            vf *o = (vf *)(out + r * D + q * VL);
            *o = accumulate ? *o + acc[r][q] : acc[r][q];
        }
}

/* out[r] (+)= sum over c < n of w[r][c] * b[first + c] for r < rows: w [rows][ld_w], b rows [T][D], out
 * [rows][D]. BLOCK rows and COLUMNS columns at a time, each row of b loaded once for them. */
static void weigh_rows(float *restrict out, const float *restrict w, int64_t ld_w, int64_t rows,
                       const float *restrict b, int64_t first, int64_t n, int64_t D, int accumulate) {
    for (int64_t col = 0; col < D; col += COLUMNS) {
        int64_t r = 0;
        for (; r + BLOCK <= rows; r += BLOCK)
            weigh_block(out + r * D + col, w + r * ld_w, ld_w, BLOCK, b + first * D + col, n, D, accumulate);
        for (; r < rows; r++)
            weigh_block(out + r * D + col, w + r * ld_w, ld_w, 1, b + first * D + col, n, D, accumulate);
    }
}

/* b[c][cols] += sum over r < rows of w[r][c] * a[r][cols] for c < keys, COLUMNS columns. */
INLINE void accumulate_block(float *restrict b, const float *restrict w, int64_t ld_w, const float *restrict a,
                             int64_t rows, int keys, int64_t D) {
    vf acc[BLOCK][4] = {0};
    weighted_sums(acc, w, 1, ld_w, keys, a, rows, D);
#pragma GCC unroll 4
    for (int c = 0; c < keys; c++)
#pragma GCC unroll 4
        for (int q = 0; q < 4; q++) *(vf *)(b + c * D + q * VL) += acc[c][q];
}

/* b[first + c] += sum over r < rows of w[r][c] * a[r] for c < n: the transposed product of weigh_rows,
 * into b [T][D]. BLOCK keys at a time, each row of a loaded once for them. */
static void accumulate_rows(float *restrict b, const float *restrict w, int64_t ld_w, const float *restrict a,
                            int64_t rows, int64_t first, int64_t n, int64_t D) {
    for (int64_t col = 0; col < D; col += COLUMNS) {
        int64_t c = 0;
        for (; c + BLOCK <= n; c += BLOCK)
            accumulate_block(b + (first + c) * D + col, w + c, ld_w, a + col, rows, BLOCK, D);
        for (; c < n; c++) accumulate_block(b + (first + c) * D + col, w + c, ld_w, a + col, rows, 1, D);
    }
}

/* A tile: tokens [t0, t1) that see the same runs, with the query heads h0 .. h0 + group of one kv head
 * as its rows (row = (t - t0) * group + h). Its keys are the prefix run, then own_start .. t1 - 1; a
 * score is the column of its key in that order. */
typedef struct {
    int64_t t0, t1, prefix_start, prefix_length, own_start, own_length, rows, columns;
} Tile;

static int64_t tile_end(const int64_t *runs, int64_t T, int64_t t0) {
    int64_t t1 = t0 + 1;
    while (t1 < T && t1 - t0 < TILE && runs[t1] == runs[t0] && runs[T + t1] == runs[T + t0] &&
           runs[2 * T + t1] == runs[2 * T + t0])
        t1++;
    return t1;
}

static Tile make_tile(const int64_t *runs, int64_t T, int64_t t0, int64_t group) {
    Tile tile = {.t0 = t0, .t1 = tile_end(runs, T, t0), .prefix_start = runs[t0]};
    tile.prefix_length = runs[T + t0] - runs[t0];
    tile.own_start = runs[2 * T + t0];
    tile.own_length = tile.t1 - tile.own_start;
    tile.rows = (tile.t1 - t0) * group;
    tile.columns = tile.prefix_length + tile.own_length;
    return tile;
}

/* The tile's rows of x [T, heads, D] (heads h0..) as float32 [rows][D]: group * D consecutive elements
 * a token. */
static void gather_rows(float *out, const void *x, const Tile *tile, int64_t h0, int64_t group, int64_t heads,
                        int64_t D, int bf16_data) {
    for (int64_t t = tile->t0; t < tile->t1; t++)
        widen_run(out + (t - tile->t0) * group * D, x, (t * heads + h0) * D, group * D, bf16_data);
}

/* The tile's scores (scale * q . k) over its keys into s [rows][ld_s], from keys transposed [D][ld_k];
 * scores of keys after their query's token are -inf. */
static void tile_scores(float *s, int64_t ld_s, const float *rows, const Tile *tile, const float *keys_t, int64_t ld_k,
                        int64_t D, int64_t group, float scale) {
    dot_columns(s, ld_s, rows, tile->rows, D, keys_t, ld_k, tile->prefix_start, tile->prefix_length, scale);
    dot_columns(s + tile->prefix_length, ld_s, rows, tile->rows, D, keys_t, ld_k, tile->own_start, tile->own_length,
                scale);
    for (int64_t r = 0; r < tile->rows; r++) {
        int64_t t = tile->t0 + r / group;
        for (int64_t c = tile->prefix_length + (t - tile->own_start) + 1; c < tile->columns; c++)
            s[r * ld_s + c] = -INFINITY;
    }
}

/* Scratch of one kv head's work: the widened keys and values, and a tile's rows and scores. */
typedef struct {
    float *keys, *keys_t, *values, *values_t, *grad_keys, *grad_values, *rows, *grad_rows, *result, *scores,
        *probs, *grad_probs;
    int64_t ld_t, ld_s;
} Scratch;

static int scratch_alloc(Scratch *w, int64_t T, int64_t D, int64_t group) {
    w->ld_t = T + VL;
    w->ld_s = T + 2 * VL;
    int64_t rows = TILE * group;
    float **buffers[] = {&w->keys, &w->keys_t, &w->values, &w->values_t, &w->grad_keys, &w->grad_values,
                         &w->rows, &w->grad_rows, &w->result, &w->scores, &w->probs, &w->grad_probs};
    int64_t sizes[] = {T * D, D * w->ld_t, T * D, D * w->ld_t, T * D, T * D,
                       rows * D, rows * D, rows * D, rows * w->ld_s, rows * w->ld_s, rows * w->ld_s};
    int ok = 1;
    for (int i = 0; i < 12; i++) {
        *buffers[i] = aligned_alloc(64, ((sizes[i] * sizeof(float) + 63) / 64) * 64);
        ok = ok && *buffers[i];
    }
    return ok;
}

static void scratch_free(Scratch *w) {
    float *buffers[] = {w->keys, w->keys_t, w->values, w->values_t, w->grad_keys, w->grad_values,
                        w->rows, w->grad_rows, w->result, w->scores, w->probs, w->grad_probs};
    for (int i = 0; i < 12; i++) free(buffers[i]);
}

/* The arguments of a call, shared by the work on each kv head. */
typedef struct {
    const void *q, *k, *v, *grad_out;
    const int64_t *runs;
    void *out, *grad_q, *grad_k, *grad_v;
    float *lse;
    int64_t T, heads, kv_heads, D, group;
    float scale;
    int bf16_data;
} Call;

/* The tile's rows of result [rows][D] into dst [T, heads, D] (out or grad_q), rounded once. */
static void store_rows(void *dst, const float *result, const Tile *tile, int64_t g, const Call *c) {
    for (int64_t t = tile->t0; t < tile->t1; t++)
        narrow_run(dst, (t * c->heads + g * c->group) * c->D, result + (t - tile->t0) * c->group * c->D,
                   c->group * c->D, c->bf16_data);
}

static float *lse_of(const Call *c, const Tile *tile, int64_t g, int64_t r) {
    return c->lse + (tile->t0 + r / c->group) * c->heads + g * c->group + r % c->group;
}

/* Runs `work` on each kv head, in parallel, each with scratch of its own; returns 0, or 1 when out of
 * memory (then the kv heads that got none were skipped). */
static int each_kv_head(const Call *c, void (*work)(const Call *, int64_t, Scratch *)) {
    int failed = 0;
#pragma omp parallel for schedule(dynamic) reduction(| : failed)
    for (int64_t g = 0; g < c->kv_heads; g++) {
        Scratch w;
        if (scratch_alloc(&w, c->T, c->D, c->group))
            work(c, g, &w);
        else
            failed = 1;
        scratch_free(&w);
    }
    return failed;
}

static void forward_head(const Call *c, int64_t g, Scratch *w) {
    int64_t T = c->T, D = c->D, group = c->group;
    widen_head(c->k, g, T, c->kv_heads, D, c->bf16_data, NULL, w->keys_t, w->ld_t);
    widen_head(c->v, g, T, c->kv_heads, D, c->bf16_data, w->values, NULL, 0);
    for (int64_t t0 = 0; t0 < T;) {
        Tile tile = make_tile(c->runs, T, t0, group);
        gather_rows(w->rows, c->q, &tile, g * group, group, c->heads, D, c->bf16_data);
        tile_scores(w->scores, w->ld_s, w->rows, &tile, w->keys_t, w->ld_t, D, group, c->scale);
        for (int64_t r = 0; r < tile.rows; r++) {
            float *s = w->scores + r * w->ld_s, max = s[0], sum = 0.0f;
#pragma omp simd reduction(max : max)
            for (int64_t j = 1; j < tile.columns; j++) max = s[j] > max ? s[j] : max;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < tile.columns; j++) {
                s[j] = exp_clamped(s[j] - max) * (s[j] != -INFINITY);
                sum += s[j];
            }
            float inv = 1.0f / sum;
            for (int64_t j = 0; j < tile.columns; j++) s[j] *= inv;
            *lse_of(c, &tile, g, r) = max + logf(sum);
        }
        weigh_rows(w->result, w->scores, w->ld_s, tile.rows, w->values, tile.prefix_start, tile.prefix_length, D, 0);
        weigh_rows(w->result, w->scores + tile.prefix_length, w->ld_s, tile.rows, w->values, tile.own_start,
                   tile.own_length, D, 1);
        store_rows(c->out, w->result, &tile, g, c);
        t0 = tile.t1;
    }
}

static void backward_head(const Call *c, int64_t g, Scratch *w) {
    int64_t T = c->T, D = c->D, group = c->group, ld = w->ld_s;
    widen_head(c->k, g, T, c->kv_heads, D, c->bf16_data, w->keys, w->keys_t, w->ld_t);
    widen_head(c->v, g, T, c->kv_heads, D, c->bf16_data, NULL, w->values_t, w->ld_t);
    memset(w->grad_keys, 0, T * D * sizeof(float));
    memset(w->grad_values, 0, T * D * sizeof(float));
    for (int64_t t0 = 0; t0 < T;) {
        Tile tile = make_tile(c->runs, T, t0, group);
        gather_rows(w->rows, c->q, &tile, g * group, group, c->heads, D, c->bf16_data);
        gather_rows(w->grad_rows, c->grad_out, &tile, g * group, group, c->heads, D, c->bf16_data);
        tile_scores(w->probs, ld, w->rows, &tile, w->keys_t, w->ld_t, D, group, c->scale);
        /* dP = dO . v over the same keys */
        dot_columns(w->grad_probs, ld, w->grad_rows, tile.rows, D, w->values_t, w->ld_t, tile.prefix_start,
                    tile.prefix_length, 1.0f);
        dot_columns(w->grad_probs + tile.prefix_length, ld, w->grad_rows, tile.rows, D, w->values_t, w->ld_t,
                    tile.own_start, tile.own_length, 1.0f);
        for (int64_t r = 0; r < tile.rows; r++) {
            float *p = w->probs + r * ld, *dp = w->grad_probs + r * ld, *ds = w->scores + r * ld, delta = 0.0f;
            float m = *lse_of(c, &tile, g, r);
#pragma omp simd reduction(+ : delta)
            for (int64_t j = 0; j < tile.columns; j++) {
                p[j] = exp_clamped(p[j] - m) * (p[j] != -INFINITY);
                delta += p[j] * dp[j];
            }
            /* dS = P (dP - delta), times the scale the scores were taken with */
            for (int64_t j = 0; j < tile.columns; j++) ds[j] = p[j] * (dp[j] - delta) * c->scale;
        }
        float *probs_own = w->probs + tile.prefix_length, *grads_own = w->scores + tile.prefix_length;
        accumulate_rows(w->grad_values, w->probs, ld, w->grad_rows, tile.rows, tile.prefix_start, tile.prefix_length, D);
        accumulate_rows(w->grad_values, probs_own, ld, w->grad_rows, tile.rows, tile.own_start, tile.own_length, D);
        accumulate_rows(w->grad_keys, w->scores, ld, w->rows, tile.rows, tile.prefix_start, tile.prefix_length, D);
        accumulate_rows(w->grad_keys, grads_own, ld, w->rows, tile.rows, tile.own_start, tile.own_length, D);
        weigh_rows(w->result, w->scores, ld, tile.rows, w->keys, tile.prefix_start, tile.prefix_length, D, 0);
        weigh_rows(w->result, grads_own, ld, tile.rows, w->keys, tile.own_start, tile.own_length, D, 1);
        store_rows(c->grad_q, w->result, &tile, g, c);
        t0 = tile.t1;
    }
    for (int64_t t = 0; t < T; t++) {
        narrow_run(c->grad_k, (t * c->kv_heads + g) * D, w->grad_keys + t * D, D, c->bf16_data);
        narrow_run(c->grad_v, (t * c->kv_heads + g) * D, w->grad_values + t * D, D, c->bf16_data);
    }
}

/* out and lse of every query; returns 0, or 1 when out of memory. */
int prefix_attention_forward(const void *q, const void *k, const void *v, const int64_t *runs, void *out, float *lse,
                             int64_t T, int64_t heads, int64_t kv_heads, int64_t D, float scale, int bf16_data) {
    Call c = {.q = q, .k = k, .v = v, .runs = runs, .out = out, .lse = lse, .T = T, .heads = heads,
              .kv_heads = kv_heads, .D = D, .group = heads / kv_heads, .scale = scale, .bf16_data = bf16_data};
    return each_kv_head(&c, forward_head);
}

/* grad_q, grad_k, grad_v from grad_out and the forward's lse; returns 0, or 1 when out of memory. */
int prefix_attention_backward(const void *q, const void *k, const void *v, const int64_t *runs, const float *lse,
                              const void *grad_out, void *grad_q, void *grad_k, void *grad_v, int64_t T,
                              int64_t heads, int64_t kv_heads, int64_t D, float scale, int bf16_data) {
    Call c = {.q = q, .k = k, .v = v, .grad_out = grad_out, .runs = runs, .grad_q = grad_q, .grad_k = grad_k,
              .grad_v = grad_v, .lse = (float *)lse, .T = T, .heads = heads, .kv_heads = kv_heads, .D = D,
              .group = heads / kv_heads, .scale = scale, .bf16_data = bf16_data};
    return each_kv_head(&c, backward_head);
}
