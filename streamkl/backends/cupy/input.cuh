// The prologue every CUDA source of this backend starts with: the device-function and
// dynamic-shared-memory macros (under the CPU emulators emulate.h defines them as host C++,
// STREAMKL_EMULATE), and the input dtype chosen by -DSTREAMKL_INPUT=0 (float32), 1 (float16) or
// 2 (bfloat16) with its exact conversion to float32. No system header: NVRTC needs no include path.
#pragma once

#ifndef STREAMKL_EMULATE
#define SK_DEVICE __device__ __forceinline__
#define SK_DYNAMIC_SMEM(name)                  \
    extern __shared__ float4 name##_float4[]; \
    float* name = reinterpret_cast<float*>(name##_float4)
typedef unsigned long long sk_u64;
#endif

#ifndef STREAMKL_INPUT
#define STREAMKL_INPUT 0
#endif

// ------------------------------------------------------------------------------------ input dtype
#if STREAMKL_INPUT == 0
typedef float input_t;
SK_DEVICE float to_float(float x) { return x; }
#elif STREAMKL_INPUT == 1
typedef unsigned short input_t;  // IEEE binary16 bits
SK_DEVICE float to_float(unsigned short bits) {
    const unsigned h = bits;
    const unsigned sign = (h & 0x8000u) << 16;
    const unsigned exponent = (h >> 10) & 0x1fu;
    const unsigned mantissa = h & 0x3ffu;
    if (exponent == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (mantissa << 13));  // inf, NaN
    if (exponent == 0u) {  // zero and subnormals: mantissa * 2^-24, exact in float32
        const float value = (float)mantissa * 5.9604644775390625e-08f;
        return sign ? -value : value;
    }
    return __uint_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}
#else
typedef unsigned short input_t;  // bfloat16 bits: the high half of a float32
SK_DEVICE float to_float(unsigned short bits) { return __uint_as_float(((unsigned)bits) << 16); }
#endif
