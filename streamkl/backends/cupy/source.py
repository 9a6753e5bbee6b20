"""The CUDA sources as the backend reads them: the text NVRTC compiles (local includes inlined) and
the NumPy record of a kernel-argument struct, parsed from that struct's declaration."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

_INCLUDE = re.compile(r'^#include "([A-Za-z0-9_.]+)"[ \t]*$', re.M)
_PRAGMA_ONCE = re.compile(r"^#pragma once[ \t]*$", re.M)  # each file is inlined once; not in a main file
_C_TYPES = {"sk_u64": np.uint64, "long long": np.int64, "int": np.int32, "float": np.float32}


def inline_includes(source: Path) -> str:
    """`source` with its local includes (`#include "name"`, next to it) inlined, each file once:
    NVRTC then needs no include path, and CuPy's on-disk cache, which keys on the text, recompiles
    when any included file changes."""
    seen: set[str] = set()

    def expand(text: str) -> str:
        def inline(match: re.Match) -> str:
            name = match.group(1)
            if name in seen:
                return ""
            seen.add(name)
            return expand(_PRAGMA_ONCE.sub("", (source.parent / name).read_text()))

        return _INCLUDE.sub(inline, text)

    return expand(source.read_text())


def record_dtype(source: Path, struct: str) -> np.dtype:
    """The NumPy record matching `struct <struct> { ... };` of `source`, field for field (its fields
    ordered so that C and NumPy agree without padding rules: 8-byte fields first)."""
    body = re.search(rf"struct {struct} \{{(.*?)\n\}};", source.read_text(), re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    names, formats = [], []
    for declaration in body.split(";"):
        declaration = " ".join(declaration.split())
        if not declaration:
            continue
        match = re.fullmatch(r"(sk_u64|long long|int|float) (.+)", declaration)
        if match is None:
            raise RuntimeError(f"{source.name}: unexpected {struct} field declaration {declaration!r}")
        for name in match.group(2).split(","):
            names.append(name.strip())
            formats.append(_C_TYPES[match.group(1)])
    return np.dtype({"names": names, "formats": formats}, align=True)
