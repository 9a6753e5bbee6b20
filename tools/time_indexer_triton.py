"""Time the Triton DSA indexer loss on the GPU next to the teacher's cuDNN SDPA forward.

    PYTHONPATH=$PWD python tools/time_indexer_triton.py [--dims 128 192] [N ...]
        [--lse-tiles BMxBNxW[xS] ...] [--forward-tiles BMxBNxW[xS] ...] [--backward-tiles BMxBNxW[xS] ...]

B = 1, causal, bf16, teacher H = 64 (Hk = 64) D = 128 (and 192 when asked), indexer 64 heads x 128,
top-k 2048: a random selection per row (scattered over the causal keys) and a local one (the last
2048 keys). Prints milliseconds (median of CUDA-event timings): the forward with the teacher's lse
computed and given, the backward, their ratio to the SDPA forward, the top-k stages' ratio to the
dense stage, and the peak memory of a forward + backward above the inputs and the gradients, in
bytes per (row, teacher head). `--lse-tiles` / `--forward-tiles` / `--backward-tiles BMxBNxWARPS[xSTAGES]
...` also time the dense forward (lse computed at those tiles) / forward (lse given) / backward at
those tiles and pipeline depth (A/B against the configured ones) at the largest N; a configuration
that fails (shared memory, compile error) prints its error and the others go on.
"""

from __future__ import annotations

import argparse

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


def measure(D: int, N: int) -> None:
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
    dense = Problem(1, N, N, H, H, D, Hi, Di, D**-0.5, True, 0, dtype, dev)
    tiles = {name: indexer.config(dense, name) for name in ("lse", "forward", "backward")}
    print(f"D={D} N={N}: cuDNN SDPA fwd {sdpa:.2f} ms; tiles {tiles}", flush=True)
    dense_total = None
    for name, top in (("dense", None), ("top2048 scattered", scattered), ("top2048 local", local)):
        problem = Problem(1, N, N, H, H, D, Hi, Di, D**-0.5, True, 0 if top is None else K, dtype, dev)
        top = None if top is None else top.view(1, N, K)
        state = {}

        def fwd(top=top, problem=problem, state=state):
            state["out"] = indexer.forward(problem, q, k, qi, ki, w, None, top)

        def bwd(top=top, problem=problem, state=state):
            loss, head_lse, index_lse = state["out"]
            state["grads"] = indexer.backward(problem, q, k, qi, ki, w, top, head_lse, index_lse,
                                              torch.ones_like(loss))

        def fwd_given(top=top, problem=problem, state=state):
            indexer.forward(problem, q, k, qi, ki, w, state["out"][1], top)

        t_fwd, t_bwd, t_given = timed(fwd), timed(bwd), timed(fwd_given)
        state.clear()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fwd()
        bwd()
        torch.cuda.synchronize()
        gradient_bytes = sum(g.numel() * g.element_size() for g in state["grads"])
        extra = torch.cuda.max_memory_allocated() - base - gradient_bytes
        state.clear()
        total = t_fwd + t_bwd
        dense_total = total if dense_total is None else dense_total
        print(f"    {name}: fwd {t_fwd:.2f} ms (lse given {t_given:.2f}) bwd {t_bwd:.2f} ms "
              f"= {total / sdpa:.2f}x SDPA ({(t_given + t_bwd) / sdpa:.2f}x lse given), "
              f"{total / dense_total:.2f}x dense; peak besides grads {extra / 2**20:.0f} MiB "
              f"= {extra / (N * H):.1f} B per (row, head)", flush=True)


def tiles_ab(N: int, kernel: str, tiles: tuple[int, ...], D: int = 128) -> str:
    """One dense kernel at N with the given (BLOCK_M, BLOCK_N, warps[, stages]): "lse" (timed as the
    forward with its lse pass), "forward" (lse given) or "backward"."""
    dev, dtype, H, Hi, Di = torch.device("cuda"), torch.bfloat16, 64, 64, 128
    q, k = (torch.randn(1, N, H, D, device=dev, dtype=dtype) for _ in range(2))
    qi = torch.randn(1, N, Hi, Di, device=dev, dtype=dtype)
    ki = torch.randn(1, N, Di, device=dev, dtype=dtype)
    w = torch.randn(1, N, Hi, device=dev, dtype=dtype)
    problem = Problem(1, N, N, H, H, D, Hi, Di, D**-0.5, True, 0, dtype, dev)
    loss, head_lse, index_lse = indexer.forward(problem, q, k, qi, ki, w, None, None)
    grad = torch.ones_like(loss)
    if kernel == "lse":  # the forward with the lse pass, at these tiles for the lse pass
        ms = timed(lambda: indexer.forward(problem, q, k, qi, ki, w, None, None, lse_tiles=tiles))
    elif kernel == "forward":
        ms = timed(lambda: indexer.forward(problem, q, k, qi, ki, w, head_lse, None, tiles=tiles))
    else:
        ms = timed(lambda: indexer.backward(problem, q, k, qi, ki, w, None, head_lse, index_lse, grad, tiles=tiles))
    what = {"lse": "forward, lse pass", "forward": "forward, lse given", "backward": "backward"}[kernel]
    return f"D={D} N={N}: dense {what}, tiles {tiles}: {ms:.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lengths", type=int, nargs="*", default=[8192, 32768])
    parser.add_argument("--dims", type=int, nargs="+", default=[128])
    parser.add_argument("--skip-stages", action="store_true", help="only the tile alternatives")
    parser.add_argument("--lse-tiles", nargs="*", default=[])
    parser.add_argument("--forward-tiles", nargs="*", default=[])
    parser.add_argument("--backward-tiles", nargs="*", default=[])
    args = parser.parse_args()
    for D in [] if args.skip_stages else args.dims:
        for N in args.lengths:
            measure(D, N)
            torch.cuda.empty_cache()
    for kernel, choices in (("backward", args.backward_tiles), ("forward", args.forward_tiles),
                            ("lse", args.lse_tiles)):
        for text in choices:
            try:
                print(tiles_ab(max(args.lengths), kernel, tuple(int(x) for x in text.split("x"))), flush=True)
            except Exception as exc:  # one failing configuration does not end the sweep
                print(f"{kernel} tiles {text}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
