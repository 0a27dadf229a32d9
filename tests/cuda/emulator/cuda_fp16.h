/* cuda_fp16.h of the emulator (see cuda_runtime.h): the half type and its exact conversion. */
#ifndef KVLAB_EMULATED_CUDA_FP16_H
#define KVLAB_EMULATED_CUDA_FP16_H
#include <string.h>

struct __half { unsigned short bits; };
static inline __half __ushort_as_half(unsigned short bits) { return __half{bits}; }
static inline float __half2float(__half h) {
    _Float16 f;
    memcpy(&f, &h.bits, 2);
    return (float)f;   /* exact: every half is a float */
}
#endif
