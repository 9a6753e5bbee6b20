"""Where a synchronized call's time goes on the GPU: the host's time before the first launch, or
a slower kernel.

The suite's synchronized measure (L2 flushed, device synchronized, start event, one call, end
event) read the Gluon forward 8-17 % slower than back to back in the twentieth session, SDPA's
only 2-3 %; a constant host cost would not scale with the kernel's time. This times each case
both ways and, inside the call, records a CUDA event just before and just after the forward's
kernel launch (`common.run_compiled`, wrapped), so the synchronized call splits into
start -> launch (the host's time before the launch, as the GPU sees it), the kernel, and launch
end -> end event (the reduction's kernel). SDPA's forward is timed both ways beside it. On an
idle GPU the "before" event runs at once, so the launch path's own host time (Triton's launcher,
`launch_host_ms`: its CPU time) lands in the synchronized "kernel" figure too.

    python benchmarks/sync_gap.py --out $OUT/sync_gap.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(1, str(HERE))

from suite import Timer, block_mask  # noqa: E402

import streamkl  # noqa: E402
from streamkl.backends.triton import common  # noqa: E402

MARKS: list = []  # (event before, event after) of each wrapped launch while recording
LAUNCH_HOST: list = []  # host seconds of each wrapped launch (the launch path after the "before" event)
_RUN = common.run_compiled


def _marked_run(entry, grid, args):
    before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    before.record()
    start = time.perf_counter()
    out = _RUN(entry, grid, args)
    LAUNCH_HOST.append(time.perf_counter() - start)
    after.record()
    MARKS.append((before, after))
    return out


def make_fns(n, h, d, causal, sparsity):
    """(("streamkl", one forward call), ("sdpa", one SDPA flash forward of the teacher's shape))."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q1, k1, q2, k2 = (torch.randn(1, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    kwargs = dict(causal=causal, backend="triton")
    if sparsity is not None:
        kwargs["mask1"] = kwargs["mask2"] = block_mask(n, h, sparsity, 128, "cuda")
    q, k, v = q1.transpose(1, 2), k1.transpose(1, 2), q2.transpose(1, 2)

    def ours():
        return streamkl.kl(q1, k1, q2, k2, **kwargs)

    def sdpa():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return ("streamkl", ours), ("sdpa", sdpa)


def profile(fn, timer, calls: int):
    """cProfile of `calls` calls, each after a flush and a synchronization (the synchronized
    measure's host path; the launch wrapper's rows are the sync_gap's own)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    for _ in range(calls):
        timer.flush.zero_()
        torch.cuda.synchronize()
        profiler.enable()
        fn()
        profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    print("\n".join(line[:150] for line in text.getvalue().splitlines() if line.strip()), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--profile", type=int, default=0,
                        help="also print cProfile's top rows (by own time) of this many synchronized calls a case")
    args = parser.parse_args()
    n, h = args.n, args.heads
    for module in (common,):
        module.run_compiled = _marked_run
    # (gluon_forward imports run_compiled at call time: it takes the wrapper)
    timer, overlap = Timer("cuda"), Timer("cuda", overlap_host=True)
    rows = []
    for d, causal, sparsity in ((64, False, None), (64, True, None), (128, False, None), (128, False, 0.9)):
        fns = make_fns(n, h, d, causal, sparsity)
        for name, fn in fns:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            gaps, kernels, tails, syncs = [], [], [], []
            LAUNCH_HOST.clear()
            for _ in range(args.repeats):
                MARKS.clear()
                timer.flush.zero_()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                syncs.append(start.elapsed_time(end))
                if MARKS:
                    before, after = MARKS[0]
                    gaps.append(start.elapsed_time(before))
                    kernels.append(before.elapsed_time(after))
                    tails.append(after.elapsed_time(end))
            MARKS.clear()
            back = overlap.overlapped(fn, args.repeats)
            back_kernels = [b.elapsed_time(a) for b, a in MARKS]
            MARKS.clear()
            host = timer.host_ms(fn, args.repeats)
            if args.profile and name == "streamkl":
                profile(fn, timer, args.profile)
            med = lambda xs: round(statistics.median(xs), 4) if xs else None  # noqa: E731
            row = dict(case=f"fwd D={d}{' causal' if causal else ''}{' 90%' if sparsity else ''}", provider=name,
                       sync_ms=med(syncs), back_ms=med(back), host_ms=med(host), gap_ms=med(gaps),
                       kernel_sync_ms=med(kernels), kernel_back_ms=med(back_kernels), tail_ms=med(tails),
                       launch_host_ms=med([t * 1e3 for t in LAUNCH_HOST]))
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    main()
