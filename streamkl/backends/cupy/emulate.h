// Host emulation of the few CUDA constructs kernels.cu uses, so the same source runs on the CPU:
// one fiber per CUDA thread (emulate_runtime.h), blocks run one after another, __syncthreads is a
// barrier, and the warp-level primitives of warp_ops.cuh meet at a per-warp barrier over a per-warp
// scratch.
// For tests without a GPU (STREAMKL_CUPY_EMULATE=1); never used on the GPU path.
#pragma once
#include <atomic>
#include <cmath>
#include <cstddef>
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
extern emu_dim3 threadIdx;
extern emu_dim3 blockIdx;
extern emu_dim3 blockDim;
extern emu_dim3 gridDim;

struct alignas(16) float4 {
    float x, y, z, w;
};

void __syncthreads();
float* emu_shared_memory();

// warp_ops.cuh: EMU_SCRATCH_SLOTS 64-bit slots per lane of the calling thread's warp, and the
// barrier of that warp's 32 threads
#define EMU_SCRATCH_SLOTS 8
sk_u64* emu_warp_scratch();
void emu_warp_sync();
// cp.async: copies are queued per thread and done when a wait retires their group
void emu_cp_async(void* dst, const void* src, int bytes, int src_bytes);
void emu_cp_async_commit();
void emu_cp_async_wait(int pending);

static inline float atomicAdd(float* address, float value) { return std::atomic_ref<float>(*address).fetch_add(value); }
static inline unsigned __float_as_uint(float value) {
    unsigned bits;
    std::memcpy(&bits, &value, sizeof bits);
    return bits;
}
static inline float __uint_as_float(unsigned bits) {
    float value;
    std::memcpy(&value, &bits, sizeof value);
    return value;
}
