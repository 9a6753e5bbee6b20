// The host emulator's entry point: compiles kernels.cu as C++ and runs a launch on the CPU.
#include "emulate.h"

#include "kernels.cu"
#include "emulate_runtime.h"

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

typedef void (*kernel_fn)(const KLParams);

// one launch on the CPU (emulate_runtime.h); test_cupy_warp_ops's probes call it too
void emu_run(kernel_fn fn, int grid_x, int grid_y, int grid_z, int threads, long long smem_bytes,
             const KLParams* params) {
    emu::launch(fn, grid_x, grid_y, grid_z, threads, smem_bytes, params);
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
