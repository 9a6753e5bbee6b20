"""`python -m streamkl info`: which backends are usable here, and why not."""

from __future__ import annotations

import argparse
import sys

#: The Triton release line the Gluon (Hopper) kernels are written against; other versions run the
#: portable Triton kernels.
GLUON_TRITON = "3.6"


def info() -> str:
    """The report `python -m streamkl info` prints: versions, device, each backend's status."""
    import os

    import torch

    import streamkl
    from streamkl.dispatch import ENV_VAR, backend_report

    lines = [
        f"streamkl {streamkl.__version__}, torch {torch.__version__}, triton {_triton_version() or 'not installed'}, "
        f"python {sys.version.split()[0]}",
        f"CUDA device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}",
        f"${ENV_VAR}: {os.environ.get(ENV_VAR, '(unset)')}",
        "",
        f"{'backend':<8} {'usable':<7} why not",
    ]
    for name, usable, reasons in backend_report():
        lines.append(f"{name:<8} {'yes' if usable else 'no':<7} {'; '.join(reasons) or '-'}")
    lines += ["", gluon_status()]
    return "\n".join(lines)


def _triton_version() -> str | None:
    try:
        import triton
    except Exception:  # noqa: BLE001 - not installed, or fails to import
        return None
    return str(triton.__version__)


def gluon_status() -> str:
    """Whether the triton backend's Gluon kernels (Hopper, triton 3.6) can run here."""
    import torch

    where = f"Gluon kernels (sm_90, triton {GLUON_TRITON}.x): "
    if _triton_version() is None:
        return where + "no (triton is not installed)"
    try:
        from streamkl.backends.triton.gluon import IMPORT_ERROR
    except Exception as exc:  # noqa: BLE001 - a triton that fails to import
        return where + f"no ({type(exc).__name__}: {exc})"
    if IMPORT_ERROR is not None:
        return where + f"no ({IMPORT_ERROR}; the portable Triton kernels run instead)"
    if not torch.cuda.is_available():
        return where + "no (no CUDA GPU is visible)"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return where + f"no (this GPU is sm_{major}{minor}; the portable Triton kernels run)"
    return where + "yes, where select.py chooses them (docs/kernels.md)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m streamkl", description="streamkl: fused, streaming KL between attention distributions."
    )
    commands = parser.add_subparsers(dest="command", metavar="command")
    commands.add_parser("info", help="versions, the CUDA device, and which backends are usable here and why not")
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    print(info())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
