"""The host emulator's warp primitives (streamkl/backends/cupy/warp_ops.cuh) against the PTX ISA's
fragment tables, one warp on the CPU: ldmatrix x4 / x2 / .trans, mma.sync m16n8k16, the butterfly
shuffle, and cp.async copies landing only when a wait retires their group. The tensor-core kernels
see the hardware only through these functions, so this is what the emulated suite rests on; on a
GPU the same kernels run the PTX instructions themselves.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys

import numpy as np
import pytest
import torch

from streamkl.backends.cupy import emulate

PROBE = r"""
#include "emulate.cpp"

// values: A [16][16], K [8][16] (B = K^T, 16 x 8), K2 [8][16], V [16][16], small integers (exact
// sums and exact roundings);
// bad[lane]: failed checks of that lane
static void probe(const KLParams p) {
    SK_DYNAMIC_SMEM(words);
    input_t* a = reinterpret_cast<input_t*>(words);  // A, row major
    input_t* at = a + 256;                           // A transposed
    input_t* k = at + 256;                           // K, row major
    input_t* k2 = k + 128;                           // K2, row major [8][16]
    input_t* v = k2 + 128;                           // V [16][16], row stride 24
    input_t* landing = v + 16 * 24;                  // cp.async target, 32 chunks of 8
    const input_t* values = reinterpret_cast<const input_t*>(p.q1);
    const int lane = threadIdx.x, g = lane / 4, c = lane % 4;
    if (lane == 0) {
        for (int r = 0; r < 16; ++r)
            for (int col = 0; col < 16; ++col) {
                a[r * 16 + col] = values[r * 16 + col];
                at[col * 16 + r] = values[r * 16 + col];
            }
        for (int i = 0; i < 128; ++i) k[i] = values[256 + i];
        for (int i = 0; i < 128; ++i) k2[i] = values[384 + i];
        for (int r = 0; r < 16; ++r)
            for (int col = 0; col < 24; ++col) v[r * 24 + col] = col < 16 ? values[512 + r * 16 + col] : (input_t)0;
    }
    __syncthreads();
    int bad = 0;
    auto pair = [](const input_t* row, int col) { return (unsigned)row[col] | ((unsigned)row[col + 1] << 16); };

    unsigned frag[4];  // A fragment: a0 (g, 2c), a1 (g + 8, 2c), a2 (g, 2c + 8), a3 (g + 8, 2c + 8)
    sk_ldmatrix_x4(frag, sk_shared_address(a + (lane % 16) * 16 + (lane / 16) * 8));
    bad += frag[0] != pair(a + g * 16, 2 * c);
    bad += frag[1] != pair(a + (g + 8) * 16, 2 * c);
    bad += frag[2] != pair(a + g * 16, 2 * c + 8);
    bad += frag[3] != pair(a + (g + 8) * 16, 2 * c + 8);

    unsigned two[2];  // x2: matrices 0 and 1 from the addresses of lanes 0-15
    sk_ldmatrix_x2(two, sk_shared_address(a + (lane % 16) * 16 + (lane / 16) * 8));
    bad += two[0] != frag[0];
    bad += two[1] != frag[1];

    unsigned trans[4];  // .trans of A's transpose: matrix i holds the transpose of A's blocks
    sk_ldmatrix_x4_trans(trans, sk_shared_address(at + (lane % 16) * 16 + (lane / 16) * 8));
    bad += trans[0] != frag[0];
    bad += trans[1] != frag[2];
    bad += trans[2] != frag[1];
    bad += trans[3] != frag[3];
    unsigned trans2[2];
    sk_ldmatrix_x2_trans(trans2, sk_shared_address(at + (lane % 16) * 16 + (lane / 16) * 8));
    bad += trans2[0] != frag[0];
    bad += trans2[1] != frag[2];

    unsigned b[2];  // B fragment: b0 (rows 2c, 2c + 1; col g), b1 (rows 2c + 8, 2c + 9; col g)
    sk_ldmatrix_x2(b, sk_shared_address(k + (lane % 8) * 16 + ((lane / 8) % 2) * 8));
    bad += b[0] != pair(k + g * 16, 2 * c);
    bad += b[1] != pair(k + g * 16, 2 * c + 8);

    float d[4] = {1.0f, 2.0f, 3.0f, 4.0f};  // C: c0, c1 (g, 2c, 2c + 1), c2, c3 (g + 8, ...)
    sk_mma_16816(d, frag, b);
    for (int idx = 0; idx < 4; ++idx) {
        const int row = g + 8 * (idx / 2), col = 2 * c + idx % 2;
        float expected = (float)(idx + 1);
        for (int kk = 0; kk < 16; ++kk) expected += to_float(a[row * 16 + kk]) * to_float(k[col * 16 + kk]);
        bad += d[idx] != expected;
    }

    // the backward's reuse of C fragments: C = A [K; K2]^T (16 x 16, two mma) rounded into one A
    // fragment (fragments_to_a), times V [16][16] (row stride 24) with B from ldmatrix.trans
    unsigned b2[2];
    sk_ldmatrix_x2(b2, sk_shared_address(k2 + (lane % 8) * 16 + ((lane / 8) % 2) * 8));
    float c_low[4] = {0.0f, 0.0f, 0.0f, 0.0f}, c_high[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    sk_mma_16816(c_low, frag, b);
    sk_mma_16816(c_high, frag, b2);
    unsigned reused[4];
    fragments_to_a(reused, c_low, c_high);
    float acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    warp_accumulate<16>(acc, reused, v, lane);
    for (int n = 0; n < 2; ++n)
        for (int idx = 0; idx < 4; ++idx) {
            const int row = g + 8 * (idx / 2), col = 8 * n + 2 * c + idx % 2;
            float expected = 0.0f;
            for (int key = 0; key < 16; ++key) {
                const input_t* key_row = key < 8 ? k + key * 16 : k2 + (key - 8) * 16;
                float score = 0.0f;
                for (int kk = 0; kk < 16; ++kk) score += to_float(a[row * 16 + kk]) * to_float(key_row[kk]);
                expected += score * to_float(v[key * 24 + col]);
            }
            bad += acc[n][idx] != expected;
        }

    bad += sk_shfl_xor((float)lane, 5) != (float)(lane ^ 5);

    // cp.async: chunk `lane` of A (zero-filled for odd lanes) lands at the retiring wait, not before
    sk_cp_async_16(sk_shared_address(landing + lane * 8), a + lane * 8, lane % 2 ? 0 : 16);
    sk_cp_async_commit();
    sk_cp_async_16(sk_shared_address(landing + lane * 8), a + lane * 8, 16);  // a second group, left in flight
    sk_cp_async_commit();
    bad += landing[lane * 8] != (input_t)0x7fc0;  // still the shared-memory poison
    sk_cp_async_wait<1>();
    for (int e = 0; e < 8; ++e) bad += landing[lane * 8 + e] != (lane % 2 ? (input_t)0 : a[lane * 8 + e]);
    sk_cp_async_wait<0>();
    for (int e = 0; e < 8; ++e) bad += landing[lane * 8 + e] != a[lane * 8 + e];

    reinterpret_cast<int*>(p.kl_rows)[lane] = bad;
}

extern "C" void probe_warp_ops(const void* values, int* bad) {
    KLParams p{};
    p.q1 = (sk_u64)(size_t)values;
    p.kl_rows = (sk_u64)(size_t)bad;
    emu_run(probe, 1, 1, 1, 32, 4096, &p);
}

// cvt.rn's model: float32 -> input_t bits, and the pair packing
extern "C" void probe_round(const float* in, unsigned short* out, int n) {
    for (int i = 0; i + 1 < n; i += 2) {
        const unsigned packed = sk_pack_floats(in[i], in[i + 1]);
        out[i] = (unsigned short)(packed & 0xffffu);
        out[i + 1] = (unsigned short)(packed >> 16);
    }
}

// a kernel whose lane 0 leaves before the others' __syncthreads: the barrier can never complete
static void stuck(const KLParams p) {
    if (threadIdx.x == 0) return;
    __syncthreads();
}

extern "C" void probe_stuck() {
    KLParams p{};
    emu_run(stuck, 1, 1, 1, 32, 64, &p);
}

extern "C" float probe_factor(float largest) {
    KLParams p{};
    p.grad_max = (sk_u64)(size_t)&largest;
    return gradient_factor(p);
}
"""


HALF_DTYPES = pytest.mark.parametrize("dtype,code", [(torch.float16, 1), (torch.bfloat16, 2)], ids=["fp16", "bf16"])
needs_compiler = pytest.mark.skipif(emulate.compiler() is None, reason="no C++ compiler for the emulator")


def _probe_library(code: int, tmp_path) -> ctypes.CDLL:
    source = tmp_path / "probe.cpp"
    source.write_text(PROBE)
    library = tmp_path / "probe.so"
    subprocess.run(
        [emulate.compiler(), "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-fno-strict-aliasing",
         "-Wno-unknown-pragmas", f"-DSTREAMKL_INPUT={code}", f"-I{emulate._HERE}", str(source), "-o", str(library)],
        check=True, capture_output=True, text=True,
    )
    return ctypes.CDLL(str(library))


@needs_compiler
@HALF_DTYPES
def test_emulated_warp_ops_follow_the_ptx_fragment_layouts(dtype, code, tmp_path):
    library = _probe_library(code, tmp_path)
    values = torch.randint(-3, 4, (256 + 128 + 128 + 256,)).to(dtype)  # small integers: every sum is exact
    bits = values.view(torch.int16).numpy().copy()
    bad = np.full(32, -1, dtype=np.int32)
    probe = library.probe_warp_ops
    probe.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    probe(bits.ctypes.data, bad.ctypes.data)
    assert bad.tolist() == [0] * 32


@needs_compiler
@HALF_DTYPES
def test_emulated_rounding_matches_torch(dtype, code, tmp_path):
    """sk_pack_floats (cvt.rn.f16x2 / bf16x2 on the GPU): nearest even, subnormals, overflow to inf."""
    library = _probe_library(code, tmp_path)
    scales = 2.0 ** torch.randint(-30, 18, (4000,)).float()
    values = torch.cat([
        torch.randn(4000) * scales,
        torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, 1 + 3 * 2**-11, 2**-25, 3 * 2**-25, 2**-24 * 1.5,
                      65504.0, 65519.0, 65520.0, -65520.0, 3e38, 0.0, -0.0, float("inf"), float("-inf")]),
    ]).float()
    values = values[: values.numel() // 2 * 2].contiguous()
    out = np.zeros(values.numel(), dtype=np.uint16)
    library.probe_round.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    library.probe_round(values.numpy().ctypes.data, out.ctypes.data, values.numel())
    expected = values.to(dtype).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(out, expected), np.flatnonzero(out != expected)[:10]


@needs_compiler
def test_gradient_factor_is_a_power_of_two_bringing_the_largest_g_near_one(tmp_path):
    library = _probe_library(2, tmp_path)
    library.probe_factor.argtypes = [ctypes.c_float]
    library.probe_factor.restype = ctypes.c_float
    for largest, factor in [(1.0, 1.0), (3.0, 0.5), (1e-6, 2.0**20), (2.0**-126, 2.0**126), (2.0**127, 1.0),
                            (0.0, 1.0), (1e-45, 1.0), (float("inf"), 1.0), (float("nan"), 1.0)]:
        assert library.probe_factor(largest) == factor, largest


@needs_compiler
def test_a_barrier_that_cannot_complete_stops_the_emulator_with_a_message(tmp_path):
    """A block whose threads do not all reach a __syncthreads (undefined on a GPU) ends the
    process with a message rather than hanging it."""
    library = _probe_library(1, tmp_path)
    code = f"import ctypes; ctypes.CDLL({str(library._name)!r}).probe_stuck()"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "every thread waits at a barrier that cannot complete" in result.stderr
