// The host emulator's entry point for indexer.cu: the same kernels compiled as C++ on emulate.h and
// run on the CPU (one fiber per CUDA thread, blocks one after another: emulate_runtime.h).
#include "emulate.h"

#include "indexer.cu"
#include "emulate_runtime.h"

extern "C" int emu_params_size() { return (int)sizeof(IndexerParams); }

typedef void (*kernel_fn)(const IndexerParams);

static kernel_fn launch_fn;
static IndexerParams launch_params;
static unsigned* launch_memory;
static size_t launch_words;

// Shared memory is NaN before every block, so a read of anything the block did not write shows up
// in the results.
static void thread_body(int t) {
    for (unsigned z = 0; z < gridDim.z; ++z)
        for (unsigned y = 0; y < gridDim.y; ++y)
            for (unsigned x = 0; x < gridDim.x; ++x) {
                if (t == 0)
                    for (size_t k = 0; k < launch_words; ++k) launch_memory[k] = 0x7fc00000u;  // float32 NaN
                __syncthreads();
                blockIdx = {x, y, z};
                launch_fn(launch_params);
                __syncthreads();
            }
}

// kernel: 0 forward, 1 backward by rows, 2 backward by keys
extern "C" void emu_launch(int kernel, int grid_x, int grid_y, int grid_z, int threads, long long smem_bytes,
                           const IndexerParams* params) {
    std::lock_guard<std::mutex> lock(emu::launch_mutex);
    launch_fn = kernel == 0 ? indexer_forward : kernel == 1 ? indexer_backward_row : indexer_backward_key;
    launch_params = *params;
    launch_memory = emu::setup_block(threads, smem_bytes, &launch_words);
    gridDim = {(unsigned)grid_x, (unsigned)grid_y, (unsigned)grid_z};
    emu::run(threads, thread_body);
    std::free(launch_memory);
}
