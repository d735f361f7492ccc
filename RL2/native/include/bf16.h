/* bfloat16 as RL2's C kernels load and store it: the upper half of a float32, rounded to nearest even
 * as torch rounds it. Branch-free, so that loops over whole rows vectorise. */
#ifndef RL2_BF16_H
#define RL2_BF16_H

#include <stdint.h>

typedef uint16_t bf16;

static inline float bf16_to_float(bf16 value) {
    union { uint32_t i; float f; } bits = { .i = (uint32_t)value << 16 };
    return bits.f;
}

static inline bf16 float_to_bf16(float value) {
    union { float f; uint32_t i; } bits = { .f = value };
    uint32_t rounded = bits.i + 0x7fffu + ((bits.i >> 16) & 1u);
    return value != value ? (bf16)0x7fc0 : (bf16)(rounded >> 16);  /* NaN stays a quiet NaN */
}

#endif
