/* Includes KERNELS (the name of a header written over an element type) once for float32 and once for
 * bf16, defining for each:
 *   ELEMENT        the element type
 *   NAME(base)     base with the dtype's suffix, _f32 or _bf16
 *   LOAD(v)        an ELEMENT as float; STORE(f) a float rounded to an ELEMENT (as torch rounds)
 * Usage: #define KERNELS "my_kernels.h", then #include "per_dtype.h". No include guard, on purpose. */

#include "bf16.h" /* bf16, bf16_to_float, float_to_bf16 */

#define ELEMENT float
#define NAME(base) base##_f32
#define LOAD(v) (v)
#define STORE(f) (f)
#include KERNELS
#undef ELEMENT
#undef NAME
#undef LOAD
#undef STORE

#define ELEMENT bf16
#define NAME(base) base##_bf16
#define LOAD(v) bf16_to_float(v)
#define STORE(f) float_to_bf16(f)
#include KERNELS
#undef ELEMENT
#undef NAME
#undef LOAD
#undef STORE
#undef KERNELS
