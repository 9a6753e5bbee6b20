"""Call plans: an eager call with the arguments of a call served before skips the front end.

`streamkl.kl`'s host path before its first launch (validation, backend choice, autograd layers, tile
schedule, the backend's launch decisions, output allocation, launch arguments) cost ~50 us a call on
a CPU host and ~0.2 ms on the H200's, paid before the GPU starts: in a synchronized measurement or
a short call (90 % block sparsity: a 0.5 ms forward) that is a sizeable share. Each of those steps
is already memoized by the call's metadata (`build_problem`, `get_schedule`, the backends' launch
plans kept in `Problem.extra`); a plan jumps straight to the end of the chain.

After a call, the front end asks the backend for a launcher of that problem (`Backend.
forward_launcher`: a closure allocating the outputs and launching the already compiled kernel on
the call's tensors, or None) and keeps it, with the problem, backend and schedule, under a key of
everything the path read: the inputs' metadata, the options and the masks / cu_seqlens passed (by
identity and version, as `build_problem`'s memo), the output options, the environment variables
read at call time, the grad mode, and `GENERATION`: a count of attribute assignments on the
package's modules that hold switches (`WATCHED`: the switches set by tests and A/B scripts, or
functions monkeypatched there), so that any such change retires every plan. A launcher returns
None where it cannot serve a call (an input not 16-byte aligned, another current device, a launch
hook set): the front end then takes the full path. Never while compiling, under a dispatch mode or a functorch transform
(`autograd.eager_fast_path`).
"""

from __future__ import annotations

import os
import sys
import types
from collections import OrderedDict

import torch

#: False: no plan is made or used (every call takes the full path; A/B timings, tests).
ENABLED = True

#: Attribute assignments on the package's modules since import (any retires every plan).
GENERATION = [0]
_ROOT = __name__.rsplit(".", 1)[0]  # the package's name ("streamkl", or a renamed copy's)
_ENV = ("STREAMKL_BACKEND", "STREAMKL_GLUON", "TRITON_INTERPRET", "STREAMKL_CUPY_EMULATE")  # read at call time
_PLANS: OrderedDict = OrderedDict()
_WATCHED = [0]  # len(sys.modules) when the package's modules were last watched


class _WatchedModule(types.ModuleType):
    """A module whose attribute assignments (a switch set, a function monkeypatched) advance
    `GENERATION`, but for a module assigned (the import system binding a submodule to its package
    when first imported: a backend's lazily imported modules). Reads are plain module reads."""

    def __setattr__(self, name, value):
        if not isinstance(value, types.ModuleType):
            GENERATION[0] += 1
        super().__setattr__(name, value)

    def __delattr__(self, name):
        GENERATION[0] += 1
        super().__delattr__(name)


#: The modules watched: those holding the switches the plans' paths read (and the front end's), none
#: that code traced by torch.compile imports inside a function (the packages, triton/common.py, the
#: CuPy and torch backends, sparse/: TorchDynamo before torch 2.13 refuses an import whose result is
#: not exactly a module, `istype`; the GPU compile tests, tests/test_gpu_capture.py, cover that).
WATCHED = ("api", "autograd", "plans", "dispatch", "problem", "backends.base", "backends.triton.forward",
           "backends.triton.backward", "backends.triton.gluon_forward", "backends.triton.gluon_backward")


def watch_modules() -> None:
    """Give the `WATCHED` modules loaded `_WatchedModule`'s class (a plan is made after a call,
    which loaded every module its path reads)."""
    if len(sys.modules) == _WATCHED[0]:
        return
    for name in WATCHED:
        module = sys.modules.get(f"{_ROOT}.{name}")
        if module is not None and type(module) is types.ModuleType:
            module.__class__ = _WatchedModule
    _WATCHED[0] = len(sys.modules)


def _environment() -> tuple:
    """The values of the `_ENV` variables: from `os.environ`'s own dict of encoded names where it is
    CPython's `os._Environ` (`os.environ.get` encodes each name first: ~4 us of the H200's host for
    four), else by `get`. (Bytes or str values: a key compares them only with its own kind.)"""
    env = os.environ
    if env.__class__ is _ENVIRON:
        data, keys = env._data, _ENV_BYTES
        return data.get(keys[0]), data.get(keys[1]), data.get(keys[2]), data.get(keys[3])
    return env.get(_ENV[0]), env.get(_ENV[1]), env.get(_ENV[2]), env.get(_ENV[3])


_ENVIRON = getattr(os, "_Environ", None) if isinstance(getattr(os.environ, "_data", None), dict) else None
_ENV_BYTES = tuple(os.environ.encodekey(name) for name in _ENV) if _ENVIRON is not None else None


def plan_key(call_key, reduction, return_lse, backend) -> tuple:
    """The key of a call: `problem._call_key`'s (inputs, options, masks) and what else it reads."""
    return (call_key, reduction.__class__, reduction, return_lse.__class__, return_lse, backend.__class__, backend,
            _environment(), torch.is_grad_enabled(), GENERATION[0])


class CallPlan:
    """What a call with a planned key runs: the launcher, then the reduction (and autograd)."""

    __slots__ = ("objects", "problem", "impl", "schedule", "launch", "reduction", "return_lse", "grad", "count",
                 "generation", "backward_launch", "rows")

    def __init__(self, objects, problem, impl, schedule, launch, reduction, return_lse, grad, generation):
        from streamkl.problem import structural_row_count

        self.objects, self.problem, self.impl, self.schedule = objects, problem, impl, schedule
        self.launch, self.reduction, self.return_lse, self.grad = launch, reduction, return_lse, grad
        self.generation = generation
        self.backward_launch = None  # None: not asked for yet (`learn_backward`); False: the backend has none
        self.count = structural_row_count(problem) if reduction == "mean" else None  # None: per call (mean_count)
        if self.count is not None:
            self.count = max(self.count, 1)
        # a launcher's `rows` (kl_rows, and lse1 for a per-call count) where nothing else of the
        # forward is read: no grad, no statistics returned, a reduced result (not the rows
        # themselves, which may view a larger allocation)
        self.rows = None
        if not grad and not return_lse and reduction in ("sum", "mean"):
            self.rows = getattr(launch, "rows", None)

    def run(self, q1, k1, q2, k2):
        """The call's result, or None where the launcher declined it (the caller takes the full path)."""
        from streamkl.autograd import _EagerKL, reduce_rows

        if self.rows is not None:
            outputs = self.rows(q1, k1, q2, k2, self.reduction == "mean" and self.count is None)
            if outputs is None:
                return None
            return reduce_rows(outputs[0], outputs[1], self.reduction, self.problem, self.count, self.schedule)
        if self.grad:
            out, lse1, lse2, _ = _EagerKL.apply(q1, k1, q2, k2, self.problem, self.impl, self.reduction, self)
        else:
            outputs = self.launch(q1, k1, q2, k2)
            if outputs is None:
                return None
            kl_rows, lse1, lse2, _ = outputs
            out = reduce_rows(kl_rows, lse1, self.reduction, self.problem, self.count, self.schedule)
        if self.return_lse:
            return out, lse1.detach(), lse2.detach()
        return out

    def backward(self, q1, k1, q2, k2, lse1, lse2, expect, grad_rows):
        """The backward's gradients through the backend's backward launcher (`Backend.
        backward_launcher`), or None: none yet, the plan retired since its forward (a switch set in
        between), or the launcher declined (the caller then runs the backend's backward)."""
        launch = self.backward_launch
        if not launch or self.generation != GENERATION[0]:
            return None
        return launch(q1, k1, q2, k2, lse1, lse2, expect, grad_rows)

    def learn_backward(self, needs) -> None:
        """After a backward of this plan took the full path: ask the backend for its launcher."""
        if self.backward_launch is None and self.generation == GENERATION[0]:
            watch_modules()  # (the backward's modules, loaded by its first call)
            self.backward_launch = self.impl.backward_launcher(self.problem, self.schedule, tuple(needs)) or False


def find(key, objects) -> CallPlan | None:
    plan = _PLANS.get(key)
    if plan is None or not all(a is b for a, b in zip(plan.objects, objects)):
        return None
    _PLANS.move_to_end(key)
    return plan


def remember(key, objects, problem, impl, reduction, return_lse, grad) -> None:
    """Keep a plan for `key` after its call ran the full path, if the backend gives a launcher."""
    from streamkl.sparse.schedule import get_schedule

    schedule = get_schedule(problem, *impl.tile_sizes(problem))  # (the call's own: cached)
    launch = impl.forward_launcher(problem, schedule)
    if launch is None:
        return
    watch_modules()
    if key[-1] != GENERATION[0]:  # (watching changed nothing, but a switch set during the call would)
        return
    _PLANS[key] = CallPlan(objects, problem, impl, schedule, launch, reduction, return_lse, grad, key[-1])
    while len(_PLANS) > 32:
        _PLANS.popitem(last=False)
