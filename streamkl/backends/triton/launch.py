"""Launching Triton kernels with little host time, through Triton's public API.

A `Launcher` is one kernel at one configuration (constexprs, warps, pipeline depth). Its first
launch for each argument specialization goes through `kernel[grid](*args, **constexprs)`, which
compiles (or finds) the kernel and returns the compiled kernel; later launches with the same
specialization call that compiled kernel directly, which skips the JIT's argument binding and cache
lookup: through `_compat.direct_launch` (the launcher's C function, triton 3.6) where it serves,
else `compiled[grid](*args)`.

The specialization key is at least as fine as Triton's own, so a reused compiled kernel is the
one Triton would have picked: each tensor's dtype and 16-byte alignment; each int's `== 1`,
divisibility by 16 and 32-bit range; each descriptor's base dtype, alignment, shape, strides,
block and layout; and the device. A portable kernel whose shared memory does not fit at the
requested pipeline depth is retried shallower, and the launcher keeps the depth that fits.
Under the interpreter every launch goes through `kernel[grid]`.
"""

from __future__ import annotations

import torch
import triton

from streamkl._cache import LRUCache
from streamkl.backends.triton._compat import direct_launch
from streamkl.backends.triton.common import interpreting

__all__ = ["Bound", "Launcher", "launcher", "launch"]

_INT32 = 2**31


def _descriptor_key(d) -> tuple:
    base = d.base
    return (base.dtype, base.data_ptr() % 16 == 0, *d.shape, None, *d.strides, None, *d.block_shape,
            getattr(d, "layout", None), getattr(d, "padding", None))


def specialization(args: tuple) -> tuple:
    """A hashable summary of the runtime arguments, at least as fine as Triton's specialization."""
    key = []
    for a in args:
        cls = a.__class__
        if cls is torch.Tensor or cls is torch.nn.Parameter:
            key.append((a.dtype, a.data_ptr() % 16 == 0))
        elif cls is int:
            key.append((a == 1, a % 16 == 0, -_INT32 <= a < _INT32))
        elif cls is float or a is None:
            key.append(None)
        elif cls is bool:
            key.append(bool)
        elif hasattr(a, "block_shape"):  # a TMA descriptor (triton.tools or gluon)
            key.append(_descriptor_key(a))
        elif isinstance(a, torch.Tensor):  # a subclass: by its properties, never the object
            key.append((a.dtype, a.data_ptr() % 16 == 0))
        else:
            key.append((cls, a))  # anything else: by value (hashable, or this raises)
    return tuple(key)


def _runner(compiled):
    """`run(grid, args)` launching a kept compiled kernel (grid: 3 ints; args: all its parameters'
    values): `direct_launch` where this triton has it, else Triton's own `compiled[grid](*args)`.
    `run.compiled` is the compiled kernel (tools read its metadata)."""
    run = direct_launch(compiled)
    if run is None:

        def run(grid, args):
            compiled[grid](*args)

    run.compiled = compiled
    return run


class Launcher:
    """`launcher(grid, *args)` launches `kernel` at this configuration; see the module docstring.

    `args` are the kernel's runtime arguments in order; the constexprs are fixed here. `bind(fixed)`
    fixes the trailing runtime arguments too (a plan's scalars and tables), whose specialization is
    then computed once."""

    def __init__(self, kernel, constexprs: dict, num_warps: int, num_stages: int | None = None):
        self.kernel = kernel
        self.constexprs = dict(constexprs)
        self.num_warps = num_warps
        self.num_stages = num_stages
        names = list(kernel.arg_names)
        unknown = set(self.constexprs) - set(names)
        if unknown:
            raise TypeError(f"{kernel.fn.__name__} has no parameters {sorted(unknown)}")
        # where each constexpr goes among the compiled kernel's arguments (all parameters, in order)
        self._slots = [(i, self.constexprs[n]) for i, n in enumerate(names) if n in self.constexprs]
        trailing = [i for i, _ in self._slots] == list(range(len(names) - len(self._slots), len(names)))
        self._tail = tuple(value for _, value in self._slots) if trailing else None
        self._compiled: dict = {}

    def bind(self, fixed: tuple) -> Bound:
        """This launcher with its last runtime arguments fixed: `bound(grid, *args)` launches
        `kernel(*args, *fixed)`."""
        return Bound(self, tuple(fixed))

    def _options(self) -> dict:
        options = dict(self.constexprs, num_warps=self.num_warps)
        if self.num_stages is not None:
            options["num_stages"] = self.num_stages
        return options

    def _all_args(self, args: tuple):
        if self._tail is not None:
            return (*args, *self._tail)
        full = list(args)
        for index, value in self._slots:
            full.insert(index, value)
        return full

    def _first(self, grid: tuple, args: tuple):
        """Launch through the JIT (compiling if needed); the compiled kernel, or None (interpreter)."""
        while True:
            try:
                compiled = self.kernel[grid](*args, **self._options())
            except triton.runtime.errors.OutOfResources:
                if self.num_stages is None or self.num_stages <= 1:
                    raise
                self.num_stages -= 1  # shallower pipeline; kept for every later launch
                self._compiled.clear()
                continue
            return compiled if hasattr(compiled, "__getitem__") else None

    def __call__(self, grid: tuple, *args) -> None:
        if interpreting():
            self.kernel[grid](*args, **self._options())
            return
        key = (torch.cuda.current_device(), specialization(args))
        run = self._compiled.get(key)
        if run is not None:
            run((*grid, 1, 1)[:3], self._all_args(args))
            return
        compiled = self._first(grid, args)
        if compiled is not None:
            self._compiled[key] = _runner(compiled)


class Bound:
    """A `Launcher` with its trailing runtime arguments fixed (`Launcher.bind`)."""

    def __init__(self, launcher: Launcher, fixed: tuple):
        self.launcher = launcher
        self.fixed = fixed
        self._rest = None if launcher._tail is None else (*fixed, *launcher._tail)
        self._compiled: dict = {}  # key -> `_runner`
        self._planned = None  # (device, runner) of `planned`

    def planned(self, grid: tuple, *args) -> None:
        """`self(grid, *args)` for a caller whose plan fixes every argument's specialization (each
        tensor's dtype and alignment, each descriptor's shape, strides, block and layout) and the
        device, as the Gluon kernels' plans do (`select.tma_inputs` admits aligned, contiguous
        inputs; the other tensors are fresh allocations): after the first launch, the compiled
        kernel is reused without computing the key."""
        known = self._planned
        if known is not None and known[0] == torch.cuda.current_device():
            known[1]((*grid, 1, 1)[:3], (*args, *self._rest))
            return
        self(grid, *args)
        if self._rest is not None and not interpreting():
            key = (torch.cuda.current_device(), self.launcher.num_stages, specialization(args))
            run = self._compiled.get(key)
            if run is not None:
                self._planned = (key[0], run)

    def __call__(self, grid: tuple, *args) -> None:
        launcher = self.launcher
        if interpreting():
            launcher(grid, *args, *self.fixed)
            return
        key = (torch.cuda.current_device(), launcher.num_stages, specialization(args))
        run = self._compiled.get(key)
        if run is not None:
            full = (*args, *self._rest) if self._rest is not None else launcher._all_args((*args, *self.fixed))
            run((*grid, 1, 1)[:3], full)
            return
        stages = launcher.num_stages
        compiled = launcher._first(grid, (*args, *self.fixed))
        if compiled is not None:
            key = key if stages == launcher.num_stages else (key[0], launcher.num_stages, key[2])
            self._compiled[key] = _runner(compiled)


_LAUNCHERS = LRUCache(512)


def launcher(kernel, num_warps: int, num_stages: int | None = None, **constexprs) -> Launcher:
    """The shared `Launcher` of this kernel and configuration (plans keep theirs; this finds it)."""
    key = (kernel, num_warps, num_stages, tuple(sorted(constexprs.items())))
    return _LAUNCHERS.get_or_make(key, lambda: Launcher(kernel, constexprs, num_warps, num_stages))


def launch(kernel, grid: tuple, args: tuple, num_warps: int, num_stages: int | None, constexprs: dict) -> None:
    """`kernel[grid](*args, **constexprs)` through its shared `Launcher`."""
    launcher(kernel, num_warps, num_stages, **constexprs)(grid, *args)
