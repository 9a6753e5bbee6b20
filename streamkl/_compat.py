"""The private PyTorch API the front end reads, in one place, with its fallback.

- `dispatch_modes_active`: whether a TorchDispatchMode (make_fx, FakeTensorMode, FlopCounterMode,
  ...) is on the stack. Eager calls skip the dispatcher's round trip through streamkl's ops only
  when none is (`autograd._direct`); torch has no public query. Where the private function is
  missing, every call takes the ops (correct, a little more host time).
"""

from __future__ import annotations

import torch

_stack_length = getattr(torch._C, "_len_torch_dispatch_stack", None)


def dispatch_modes_active() -> bool:
    """True when a TorchDispatchMode may be active (always, where torch does not say)."""
    return _stack_length is None or _stack_length() > 0
