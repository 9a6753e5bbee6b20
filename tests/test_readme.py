"""Every ```python block of README.md, docs/performance.md and docs/indexer.md runs as written: on this
machine's device, or, for a block whose first line says it needs a CUDA GPU, only where there is one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCUMENTS = (README, ROOT / "docs" / "performance.md", ROOT / "docs" / "indexer.md")
GPU_LINE = "# needs a CUDA GPU"


def _blocks(path: Path) -> list[tuple[str, str]]:
    text = path.read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    out = []
    for index, code in enumerate(blocks):
        line = text[: text.index(code)].count("\n") + 1
        out.append((f"{path.stem}-block{index}-line{line}", code))
    return out


BLOCKS = [(path, name, code) for path in DOCUMENTS for name, code in _blocks(path)]


def test_readme_has_code_blocks():
    assert len(_blocks(README)) >= 3


@pytest.mark.parametrize("path, code", [pytest.param(path, code, id=name) for path, name, code in BLOCKS])
def test_readme_block_runs(path, code, monkeypatch, capsys):
    needs_gpu = code.lstrip().startswith(GPU_LINE)
    if needs_gpu and not torch.cuda.is_available():
        pytest.skip("the block says it needs a CUDA GPU")
    if not torch.cuda.is_available():
        monkeypatch.setenv("STREAMKL_BACKEND", "torch")  # what auto picks for CPU tensors, stated
    exec(compile(code, str(path), "exec"), {"__name__": "__readme__"})  # a fresh namespace per block
