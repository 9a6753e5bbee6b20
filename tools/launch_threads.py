"""Host cost of one Triton launch on the main thread and on another thread, and whether it waits.

The autograd engine runs a CUDA backward on its own thread, where the same Python runs slower; and
under cProfile most of a training backward's host time is the Gluon backward kernel's launch. This
times each `Bound` launch of one training call (forward and backward kernels) four ways, on the
main thread and on a `threading.Thread`:

- `Bound.__call__` (the plan's launch: specialization key, then the compiled kernel);
- `compiled[grid](*args)` and the runner alone (Triton's launcher);
- the runner with every pointer passed as an int (no `cuPointerGetAttribute` in the launcher);

then one launch queued behind a long `torch.cuda._sleep` kernel (an asynchronous launch returns at
once) and the whole `loss.backward()` on an idle GPU and behind that kernel.

    PYTHONPATH=$PWD python tools/launch_threads.py [N] [D]       # on a GPU; default N=1024 D=128
"""

from __future__ import annotations

import statistics
import sys
import threading
import time

import torch

import streamkl
from streamkl.backends.triton import launch


def timed(fn, repeats: int = 300) -> tuple[float, float]:
    """(median, min) µs of `fn()` started on an idle GPU."""
    spans = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        spans.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(spans), min(spans)


def on_thread(fn):
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("value", fn()))
    thread.start()
    thread.join()
    return out["value"]


def behind_sleep(fn, repeats: int = 5) -> float:
    """Median µs of `fn()` called right after a long kernel was queued."""
    spans = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)
        start = time.perf_counter()
        fn()
        spans.append((time.perf_counter() - start) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(spans)


def report_kernel(name: str, bound, grid: tuple, args: tuple) -> None:
    """One captured `Bound` launch, timed each way on both threads."""
    run = next(iter(bound._compiled.values()))
    compiled = run.compiled
    full = (*args, *bound._rest) if bound._rest is not None else bound.launcher._all_args((*args, *bound.fixed))
    grid3 = (*grid, 1, 1)[:3]
    runner = compiled[grid3]
    as_ints = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in full)
    cases = {"Bound call": lambda: bound(grid, *args), "kept runner (direct)": lambda: run(grid3, full),
             "compiled[grid](*args)": lambda: compiled[grid3](*full),
             "runner": lambda: runner(*full), "runner, pointers as ints": lambda: runner(*as_ints)}
    for label, fn in cases.items():
        main_t, thread_t = timed(fn), on_thread(lambda fn=fn: timed(fn))
        print(f"{name:30s} {label:26s} {main_t[0]:7.1f} ({main_t[1]:6.1f}) | "
              f"{thread_t[0]:7.1f} ({thread_t[1]:6.1f})")
    print(f"{name:30s} {'behind a long kernel':26s} {behind_sleep(lambda: bound(grid, *args)):7.1f}")
    print(f"   {len(full)} arguments: {sum(isinstance(a, torch.Tensor) for a in full)} tensors, "
          f"{sum(hasattr(a, 'block_shape') for a in full)} descriptors; shared {compiled.metadata.shared} B, "
          f"registers {compiled.n_regs}, spills {compiled.n_spills}")


def main(argv: list[str]) -> None:
    n = int(argv[0]) if argv else 1024
    dim = int(argv[1]) if len(argv) > 1 else 128
    q1, k1 = (torch.randn(1, n, 16, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q2, k2 = (torch.randn(1, n, 16, dim, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(2))

    def loss():
        return streamkl.kl(q1, k1, q2, k2, causal=True, backend="triton")

    loss().backward()  # compile, fill the plans
    captured = {}
    original = launch.Bound.__call__

    def spy(self, grid, *args):
        captured.setdefault(self.launcher.kernel.fn.__name__, (self, grid, args))
        return original(self, grid, *args)

    launch.Bound.__call__ = spy
    try:
        loss().backward()
    finally:
        launch.Bound.__call__ = original
    torch.cuda.synchronize()
    print(f"N={n} D={dim}: µs, median (min); main thread | another thread")
    for name, (bound, grid, args) in captured.items():
        report_kernel(name, bound, grid, args)

    def backward():
        q2.grad = k2.grad = None
        held = loss()
        torch.cuda.synchronize()
        start = time.perf_counter()
        held.backward()
        return (time.perf_counter() - start) * 1e6

    print(f"loss.backward() on an idle GPU: {statistics.median(backward() for _ in range(50)):.1f}")
    spans = []
    for _ in range(5):
        q2.grad = k2.grad = None
        held = loss()
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)
        start = time.perf_counter()
        held.backward()
        spans.append((time.perf_counter() - start) * 1e6)
        torch.cuda.synchronize()
    print(f"loss.backward() behind a long kernel: {statistics.median(spans):.1f}")

    # which runtime / driver calls the host time goes to (cuLaunchKernelEx, allocations, ...)
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        q2.grad = k2.grad = None
        held = loss()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            held.backward()
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main(sys.argv[1:])
