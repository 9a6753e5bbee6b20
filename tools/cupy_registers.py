"""Registers, spilled bytes and shared memory of the CuPy backend's tensor-core kernels, built the
way the backend builds them and through nvcc for comparison. No GPU needed.

NVRTC column: launch.source_text() compiled by libnvrtc with launch.mma_options(code), the options
CuPy's RawModule appends (-ftz=true, -arch=sm_XX, --device-as-default-execution-space) and the
variants' names as name expressions, exactly as launch._mma_functions does; the numbers are those
of NVRTC's own ptxas (--ptxas-options=-v), the cubin CuPy loads.
nvcc column: the same text with the same templates instantiated explicitly, nvcc --ptx with the same
defines and -ftz=true, then the standalone ptxas of the same release. A difference is the front
end's (the PTX), not the assembler's. nvrtc_compile also returns NVRTC's PTX, to diff against
nvcc_ptx's.

    python tools/cupy_registers.py                        # every variant, sm_90 and sm_80, bf16 and fp16
    python tools/cupy_registers.py --arch 90 --dtype bf16 --dims 128x128 --compiler nvrtc

libnvrtc comes from the `nvidia-cuda-nvrtc` wheel (pip install nvidia-cuda-nvrtc), a CUDA toolkit's
lib64, or $STREAMKL_NVRTC; nvcc and ptxas from PATH, /usr/local/cuda/bin or $CUDA_HOME/bin.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from streamkl.backends.cupy.launch import (  # noqa: E402
    MmaBackward,
    MmaForward,
    backward_variants,
    forward_shape,
    mma_options,
    source_text,
)

DTYPES = {"fp16": (1, torch.float16), "bf16": (2, torch.bfloat16)}
# what CuPy (14, cupy/cuda/compiler.py) appends to a RawModule's options, besides -arch=sm_XX and
# include paths (no header is included)
CUPY_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")
# head-dim pairs whose variants the report covers: the two common sizes, small, unequal, wide
DEFAULT_DIMS = ("64x64", "128x128", "16x48", "64x48", "128x80", "208x144", "256x256")


# ---------------------------------------------------------------------------------- the variants
def variants_for(dim1: int, dim2: int, dtype: torch.dtype) -> list[MmaForward | MmaBackward]:
    """Every tensor-core kernel the backend launches for head dims (dim1, dim2): the forward and
    the backward launches of every gradient subset, deterministic or not, GQA groups alike or not."""
    found: dict[str, MmaForward | MmaBackward] = {}
    forward = forward_shape(-(-dim1 // 16) * 16, -(-dim2 // 16) * 16)
    found[forward.name] = forward
    for deterministic in (False, True):
        for heads_k in ((2, 2), (2, 1)):
            problem = SimpleNamespace(dtype=dtype, dim1=dim1, dim2=dim2, deterministic=deterministic,
                                      heads_k1=heads_k[0], heads_k2=heads_k[1])
            for mask in range(1, 16):
                needs = tuple(bool(mask >> bit & 1) for bit in range(4))
                for variant in backward_variants(problem, needs):
                    found.setdefault(variant.name, variant)
    return list(found.values())


# ---------------------------------------------------------------------------------- compilers
def _tool(name: str) -> str:
    for candidate in (shutil.which(name), f"/usr/local/cuda/bin/{name}",
                      os.path.join(os.environ.get("CUDA_HOME", "/nonexistent"), "bin", name)):
        if candidate and os.path.exists(candidate):
            return candidate
    raise SystemExit(f"cupy_registers: {name} not found (PATH, /usr/local/cuda/bin, $CUDA_HOME/bin)")


def _nvrtc_library() -> ctypes.CDLL:
    candidates = [os.environ.get("STREAMKL_NVRTC", "")]
    for root in sys.path:
        candidates += sorted(glob.glob(os.path.join(root, "nvidia", "cu*", "lib", "libnvrtc.so.*")))
        candidates += sorted(glob.glob(os.path.join(root, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.*")))
    candidates += sorted(glob.glob("/usr/local/cuda/lib64/libnvrtc.so*")) + ["libnvrtc.so"]
    for candidate in candidates:
        if candidate and "alt" not in os.path.basename(candidate):
            try:
                # its builtins first, by path: NVRTC opens them by name, off the loader's path
                for builtins in glob.glob(os.path.join(os.path.dirname(candidate), "libnvrtc-builtins.so.*")):
                    if "alt" not in os.path.basename(builtins):
                        ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
                return ctypes.CDLL(candidate)
            except OSError:
                continue
    raise SystemExit("cupy_registers: libnvrtc not found (pip install nvidia-cuda-nvrtc, or set STREAMKL_NVRTC)")


def nvrtc_version() -> str:
    lib = _nvrtc_library()
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


@dataclass
class Usage:
    registers: int
    spill_stores: int
    spill_loads: int
    stack: int


def nvrtc_compile(code: int, arch: int, names: list[str], options: tuple[str, ...] = ()):
    """(PTX, {name expression: mangled name}, NVRTC's log) of the backend's source compiled by NVRTC
    as CuPy compiles it, to a cubin with NVRTC's own ptxas reporting (-v); `options` go after
    CuPy's (an experiment's extra options)."""
    lib = _nvrtc_library()
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    program = ctypes.c_void_p()

    def log() -> str:
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        buffer = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(program, buffer)
        return buffer.value.decode(errors="replace")

    def check(status: int) -> None:
        if status:
            raise RuntimeError(f"NVRTC: {lib.nvrtcGetErrorString(status).decode()}\n{log() if program else ''}")

    check(lib.nvrtcCreateProgram(ctypes.byref(program), source_text().encode(), b"kernels.cu", 0, None, None))
    try:
        for name in names:
            check(lib.nvrtcAddNameExpression(program, name.encode()))
        # CuPy (13, 14) asks NVRTC for a cubin (-arch=sm_XX), NVRTC running ptxas itself
        all_options = (*mma_options(code), *CUPY_OPTIONS, f"-arch=sm_{arch}", "--ptxas-options=-v", *options)
        encoded = [option.encode() for option in all_options]
        check(lib.nvrtcCompileProgram(program, len(encoded), (ctypes.c_char_p * len(encoded))(*encoded)))
        size = ctypes.c_size_t()
        check(lib.nvrtcGetPTXSize(program, ctypes.byref(size)))
        buffer = ctypes.create_string_buffer(size.value)
        check(lib.nvrtcGetPTX(program, buffer))
        lowered = {}
        for name in names:
            mangled = ctypes.c_char_p()
            check(lib.nvrtcGetLoweredName(program, name.encode(), ctypes.byref(mangled)))
            lowered[name] = mangled.value.decode()
        return buffer.value.decode(), lowered, log()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


def nvrtc_usage(code: int, arch: int, names: list[str], options: tuple[str, ...] = ()) -> dict[str, Usage]:
    """{name expression: Usage} of the kernels `names` as CuPy's NVRTC builds them (NVRTC's ptxas)."""
    _, lowered, text = nvrtc_compile(code, arch, names, options)
    usage = parse_ptxas(text)
    return {name: usage[lowered[name]] for name in names}


def nvcc_ptx(code: int, arch: int, names: list[str], options: tuple[str, ...] = ()) -> str:
    """PTX of the same text through nvcc, the templates instantiated explicitly."""
    defines = [option for option in mma_options(code) if option.startswith("-D")]
    with tempfile.TemporaryDirectory() as directory:
        unit = Path(directory, "unit.cu")
        lines = [source_text(), *(f"template __global__ void {name}(const KLParams);" for name in names)]
        unit.write_text("\n".join(lines) + "\n")
        out = Path(directory, "unit.ptx")
        command = [_tool("nvcc"), f"-arch=sm_{arch}", "-std=c++17", *defines, "-ftz=true", *options, "--ptx",
                   str(unit), "-o", str(out)]
        subprocess.run(command, check=True, capture_output=True, text=True)
        return out.read_text()


def ptxas_usage(ptx: str, arch: int) -> dict[str, Usage]:
    """{mangled entry name: Usage} from the standalone ptxas -v on `ptx` for sm_`arch`."""
    with tempfile.TemporaryDirectory() as directory:
        source = Path(directory, "unit.ptx")
        source.write_text(ptx)
        result = subprocess.run([_tool("ptxas"), "-v", f"-arch=sm_{arch}", str(source), "-o",
                                 str(Path(directory, "unit.cubin"))], capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"ptxas failed:\n{result.stderr}")
    return parse_ptxas(result.stderr)


def parse_ptxas(text: str) -> dict[str, Usage]:
    """{mangled entry name: Usage} from ptxas -v's report."""
    usage: dict[str, Usage] = {}
    entry, frame = None, (0, 0, 0)
    for line in text.splitlines():
        if match := re.search(r"Compiling entry function '(\w+)'", line):
            entry, frame = match.group(1), (0, 0, 0)
        elif match := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line):
            frame = tuple(int(group) for group in match.groups())
        elif (match := re.search(r"Used (\d+) registers", line)) and entry is not None:
            usage[entry] = Usage(int(match.group(1)), frame[1], frame[2], frame[0])
            entry = None
    return usage


# ---------------------------------------------------------------------------------- report
def measure(code: int, arch: int, variants, compilers, extra=()) -> dict[str, dict[str, Usage]]:
    """{compiler: {variant name: Usage}}: "nvrtc" as CuPy builds them, "nvcc" through nvcc --ptx
    and the standalone ptxas."""
    names = [variant.name for variant in variants]
    results = {}
    if "nvrtc" in compilers:
        results["nvrtc"] = nvrtc_usage(code, arch, names, extra)
    if "nvcc" in compilers:
        usage = ptxas_usage(nvcc_ptx(code, arch, names), arch)
        results["nvcc"] = {name: usage[_mangled(name)] for name in names}
    return results


def _mangled(name: str) -> str:
    """The Itanium name of `kl_..._mma<a, b, ...>(KLParams)` (what nvcc and NVRTC emit)."""
    base, args = name[:-1].split("<")
    values = "".join(f"Li{int(value)}E" for value in args.split(","))
    return f"_Z{len(base)}{base}I{values}Ev8KLParams"


def _cell(usage: Usage) -> str:
    spill = usage.spill_stores + usage.spill_loads
    return f"{usage.registers}" + (f" (spill {usage.spill_stores}+{usage.spill_loads} B)" if spill else "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 80])
    parser.add_argument("--dtype", nargs="+", default=["bf16", "fp16"], choices=sorted(DTYPES))
    parser.add_argument("--dims", nargs="+", default=list(DEFAULT_DIMS), help="head-dim pairs D1xD2")
    parser.add_argument("--compiler", nargs="+", default=["nvrtc", "nvcc"], choices=["nvrtc", "nvcc"])
    parser.add_argument("--nvrtc-option", action="append", default=[],
                        help="an extra NVRTC option, after CuPy's (an experiment)")
    args = parser.parse_args(argv)
    variants: dict[str, MmaForward | MmaBackward] = {}
    for dims in args.dims:
        dim1, dim2 = (int(part) for part in dims.split("x"))
        for variant in variants_for(dim1, dim2, torch.bfloat16):
            variants.setdefault(variant.name, variant)
    chosen = list(variants.values())
    print(f"NVRTC {nvrtc_version()}; options {' '.join(mma_options(0)[:1] + CUPY_OPTIONS + tuple(args.nvrtc_option))}")
    for arch in args.arch:
        for dtype in args.dtype:
            code = DTYPES[dtype][0]
            results = measure(code, arch, chosen, args.compiler, tuple(args.nvrtc_option))
            print(f"\nsm_{arch} {dtype}: registers (spilled bytes stored+loaded), dynamic shared memory")
            header = f"{'kernel':<44}" + "".join(f"{compiler:>24}" for compiler in args.compiler) + f"{'smem':>8}"
            print(header)
            for variant in chosen:
                cells = [_cell(results[compiler][variant.name]) for compiler in args.compiler]
                print(f"{variant.name:<44}" + "".join(f"{cell:>24}" for cell in cells) + f"{variant.shared_bytes:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
