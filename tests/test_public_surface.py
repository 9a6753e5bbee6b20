"""What a user touches first: the package's attributes and installed files, `python -m streamkl`,
and `varlen.pack`."""

from __future__ import annotations

import fnmatch
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import streamkl
from streamkl.varlen import pack, unpack

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


def test_package_attributes():
    assert callable(streamkl.varlen.pack) and callable(streamkl.reference.reference_kl)
    assert streamkl.__version__.count(".") == 2
    assert (Path(streamkl.__file__).parent / "py.typed").exists()
    assert 'attr = "streamkl._version.__version__"' in (ROOT / "pyproject.toml").read_text()


def test_every_file_the_package_reads_is_installed():
    """A wheel holds a package's .py files and what `package-data` names: every other file under
    streamkl/ (kernel sources and headers the CuPy backend compiles, py.typed) must match it, or an
    installed (not editable) streamkl lacks it."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    missing = []
    for path in sorted((ROOT / "streamkl").rglob("*")):
        if path.is_dir() or path.suffix in (".py", ".pyc") or "__pycache__" in path.parts:
            continue
        package = ".".join(path.parent.relative_to(ROOT).parts)
        if not any(fnmatch.fnmatch(path.name, pattern) for pattern in package_data.get(package, [])):
            missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"not in pyproject's package-data: {missing}"


@pytest.mark.parametrize("args", [["--help"], []], ids=["help", "no-command"])
def test_main_usage_exits_zero(args):
    proc = _run("-m", "streamkl", *args)
    assert proc.returncode == 0, proc.stderr
    assert "info" in proc.stdout


def test_main_info():
    proc = _run("-m", "streamkl", "info")
    assert proc.returncode == 0, proc.stderr
    assert f"streamkl {streamkl.__version__}" in proc.stdout and "torch" in proc.stdout and "Gluon" in proc.stdout


def _padded(batch=3, n=7):
    keep = torch.rand(batch, n) < 0.6
    keep[0] = True  # one full sequence
    keep[-1] = False  # one empty sequence
    return keep


def test_pack_several_tensors_one_index():
    keep = _padded()
    q, k = torch.randn(3, 7, 2, 4), torch.randn(3, 7, 1, 8)
    q_packed, k_packed, cu_seqlens, max_seqlen = pack(keep, q, k)
    assert torch.equal(q_packed, q[keep]) and torch.equal(k_packed, k[keep])
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist()[0] == 0
    assert cu_seqlens.diff().tolist() == keep.sum(1).tolist() and max_seqlen == 7
    assert torch.equal(unpack(q_packed, keep)[keep], q[keep])


def test_pack_accepts_the_one_tensor_order_of_0_1():
    keep = _padded()
    x = torch.randn(3, 7, 5)
    old = pack(x, keep)
    new = pack(keep, x)
    assert len(old) == 3 and all(torch.equal(a, b) if torch.is_tensor(a) else a == b for a, b in zip(old, new))


def test_pack_does_not_read_lengths_when_max_seqlen_is_given(monkeypatch):
    """Given max_seqlen, pack traces into one graph (no .item(), the packed length read once)."""
    keep = _padded()
    q, k = torch.randn(3, 7, 2, 4), torch.randn(3, 7, 2, 4)
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("pack read a value with .item()"))
    q_packed, _, cu_seqlens, max_seqlen = pack(keep, q, k, max_seqlen=7)
    assert max_seqlen == 7 and torch.equal(q_packed, q[keep])
    monkeypatch.undo()
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        explained = torch._dynamo.explain(lambda *t: pack(*t, max_seqlen=7))(keep, q, k)
    assert explained.graph_break_count == 0, explained.break_reasons


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x, keep: pack(keep.int(), x), "keep"),
        (lambda x, keep: pack(keep), "at least one tensor"),
        (lambda x, keep: pack(keep, x[:, :5]), "tensor 0"),
        (lambda x, keep: pack(keep, x, max_seqlen=-1), "max_seqlen"),
        (lambda x, keep: pack(keep, x, max_seqlen=True), "max_seqlen"),
    ],
    ids=["keep-not-bool", "no-tensor", "shape-mismatch", "negative-max_seqlen", "bool-max_seqlen"],
)
def test_pack_rejects_bad_arguments(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call(torch.randn(3, 7, 2), _padded())
