"""The private Triton APIs the backend needs, in one place, gated to the version they were
written against (triton 3.6), each with a fallback where one exists.

- `patch_interpreter_index`: Triton 3.x's CPU interpreter turns a scalar into a Python int with
  `int(array)`, which NumPy >= 2.3 refuses for the size-1 arrays it keeps scalars in, so
  `range(n)` over a runtime bound fails; index through the array's single element instead.
  Without the private hook (another triton) nothing is patched.
- `tma_reduce_add`: a TMA bulk reduction (`cp.reduce.async.bulk.tensor ... add`) from a shared
  tile, for the Gluon backward's dq tiles. Gluon 3.6 has the op in its builder but no wrapper;
  where the builder lacks it the Gluon kernels are off (`gluon.IMPORT_ERROR`).
- `direct_launch`: a kept compiled kernel launched by calling its launcher's C function with the
  arguments expanded as Triton's Python wrapper would (each TMA descriptor filled), past the
  wrapper's per-launch work (`CompiledKernel.__getitem__`'s runner, `CudaLauncher.__call__`,
  `wrap_handle_tensordesc`'s loop): about 20 us of host time a launch, which is most of a short
  training call's. Where the launcher is not triton 3.6's as expected, or a launch hook is set
  (a profiler), `compiled[grid](*args)` serves.
"""

from __future__ import annotations

import triton


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


_DIRECT_VERSION = "3.6."  # the launcher's C signature `direct_launch` was checked against


def _hooked(hook) -> bool:
    """Whether a launch hook is set: triton 3.6 keeps each as a HookChain, empty unless a tool
    (a profiler) adds to it; a hook assigned outright is any other callable."""
    return hook is not None and bool(getattr(hook, "calls", True))


def direct_launch(compiled):
    """`launch(grid, args)` doing what `compiled[grid](*args)` does (grid: 3 ints; args: every
    parameter's value, constexprs included, as the runner takes them), or None where this triton's
    launcher is not the one it was written for: another version, scratch memory, descriptors passed
    lowered (no metadata), fp4 padding, another wrapper."""
    if not triton.__version__.startswith(_DIRECT_VERSION):
        return None
    try:
        from triton import knobs
        from triton.backends.nvidia import driver as nvidia
    except Exception:  # pragma: no cover - triton without its NVIDIA backend
        return None
    run = getattr(compiled, "run", None)
    if not isinstance(run, nvidia.CudaLauncher) or run.global_scratch_size or run.profile_scratch_size:
        return None
    c_launch = run.launch
    positions, metas = [], []
    if getattr(c_launch, "__closure__", None):  # wrap_handle_tensordesc's `inner`
        cells = dict(zip(c_launch.__code__.co_freevars, (c.cell_contents for c in c_launch.__closure__)))
        if set(cells) != {"launcher", "tensordesc_indices", "tensordesc_meta"}:
            return None
        c_launch, positions, metas = cells["launcher"], sorted(cells["tensordesc_indices"]), cells["tensordesc_meta"]
        if len(positions) != len(metas) or any(m is None or m["fp4_padded"] for m in metas):
            return None
    driver = triton.runtime.driver.active
    fill, stream, device = driver.utils.fill_tma_descriptor, driver.get_current_stream, driver.get_current_device
    to_host = nvidia.TMA_DTYPE_DEVICE_TO_HOST
    specs = [(p, m["swizzle"], m["elem_size"], to_host[m["elem_type"]], m["block_size"])
             for p, m in zip(positions, metas)]
    # the C function's leading arguments after the grid and stream; launch metadata and hooks None
    head = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None, compiled.packed_metadata,
            None, None, None)
    hooks = knobs.runtime

    def launch(grid, args) -> None:
        if _hooked(hooks.launch_enter_hook) or _hooked(hooks.launch_exit_hook):
            compiled[grid](*args)  # a profiler's hooks: Triton's own path calls them
            return
        out = [*grid, stream(device()), *head]
        start = 0
        for position, swizzle, size, dtype, block in specs:
            out += args[start:position]
            desc = args[position]
            shape, strides = desc.shape, desc.strides
            out.append(fill(desc.base.data_ptr(), swizzle, size, dtype, block, shape, strides,
                            1 if desc.padding == "nan" else 0))
            out += shape
            out += strides
            start = position + 1
        out += args[start:]
        c_launch(*out)

    return launch
