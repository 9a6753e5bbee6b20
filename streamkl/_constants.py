"""Numbers every part of streamkl shares, defined once."""

from __future__ import annotations

LOG2E = 1.4426950408889634  # log2(e): natural-log scores to base-2 (the kernels use exp2)
LN2 = 0.6931471805599453  # ln(2): base-2 statistics back to natural logs
NEG_INF = float("-inf")
#: The largest head dimension the GPU kernels take.
MAX_HEAD_DIM = 256
#: Window bounds and lengths travel to the kernels as int32.
MAX_INT32 = 2**31 - 1
