/* Math shared by RL2's C kernels (RL2/native/build.py adds this folder to the include path). */
#ifndef RL2_FAST_MATH_H
#define RL2_FAST_MATH_H

#include <math.h>
#include <stdint.h>

/* expf(x) for -87 <= x <= 88, within 1 ulp (0.89 at worst against exp in double); x is clamped to that
 * range (exp(-87) ~ 1.6e-38 stands in for smaller results, exp(88) ~ 1.7e38 for larger ones).
 * Branch-free, so that the compiler vectorises loops calling it; glibc's expf is a scalar call. */
static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);  /* not fminf/fmaxf: their NaN rules block vectorising */
    /* x = n ln2 + r with |r| <= ln2 / 2; exp(r) by its Taylor polynomial to degree 7. */
    float n = nearbyintf(x * 1.44269504088896341f);
    float r = fmaf(n, -0.693359375f, x);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.98412698e-4f;
    p = fmaf(p, r, 1.38888889e-3f);
    p = fmaf(p, r, 8.33333333e-3f);
    p = fmaf(p, r, 4.16666667e-2f);
    p = fmaf(p, r, 1.66666667e-1f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    /* 2^n from n's bits: n + 1.5 * 2^23 holds n in its low mantissa bits, exactly for these n. Not a
     * float-to-int conversion, which is undefined for the NaN that x passes the clamp as; then these
     * bits are junk, but unsigned arithmetic on them is defined, and p, thus the result, is NaN. */
    union { float f; uint32_t i; } shifted = { .f = n + 12582912.0f };
    union { float f; uint32_t i; } scale = { .i = (shifted.i - 0x4B400000u + 127u) << 23 };
    return p * scale.f;
}

#endif
