// Host emulation of the few CUDA constructs kernels.cu uses, so the same source runs on the CPU:
// one std::thread per CUDA thread, blocks run one after another, __syncthreads is a barrier.
// For tests without a GPU (STREAMKL_CUPY_EMULATE=1); never used on the GPU path.
#pragma once
#include <cmath>
#include <cstring>

#define STREAMKL_EMULATE 1
#define __global__
#define __launch_bounds__(n)
#define SK_DEVICE static inline
#define SK_DYNAMIC_SMEM(name) float* name = emu_shared_memory()

typedef unsigned long long sk_u64;

struct emu_dim3 {
    unsigned x, y, z;
};
extern thread_local emu_dim3 threadIdx;
extern thread_local emu_dim3 blockIdx;
extern emu_dim3 blockDim;
extern emu_dim3 gridDim;

struct alignas(16) float4 {
    float x, y, z, w;
};

void __syncthreads();
float* emu_shared_memory();

static inline float __uint_as_float(unsigned bits) {
    float value;
    std::memcpy(&value, &bits, sizeof value);
    return value;
}
