"""The GPU host path's Python time, on a machine without a GPU (the device time is scarce).

Runs `streamkl.kl` (Triton backend, the Gluon kernels chosen as on an H200) on CPU tensors with
every kernel launch stubbed out: a copy of the package in a temporary directory where the
"is this on CUDA" checks read "cpu" instead, the GPU queries (capability, multiprocessors,
current device and stream) answered as an H200 would, and the launches (`common.launch`, the
compiled kernels' own launchers) doing nothing. Everything else is the real code: validation,
dispatch, schedules, autograd, output allocation, launch arguments, TMA descriptors, launch keys.
Torch ops the backward runs on the device (zero fills, casts) run here on CPU tensors: keep N
small (--n 128 or 256) so they stay cheap.

What it measures is the CPU's, not the H200 host's: that host ran the same Python ~3.5x slower
in the twelfth session (forward 75 us here against ~0.25 ms there), and drifts between
processes. Use it to find and compare host costs (`--profile` for cProfile), then confirm on the
GPU with `benchmarks/ab_trees.py --interleave`.

    python benchmarks/host_cpu.py --mode forward --n 256            # median us of one call
    python benchmarks/host_cpu.py --mode student --sparse --n 128   # fwd / bwd split too
    python benchmarks/host_cpu.py --mode forward --profile          # cProfile, by own time
"""

from __future__ import annotations

import argparse
import atexit
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCHES: list = []  # perf_counter() of each stubbed compiled-kernel launch (--launches)


def emulated_package() -> Path:
    """A copy of streamkl whose device checks take CPU tensors for CUDA ones."""
    where = Path(tempfile.mkdtemp(prefix="streamkl-host-cpu-"))
    atexit.register(shutil.rmtree, where, True)
    shutil.copytree(ROOT / "streamkl", where / "streamkl", ignore=shutil.ignore_patterns("__pycache__"))
    for path in (where / "streamkl").rglob("*.py"):
        text = path.read_text()
        text = re.sub(r'device\.type (==|!=) "cuda"', r'device.type \1 "cpu"', text)
        path.write_text(text)
    return where


def stub_gpu():
    """H200 answers to the GPU queries; launches that do nothing."""
    import torch

    from streamkl.backends.triton import TritonBackend, backward, common, forward, gluon_backward, gluon_forward

    TritonBackend.environment_reasons = lambda self: []
    TritonBackend.not_supported_reasons = lambda self, problem: []
    for module in (common, forward, backward, gluon_forward, gluon_backward):
        if hasattr(module, "capability"):
            module.capability = lambda index: (9, 0)
        if hasattr(module, "device_index"):
            module.device_index = lambda problem: 0
        if hasattr(module, "sm_count"):  # (the Gluon backward's grid order asks at some shapes)
            module.sm_count = lambda index: 132
        if hasattr(module, "launch"):
            module.launch = lambda *args, **kwargs: None
    forward._multiprocessors = backward._multiprocessors = lambda index: 132
    torch.cuda.current_device = common.current_device_index = lambda: 0
    common.current_stream_handle = lambda: 0
    torch.cuda.current_stream = lambda *args: types.SimpleNamespace(cuda_stream=0)
    torch.cuda.is_current_stream_capturing = lambda: False

    class Compiled:  # what direct_launch finds for every key: a launcher doing nothing (its time noted)
        packed_metadata = function = None

        def run(self, *args):
            LAUNCHES.append(time.perf_counter())

    class Everything(dict):
        def get(self, key, default=None):
            return Compiled(), ()

    common._COMPILED = Everything()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("forward", "student", "all"), default="forward")
    parser.add_argument("--sparse", action="store_true", help="90 %% random 128-block masks, the same both sides")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--profile", action="store_true", help="cProfile the calls instead, by own time")
    parser.add_argument("--launches", action="store_true", help="when each launch comes in the call (us)")
    parser.add_argument("--callees", default=None, help="with --profile: also what functions matching this call")
    args = parser.parse_args()
    sys.path.insert(0, str(emulated_package()))
    import torch

    import streamkl

    stub_gpu()
    n, h = args.n, args.heads
    grads = {"forward": (), "student": (2, 3), "all": (0, 1, 2, 3)}[args.mode]
    x = [torch.randn(1, n, h, args.dim, dtype=torch.bfloat16).requires_grad_(i in grads) for i in range(4)]
    kwargs = dict(backend="triton", causal=args.causal)
    if args.sparse:
        pattern = torch.rand(1, h, -(-n // 128), -(-n // 128)) < 0.1
        pattern[..., 0] = True
        kwargs["mask1"] = kwargs["mask2"] = streamkl.BlockMask.from_dense(pattern, 128)
    spans = {"call": [], "forward": [], "backward": []}

    def run(record=False):
        start = time.perf_counter()
        loss = streamkl.kl(*x, **kwargs)
        middle = time.perf_counter()
        if grads:
            loss.backward()
            for t in x:
                t.grad = None
        end = time.perf_counter()
        if record:
            spans["call"].append(end - start)
            spans["forward"].append(middle - start)
            spans["backward"].append(end - middle)

    for _ in range(20):
        run()
    if args.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.repeats):
            run()
        profiler.disable()
        stats = pstats.Stats(profiler).sort_stats(os.environ.get("HOST_SORT", "tottime"))
        stats.print_stats(40)
        if args.callees:
            stats.print_callees(args.callees)
        return
    if args.launches:  # when each compiled launch came, us after the call's start (medians)
        times = []
        for _ in range(args.repeats):
            LAUNCHES.clear()
            start = time.perf_counter()
            run()
            end = time.perf_counter()
            times.append([round((t - start) * 1e6, 1) for t in (*LAUNCHES, end)])
        columns = list(zip(*[t for t in times if len(t) == len(times[0])]))
        print("launches at (us), then the call's end:", [round(statistics.median(c), 1) for c in columns])
        return
    for _ in range(args.repeats):
        run(record=True)
    medians = {name: round(statistics.median(values) * 1e6, 1) for name, values in spans.items()}
    print(f"{args.mode}{' sparse' if args.sparse else ''} D={args.dim}: median us {medians}")


if __name__ == "__main__":
    main()
