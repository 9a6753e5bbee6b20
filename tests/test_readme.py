"""Every ```python block of README.md runs as written: on this machine's device, or, for a block whose
first line says it needs a CUDA GPU, only where there is one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"
GPU_LINE = "# needs a CUDA GPU"


def _blocks() -> list[tuple[str, str]]:
    text = README.read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    out = []
    for index, code in enumerate(blocks):
        line = text[: text.index(code)].count("\n") + 1
        out.append((f"block{index}-line{line}", code))
    return out


BLOCKS = _blocks()


def test_readme_has_code_blocks():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("code", [pytest.param(code, id=name) for name, code in BLOCKS])
def test_readme_block_runs(code, monkeypatch, capsys):
    needs_gpu = code.lstrip().startswith(GPU_LINE)
    if needs_gpu and not torch.cuda.is_available():
        pytest.skip("the block says it needs a CUDA GPU")
    if not torch.cuda.is_available():
        monkeypatch.setenv("STREAMKL_BACKEND", "torch")  # what auto picks for CPU tensors, stated
    exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})  # a fresh namespace per block
