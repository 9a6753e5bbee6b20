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
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ["info"]:
        print("usage: python -m streamkl info", file=sys.stderr)
        return 2
    print(info())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
