// The host emulator's entry point: compiles kernels.cu as C++ and runs a launch on CPU threads.
#include "emulate.h"

#include <barrier>
#include <cstdlib>
#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include "kernels.cu"

thread_local emu_dim3 threadIdx;
thread_local emu_dim3 blockIdx;
emu_dim3 blockDim;
emu_dim3 gridDim;

static std::barrier<>* block_barrier = nullptr;
static float* shared_memory = nullptr;
static std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
static std::vector<sk_u64> warp_scratch;  // [warps][32 lanes][EMU_SCRATCH_SLOTS]

void __syncthreads() { block_barrier->arrive_and_wait(); }
float* emu_shared_memory() { return shared_memory; }
sk_u64* emu_warp_scratch() { return warp_scratch.data() + (threadIdx.x / 32) * 32 * EMU_SCRATCH_SLOTS; }
void emu_warp_sync() { warp_barriers[threadIdx.x / 32]->arrive_and_wait(); }

struct AsyncCopy {
    void* dst;
    const void* src;
    int bytes, src_bytes;
};
static thread_local std::vector<AsyncCopy> open_group;
static thread_local std::deque<std::vector<AsyncCopy>> committed_groups;

void emu_cp_async(void* dst, const void* src, int bytes, int src_bytes) {
    open_group.push_back({dst, src, bytes, src_bytes});
}

void emu_cp_async_commit() {
    committed_groups.push_back(std::move(open_group));
    open_group.clear();
}

void emu_cp_async_wait(int pending) {
    while ((int)committed_groups.size() > pending) {
        for (const AsyncCopy& copy : committed_groups.front()) {
            std::memcpy(copy.dst, copy.src, copy.src_bytes);
            std::memset(static_cast<char*>(copy.dst) + copy.src_bytes, 0, copy.bytes - copy.src_bytes);
        }
        committed_groups.pop_front();
    }
}

extern "C" int emu_params_size() { return (int)sizeof(KLParams); }

#if defined(SK_MMA_VARIANT) && STREAMKL_INPUT != 0
static void forward_mma(const KLParams p) { kl_forward_mma<SK_MMA_VARIANT>(p); }
#endif
#if defined(SK_MMA_BACKWARD) && STREAMKL_INPUT != 0
template <int SIDE1, int SIDE2>
static void dq_mma(const KLParams p) { kl_backward_dq_mma<SK_MMA_BACKWARD, SIDE1, SIDE2>(p); }
template <int SIDE1, int SIDE2, int DQ_ATOMIC>
static void dk_mma(const KLParams p) { kl_backward_dk_mma<SK_MMA_BACKWARD, SIDE1, SIDE2, DQ_ATOMIC>(p); }
#endif

// Runs `fn` over the grid, one std::thread per CUDA thread, block after block. Shared memory
// starts as NaN (in float32, float16 and bfloat16 alike) before every block, so a read of anything
// a block did not write shows up in the results.
typedef void (*kernel_fn)(const KLParams);

void emu_run(kernel_fn fn, int grid_x, int grid_y, int grid_z, int threads, long long smem_bytes,
             const KLParams* params) {
    const size_t words = (size_t)(smem_bytes + 3) / 4 + 4;
    unsigned* memory = static_cast<unsigned*>(std::aligned_alloc(64, ((words * 4 + 63) / 64) * 64));
    shared_memory = reinterpret_cast<float*>(memory);
    std::barrier<> barrier(threads);
    block_barrier = &barrier;
    warp_barriers.clear();
    for (int w = 0; w < (threads + 31) / 32; ++w) warp_barriers.push_back(std::make_unique<std::barrier<>>(32));
    warp_scratch.assign((size_t)((threads + 31) / 32) * 32 * EMU_SCRATCH_SLOTS, 0);
    blockDim = {(unsigned)threads, 1, 1};
    gridDim = {(unsigned)grid_x, (unsigned)grid_y, (unsigned)grid_z};
    const KLParams p = *params;
    std::vector<std::thread> pool;
    pool.reserve(threads);
    for (int t = 0; t < threads; ++t) {
        pool.emplace_back([&, t]() {
            threadIdx = {(unsigned)t, 0, 0};
            for (int z = 0; z < grid_z; ++z)
                for (int y = 0; y < grid_y; ++y)
                    for (int x = 0; x < grid_x; ++x) {
                        if (t == 0)
                            for (size_t k = 0; k < words; ++k) memory[k] = 0x7fc07fc0u;  // NaN in every width
                        barrier.arrive_and_wait();
                        blockIdx = {(unsigned)x, (unsigned)y, (unsigned)z};
                        fn(p);
                        emu_cp_async_wait(0);
                        barrier.arrive_and_wait();
                    }
        });
    }
    for (auto& thread : pool) thread.join();
    std::free(memory);
}

// kernel: 0 forward, 1 dq, 2 dk, 3 the tensor-core forward of this library's SK_MMA_VARIANT,
// 4-6 its tensor-core dq, 7-9 its dk and 10-12 its dk with atomic dq (SK_MMA_BACKWARD), sides 1, 2, both
extern "C" void emu_launch(int kernel, int grid_x, int grid_y, int grid_z, int threads, long long smem_bytes,
                           const KLParams* params) {
    kernel_fn fn = kernel == 0 ? kl_forward : kernel == 1 ? kl_backward_dq : kl_backward_dk;
    if (kernel >= 3) fn = nullptr;  // launch.py builds a library with the variants it launches
#if defined(SK_MMA_VARIANT) && STREAMKL_INPUT != 0
    if (kernel == 3) fn = forward_mma;
#endif
#if defined(SK_MMA_BACKWARD) && STREAMKL_INPUT != 0
    const kernel_fn backward[9] = {dq_mma<1, 0>,       dq_mma<0, 1>,       dq_mma<1, 1>,
                                   dk_mma<1, 0, 0>,    dk_mma<0, 1, 0>,    dk_mma<1, 1, 0>,
                                   dk_mma<1, 0, 1>,    dk_mma<0, 1, 1>,    dk_mma<1, 1, 1>};
    if (kernel >= 4 && kernel <= 12) fn = backward[kernel - 4];
#endif
    if (fn == nullptr) std::abort();
    emu_run(fn, grid_x, grid_y, grid_z, threads, smem_bytes, params);
}
