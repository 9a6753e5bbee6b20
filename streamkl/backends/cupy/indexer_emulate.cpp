// The host emulator's entry point for indexer.cu: the same kernels compiled as C++ on emulate.h and
// run on the CPU (one fiber per CUDA thread, blocks one after another: emulate_runtime.h).
#include "emulate.h"

#include "indexer.cu"
#include "emulate_runtime.h"

extern "C" int emu_params_size() { return (int)sizeof(IndexerParams); }

// kernel: 0 forward, 1 backward by rows, 2 backward by keys
extern "C" void emu_launch(int kernel, int grid_x, int grid_y, int grid_z, int threads, long long smem_bytes,
                           const IndexerParams* params) {
    void (*fn)(const IndexerParams) =
        kernel == 0 ? indexer_forward : kernel == 1 ? indexer_backward_row : indexer_backward_key;
    emu::launch(fn, grid_x, grid_y, grid_z, threads, smem_bytes, params);
}
