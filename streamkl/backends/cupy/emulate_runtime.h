// The host emulator's runtime, shared by emulate.cpp and indexer_emulate.cpp (each includes it
// once, after emulate.h): a launch's CUDA threads are fibers on the calling OS thread, run in
// turn. A fiber runs until it waits at a barrier (__syncthreads, its warp's exchange in
// warp_ops.cuh) that some of its threads have not reached yet; then the next fiber runs. So a
// barrier costs a few context switches in user space rather than a sleep and a wake-up per thread,
// and a launch uses one core whatever the machine's load. Launches are serialized (one runtime).
#pragma once
#include <ucontext.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

emu_dim3 threadIdx;  // the running fiber's (set by the scheduler at each switch)
emu_dim3 blockIdx;
emu_dim3 blockDim;
emu_dim3 gridDim;

namespace emu {

struct Barrier {
    int count = 0;
    int arrived = 0;
    unsigned phase = 0;
};

struct AsyncCopy {
    void* dst;
    const void* src;
    int bytes, src_bytes;
};

struct Fiber {
    ucontext_t context;
    std::unique_ptr<char[]> stack;
    std::vector<AsyncCopy> open_group;  // cp.async copies not yet committed
    std::deque<std::vector<AsyncCopy>> committed_groups;
    bool done = false;
};

constexpr size_t kStackBytes = 1 << 20;  // untouched pages stay unmapped

static std::mutex launch_mutex;
static ucontext_t scheduler;
static std::vector<Fiber> fibers;  // never resized while they run (a context points into itself)
static int current = 0;
static unsigned long long progress = 0;  // arrivals and completions: unchanged over a round = deadlock
static void (*body)(int) = nullptr;

static Barrier block_barrier;
static std::vector<Barrier> warp_barriers;
static std::vector<sk_u64> warp_scratch;  // [warps][32 lanes][EMU_SCRATCH_SLOTS]
static float* shared_memory = nullptr;

static void yield() { swapcontext(&fibers[current].context, &scheduler); }

// Arrive at `b` and wait until all of its `count` threads have arrived.
static void wait(Barrier& b) {
    ++progress;
    const unsigned phase = b.phase;
    if (++b.arrived == b.count) {
        b.arrived = 0;
        ++b.phase;
        return;
    }
    while (b.phase == phase) yield();
}

static void entry() {
    body(current);
    fibers[current].done = true;
    ++progress;
}  // returns to uc_link: the scheduler

// Runs fiber_body(t) for every t in [0, threads), as fibers, until all have returned.
static void run(int threads, void (*fiber_body)(int)) {
    body = fiber_body;
    fibers.clear();
    fibers.resize(threads);
    for (int t = 0; t < threads; ++t) {
        Fiber& fiber = fibers[t];
        fiber.stack.reset(new char[kStackBytes]);
        getcontext(&fiber.context);
        fiber.context.uc_stack.ss_sp = fiber.stack.get();
        fiber.context.uc_stack.ss_size = kStackBytes;
        fiber.context.uc_link = &scheduler;
        makecontext(&fiber.context, entry, 0);
    }
    for (int left = threads; left > 0;) {
        const unsigned long long before = progress;
        for (int t = 0; t < threads; ++t) {
            if (fibers[t].done) continue;
            current = t;
            threadIdx = {(unsigned)t, 0, 0};
            swapcontext(&scheduler, &fibers[t].context);
            left -= fibers[t].done;
        }
        if (left > 0 && progress == before) {
            std::fprintf(stderr, "streamkl emulator: every thread waits at a barrier that cannot complete\n");
            std::abort();
        }
    }
    fibers.clear();
}

// One launch of `fn` over the grid, block after block, each block's `threads` threads as fibers.
// Shared memory reads NaN before every block (0x7fc07fc0: NaN in float32, float16 and bfloat16
// alike), so a read of anything the block did not write shows up in the results. Static: its
// local state stays this library's (a non-static template's would be one per process, shared by
// every emulator library loaded, while each has its own mutex).
template <class Params>
static void launch(void (*fn)(const Params), int grid_x, int grid_y, int grid_z, int threads, long long smem_bytes,
            const Params* params) {
    static void (*launch_fn)(const Params);
    static Params launch_params;
    static unsigned* memory;
    static size_t words;
    std::lock_guard<std::mutex> lock(launch_mutex);
    launch_fn = fn;
    launch_params = *params;
    words = (size_t)(smem_bytes + 3) / 4 + 4;
    memory = static_cast<unsigned*>(std::aligned_alloc(64, ((words * 4 + 63) / 64) * 64));
    shared_memory = reinterpret_cast<float*>(memory);
    block_barrier = Barrier{threads, 0, 0};
    warp_barriers.assign((threads + 31) / 32, Barrier{32, 0, 0});
    warp_scratch.assign((size_t)((threads + 31) / 32) * 32 * EMU_SCRATCH_SLOTS, 0);
    blockDim = {(unsigned)threads, 1, 1};
    gridDim = {(unsigned)grid_x, (unsigned)grid_y, (unsigned)grid_z};
    run(threads, [](int t) {
        for (unsigned z = 0; z < gridDim.z; ++z)
            for (unsigned y = 0; y < gridDim.y; ++y)
                for (unsigned x = 0; x < gridDim.x; ++x) {
                    if (t == 0)
                        for (size_t k = 0; k < words; ++k) memory[k] = 0x7fc07fc0u;
                    wait(block_barrier);
                    blockIdx = {x, y, z};
                    launch_fn(launch_params);
                    emu_cp_async_wait(0);  // (declared in emulate.h)
                    wait(block_barrier);
                }
    });
    std::free(memory);
}

}  // namespace emu

void __syncthreads() { emu::wait(emu::block_barrier); }
float* emu_shared_memory() { return emu::shared_memory; }
sk_u64* emu_warp_scratch() { return emu::warp_scratch.data() + (threadIdx.x / 32) * 32 * EMU_SCRATCH_SLOTS; }
void emu_warp_sync() { emu::wait(emu::warp_barriers[threadIdx.x / 32]); }

void emu_cp_async(void* dst, const void* src, int bytes, int src_bytes) {
    emu::fibers[emu::current].open_group.push_back({dst, src, bytes, src_bytes});
}

void emu_cp_async_commit() {
    emu::Fiber& fiber = emu::fibers[emu::current];
    fiber.committed_groups.push_back(std::move(fiber.open_group));
    fiber.open_group.clear();
}

void emu_cp_async_wait(int pending) {
    emu::Fiber& fiber = emu::fibers[emu::current];
    while ((int)fiber.committed_groups.size() > pending) {
        for (const emu::AsyncCopy& copy : fiber.committed_groups.front()) {
            std::memcpy(copy.dst, copy.src, copy.src_bytes);
            std::memset(static_cast<char*>(copy.dst) + copy.src_bytes, 0, copy.bytes - copy.src_bytes);
        }
        fiber.committed_groups.pop_front();
    }
}
