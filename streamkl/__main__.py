"""`python -m streamkl info`: which backends are usable here, and why not."""

from __future__ import annotations

import sys


def info() -> str:
    import os

    import torch

    import streamkl
    from streamkl.dispatch import ENV_VAR, backend_report

    lines = [
        f"streamkl {streamkl.__version__}, torch {torch.__version__}, python {sys.version.split()[0]}",
        f"CUDA device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}",
        f"${ENV_VAR}: {os.environ.get(ENV_VAR, '(unset)')}",
        "",
        f"{'backend':<8} {'usable':<7} why not",
    ]
    for name, usable, reasons in backend_report():
        lines.append(f"{name:<8} {'yes' if usable else 'no':<7} {'; '.join(reasons) or '-'}")
    lines += ["", gluon_status()]
    return "\n".join(lines)


def gluon_status() -> str:
    """Whether the triton backend's Gluon kernels (Hopper) can run here, and how they are chosen."""
    import torch

    where = "Gluon kernels (sm_90, triton 3.6): "
    try:
        from streamkl.backends.triton.gluon import IMPORT_ERROR
    except Exception as exc:  # noqa: BLE001 - no triton, or one that fails to import
        return where + f"no ({type(exc).__name__}: {exc})"
    if IMPORT_ERROR is not None:
        return where + f"no ({IMPORT_ERROR})"
    if not torch.cuda.is_available():
        return where + "no (no CUDA GPU is visible)"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return where + f"no (this GPU is sm_{major}{minor})"
    return where + "yes, where measured faster (backends/triton/select.py)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ["info"]:
        print("usage: python -m streamkl info", file=sys.stderr)
        return 2
    print(info())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
