"""Hopper (sm_90) kernels in Gluon, Triton's explicit-layout dialect, warp-specialized as in
FlashAttention-3: a producer warp streams tiles through an mbarrier ring with TMA while two
consumer warpgroups run asynchronous wgmma products and the softmax statistics.

- forward.py: one program per (128-row query tile, sequence, head).
- backward.py: the key-major pass (one program per 128-key tile): the student's gradients (dq2,
  dk2), or all four; its kernel body lives in backward_kernel.py and backward_rows.py.
- common.py: the producer warp, mask rules and host-side descriptors both share.

Gluon is experimental and its API moves between releases: these modules are imported only where
`IMPORT_ERROR` is None (triton 3.6). Gluon has no CPU interpreter; `common.compile_sm90` compiles
a kernel for sm_90a on any machine, which the CPU tests use to keep the code valid.
"""

from __future__ import annotations

IMPORT_ERROR: str | None
try:
    import triton
    from triton.experimental import gluon  # noqa: F401
    from triton.experimental.gluon import language  # noqa: F401
    from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401
except Exception as exc:  # pragma: no cover - depends on the installed triton
    IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
else:
    IMPORT_ERROR = None
    if not triton.__version__.startswith("3.6."):  # pragma: no cover - the API these kernels use
        IMPORT_ERROR = f"written against Gluon of triton 3.6, found triton {triton.__version__}"
    else:
        from streamkl.backends.triton._compat import TMA_REDUCE_ERROR

        IMPORT_ERROR = TMA_REDUCE_ERROR
