"""The private Triton APIs the backend needs, in one place, gated to the version they were
written against (triton 3.6), each with a fallback where one exists.

- `patch_interpreter_index`: Triton 3.x's CPU interpreter turns a scalar into a Python int with
  `int(array)`, which NumPy >= 2.3 refuses for the size-1 arrays it keeps scalars in, so
  `range(n)` over a runtime bound fails; index through the array's single element instead.
  Without the private hook (another triton) nothing is patched.
- `tma_reduce_add`: a TMA bulk reduction (`cp.reduce.async.bulk.tensor ... add`) from a shared
  tile, for the Gluon backward's dq tiles. Gluon 3.6 has the op in its builder but no wrapper;
  where the builder lacks it the Gluon kernels are off (`gluon.IMPORT_ERROR`).
"""

from __future__ import annotations


def patch_interpreter_index() -> None:
    """Make the interpreter's scalars index as ints under NumPy >= 2.3 (idempotent)."""
    try:
        from triton.runtime import interpreter

        original = interpreter._patch_lang_tensor
    except (ImportError, AttributeError):  # pragma: no cover - another triton: nothing to patch
        return
    if getattr(original, "_streamkl_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._streamkl_patched = True
    interpreter._patch_lang_tensor = patched


try:
    from triton._C.libtriton import ir as _ir
    from triton.experimental.gluon.language._core import builtin as _builtin

    _ir.DESCRIPTOR_REDUCE_KIND.ADD  # noqa: B018 - the op this needs
except Exception as exc:  # pragma: no cover - another triton
    TMA_REDUCE_ERROR: str | None = f"{type(exc).__name__}: {exc}"
else:
    TMA_REDUCE_ERROR = None

    @_builtin
    def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        """global[coord ...] += src (a shared tile in the descriptor's layout), by one TMA bulk
        reduction (asynchronous: `tma.store_wait` before src is written again)."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)
