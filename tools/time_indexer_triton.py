"""Time the Triton DSA indexer loss on the GPU next to the teacher's cuDNN SDPA forward.

    PYTHONPATH=$PWD python tools/time_indexer_triton.py [N ...]

B = 1, causal, bf16, teacher H = 64 (Hk = 64) D = 128 and 192, indexer 64 heads x 128, top-k 2048
(a random selection per row: scattered, the dense stage's tiles; and a local one: the last 2048 keys).
Prints milliseconds (median of CUDA-event timings) and the peak memory above the inputs.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from streamkl.backends.triton import indexer
from streamkl.indexer import IndexerProblem as Problem


def timed(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def measure(D: int, N: int) -> str:
    dev, dtype, H, Hi, Di, K = torch.device("cuda"), torch.bfloat16, 64, 64, 128, 2048
    q, k, v = (torch.randn(1, N, H, D, device=dev, dtype=dtype) for _ in range(3))
    qi = torch.randn(1, N, Hi, Di, device=dev, dtype=dtype)
    ki = torch.randn(1, N, Di, device=dev, dtype=dtype)
    w = torch.randn(1, N, Hi, device=dev, dtype=dtype)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        sdpa = timed(lambda: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True))
    rows = torch.arange(N, device=dev)[:, None]
    scattered = (torch.rand(N, K, device=dev) * (rows + 1)).long().to(torch.int32)
    local = (rows - torch.arange(K, device=dev)[None, :]).to(torch.int32).clamp(min=-1)
    line = f"D={D} N={N}: cuDNN SDPA fwd {sdpa:.2f} ms"
    for name, top in (("dense", None), ("top2048 scattered", scattered), ("top2048 local", local)):
        problem = Problem(1, N, N, H, H, D, Hi, Di, D**-0.5, True, 0 if top is None else K, dtype, dev)
        top = None if top is None else top.view(1, N, K)
        state = {}

        def fwd(top=top, problem=problem, state=state):
            state["out"] = indexer.forward(problem, q, k, qi, ki, w, None, top)

        def bwd(top=top, problem=problem, state=state):
            loss, head_lse, index_lse = state["out"]
            indexer.backward(problem, q, k, qi, ki, w, top, head_lse, index_lse, torch.ones_like(loss))

        def fwd_given(top=top, problem=problem, state=state):
            indexer.forward(problem, q, k, qi, ki, w, state["out"][1], top)

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t_fwd, t_bwd, t_given = timed(fwd), timed(bwd), timed(fwd_given)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        line += (f"\n    {name}: fwd {t_fwd:.2f} ms (lse given {t_given:.2f}) bwd {t_bwd:.2f} ms "
                 f"= {(t_fwd + t_bwd) / sdpa:.2f}x SDPA ({(t_given + t_bwd) / sdpa:.2f}x lse given), "
                 f"peak +{peak:.0f} MiB (grads incl.)")
    return line


def main(lengths):
    for D in (128, 192):
        for N in lengths:
            print(measure(D, N), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [8192, 32768])
