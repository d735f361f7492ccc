/* The trainer's RMSNorm and SwiGLU activation on CPU, forward and backward, one pass each, in float32
 * and bfloat16.
 *
 * As torch ops, HF's RMSNorm is some ten kernels forward and backward, and silu(gate) * up five; each
 * reads and writes whole [tokens, width] tensors (in bfloat16, each also converting to float32 and
 * back), so between the matmuls of a decoder layer the core mostly waits on memory. Here each is one
 * pass over its inputs (the gain is in docs/benchmarks.md's rows of `benchmarks/bench_fused_layers.py`).
 * Built and loaded by fused_layers.py; where it cannot be built, the models run HF's own code.
 *
 * All tensors are C-contiguous and of one dtype (rstd is float32 in both): x, out, grad_x, grad_out
 * [rows, dim]; rstd [rows]; weight, grad_weight [dim]; gate, up and their gradients are flat, n
 * elements each. Functions end in _f32 or _bf16 by that dtype.
 */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"      /* bf16, bf16_to_float, float_to_bf16 */
#include "fast_math.h" /* exp_clamped */

/* Elements from which the loops run on all threads; below it, waking them costs more than it saves. */
#define PARALLEL_FROM 32768
/* Elements per block of the flat loops: a block of each input stays in L1. */
#define BLOCK 2048

#define KERNELS "fused_layers_kernels.h"
#include "per_dtype.h"
