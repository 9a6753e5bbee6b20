// The host emulator's entry point for indexer.cu: the same kernels compiled as C++ on emulate.h and
// run on CPU threads (one std::thread per CUDA thread, blocks one after another).
#include "emulate.h"

#include <barrier>
#include <cstdlib>
#include <limits>
#include <thread>
#include <vector>

#include "indexer.cu"

thread_local emu_dim3 threadIdx;
thread_local emu_dim3 blockIdx;
emu_dim3 blockDim;
emu_dim3 gridDim;

static std::barrier<>* block_barrier = nullptr;
static float* shared_memory = nullptr;

void __syncthreads() { block_barrier->arrive_and_wait(); }
float* emu_shared_memory() { return shared_memory; }

extern "C" int emu_params_size() { return (int)sizeof(IndexerParams); }

// kernel: 0 forward, 1 backward by rows, 2 backward by keys. Shared memory is NaN before every
// block, so a read of anything the block did not write shows up in the results.
extern "C" void emu_launch(int kernel, int grid_x, int grid_y, int grid_z, int threads, long long smem_bytes,
                           const IndexerParams* params) {
    typedef void (*kernel_fn)(const IndexerParams);
    kernel_fn fn = kernel == 0 ? indexer_forward : kernel == 1 ? indexer_backward_row : indexer_backward_key;
    const size_t floats = (size_t)(smem_bytes + 3) / 4 + 4;
    float* memory = static_cast<float*>(std::aligned_alloc(64, ((floats * 4 + 63) / 64) * 64));
    shared_memory = memory;
    std::barrier<> barrier(threads);
    block_barrier = &barrier;
    blockDim = {(unsigned)threads, 1, 1};
    gridDim = {(unsigned)grid_x, (unsigned)grid_y, (unsigned)grid_z};
    const IndexerParams p = *params;
    std::vector<std::thread> pool;
    pool.reserve(threads);
    for (int t = 0; t < threads; ++t) {
        pool.emplace_back([&, t]() {
            threadIdx = {(unsigned)t, 0, 0};
            for (int z = 0; z < grid_z; ++z)
                for (int y = 0; y < grid_y; ++y)
                    for (int x = 0; x < grid_x; ++x) {
                        if (t == 0)
                            for (size_t k = 0; k < floats; ++k) memory[k] = std::numeric_limits<float>::quiet_NaN();
                        barrier.arrive_and_wait();
                        blockIdx = {(unsigned)x, (unsigned)y, (unsigned)z};
                        fn(p);
                        barrier.arrive_and_wait();
                    }
        });
    }
    for (auto& thread : pool) thread.join();
    std::free(memory);
}
