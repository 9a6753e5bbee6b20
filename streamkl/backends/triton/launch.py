"""Launching and what the backend keeps between calls.

Every kernel is launched through Triton's public API (`kernel[grid](*args, **constexprs)`; TMA
descriptors are `TensorDescriptor` objects). A portable kernel whose shared memory does not fit
at the requested pipeline depth is retried shallower, and the depth that fits is remembered.

`PlanCache` keeps per-problem launch decisions (grids, constexprs, scalar arguments, the schedule
tensors they read) so that a repeated call does no selection work. Keys are `Problem.key` (every
structural field, and cu_seqlens / mask tensors by identity and version) plus what else a plan
reads; the plan holds the problem, so the tensors behind the key's ids stay alive with it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import triton

from streamkl.backends.triton.common import interpreting


class PlanCache:
    """A thread-safe LRU map: `get(key, make)` returns the kept value or keeps `make()`'s."""

    def __init__(self, size: int = 64):
        self._size = size
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key, make: Callable[[], Any]):
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
                return value
        value = make()  # outside the lock: may compile or build schedules
        with self._lock:
            kept = self._items.setdefault(key, value)
            self._items.move_to_end(key)
            while len(self._items) > self._size:
                self._items.popitem(last=False)
        return kept

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


_STAGES_THAT_FIT: dict = {}
_STAGES_LOCK = threading.Lock()


def launch(kernel, grid: tuple, args: tuple, num_warps: int, num_stages: int, constexprs: dict) -> None:
    """`kernel[grid](*args, **constexprs)`; if its shared memory does not fit, retried with a
    shallower pipeline, the depth that fits remembered for this configuration."""
    key = (kernel.fn.__name__, num_warps, num_stages, *sorted(constexprs.items()))
    with _STAGES_LOCK:
        stages = _STAGES_THAT_FIT.get(key, num_stages)
    while True:
        try:
            kernel[grid](*args, num_warps=num_warps, num_stages=stages, **constexprs)
        except triton.runtime.errors.OutOfResources:
            if stages <= 1 or interpreting():
                raise
            stages -= 1
            continue
        with _STAGES_LOCK:
            _STAGES_THAT_FIT[key] = stages
        return
