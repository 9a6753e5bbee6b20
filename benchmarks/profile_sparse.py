"""Where a block-sparse call's time goes: host time, kernel time and the synchronized total.

For each sparsity (the suite's masks: per head, each query block keeps the same number of random
key blocks) and mode (forward; forward + student backward), with the Gluon kernels forced on and
by default, it prints one JSON line: `sync_ms` (the suite's measure: L2 flushed, device
synchronized, one call between CUDA events), `overlap_ms` (calls enqueued back to back, the
host hidden as in a training loop), `host_ms` (the Python time of one call, the GPU idle before
it), and `kernels` (name: device ms of one call, from torch.profiler).

    python benchmarks/profile_sparse.py --out DIR      # H200; writes DIR/profile_sparse.jsonl
    python benchmarks/profile_sparse.py --out DIR --cprofile   # cProfile of the host path instead
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from suite import Timer, block_mask  # noqa: E402

import streamkl  # noqa: E402
from streamkl.backends.triton import gluon_forward  # noqa: E402


def profile(args, sparsity: float, mode: str, gluon):
    n, h, d = args.n, args.heads, 128
    inputs = [torch.randn(1, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    if mode != "forward":
        inputs[2].requires_grad_(True)
        inputs[3].requires_grad_(True)
    kwargs = dict(backend="triton")
    if sparsity is not None:
        kwargs["mask1"] = kwargs["mask2"] = block_mask(n, h, sparsity, 128, "cuda")
    gluon_forward.USE_GLUON = gluon

    def run():
        loss = streamkl.kl(*inputs, **kwargs)
        if mode != "forward":
            loss.backward()
            inputs[2].grad = inputs[3].grad = None

    if args.cprofile:
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            profiler.enable()
            run()
            profiler.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(40)
        return dict(sparsity=sparsity, mode=mode, gluon=gluon, repeats=args.repeats, cprofile=text.getvalue())
    timer = Timer("cuda")
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    sync = [timer.once(run)[0] for _ in range(args.repeats)]
    overlapped = Timer("cuda", overlap_host=True).overlapped(run, args.repeats)
    host = timer.host_ms(run, args.repeats)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    kernels = {}
    for event in prof.key_averages():
        if event.device_time_total > 0:
            kernels[event.key[:60]] = round(event.device_time_total / 1e3, 4)
    return dict(sparsity=sparsity, mode=mode, gluon=gluon, sync_ms=statistics.median(sync),
                overlap_ms=statistics.median(overlapped), host_ms=statistics.median(host), kernels=kernels)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--sparsity", default="none,0.9")
    parser.add_argument("--cprofile", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "profile_sparse.jsonl", "a") as f:
        for sparsity in args.sparsity.split(","):
            sparsity = None if sparsity == "none" else float(sparsity)
            for mode in ("forward", "fwd+bwd student"):
                for gluon in (True, None):
                    row = profile(args, sparsity, mode, gluon)
                    if args.cprofile:
                        text = row.pop("cprofile")
                        with open(args.out / "profile_host.txt", "a") as host:
                            host.write(f"===== {json.dumps(row)}\n{text}\n")
                        continue
                    print(json.dumps(row), flush=True)
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
