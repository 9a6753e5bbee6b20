"""The front end's host path: the arguments are validated and the problem described once per
call (eager calls run the ops' implementations on the front end's problem), and a dense call reads
no tensor value on the host. No timings are asserted here:
benchmarks/host_overhead.py measures them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch
from conftest import DEVICE
from helpers import make_inputs

import streamkl
from streamkl import api
from streamkl import autograd as kl_autograd

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import host_overhead  # noqa: E402


def test_partial_requires_grad_and_no_grad():
    q1, k1, q2, k2 = make_inputs((1, 33), (1, 33), 2, (2, 2), (16, 16), torch.float32, DEVICE, (False,) * 4)
    k2.requires_grad_(True)
    out = streamkl.kl(q1, k1, q2, k2, backend="torch")
    out.backward()
    assert k2.grad is not None and q1.grad is None and q2.grad is None
    with torch.no_grad():
        again = streamkl.kl(q1, k1, q2, k2, backend="torch")
    assert not again.requires_grad and torch.equal(again, out.detach())
    _, lse1, lse2 = streamkl.kl(q1, k1, q2, k2, backend="torch", return_lse=True)
    assert not lse1.requires_grad and not lse2.requires_grad


def test_arguments_are_validated_once_per_call(monkeypatch):
    calls = []
    build = api.build_problem
    monkeypatch.setattr(api, "build_problem", lambda *a, **k: calls.append(1) or build(*a, **k))
    unpacked = []
    unpack = kl_autograd.unpack_problem
    monkeypatch.setattr(kl_autograd, "unpack_problem", lambda *a: unpacked.append(1) or unpack(*a))
    inputs = make_inputs((1, 24), (1, 24), 2, (2, 2), (16, 16), torch.float32, DEVICE)
    streamkl.kl(*inputs, causal=True, backend="torch").backward()
    assert len(calls) == 1 and not unpacked  # eager: the ops' implementations take the front end's problem


@pytest.fixture
def stubbed():
    """The torch backend with host_overhead's output-only stubs (the kernels never run)."""
    shape = argparse.Namespace(device=DEVICE, dtype=torch.float32, batch=1, seqlen=32, heads=2, heads_k=1, dim=16)
    inputs = host_overhead.make_inputs(shape)
    with host_overhead.stub_backend(inputs, "torch"):
        yield inputs


def test_dense_front_end_reads_no_tensor_value(stubbed, monkeypatch):
    """No host sync on dense inputs (CUDA-graph capture, torch.compile): the front end never turns a
    tensor into a Python value."""

    def refuse(*args, **kwargs):
        raise AssertionError("host sync in the front end")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    q1, k1, q2, k2 = stubbed
    for reduction in ("mean", "sum", "none"):
        out = streamkl.kl(q1, k1, q2, k2, causal=True, reduction=reduction, backend="torch")
        out.sum().backward()


def test_benchmark_runs(capsys):
    results = host_overhead.main(["--iters", "3", "--repeats", "1", "--device", DEVICE])
    assert set(results) >= {"forward, no_grad", "forward + backward"}
    # the stubs are gone afterwards: the real backend computes again
    inputs = make_inputs((1, 24), (1, 24), 2, (2, 2), (16, 16), torch.float32, DEVICE)
    assert torch.isfinite(streamkl.kl(*inputs, backend="torch"))


def test_create_graph_first_grad_works_and_double_backward_raises():
    """create_graph=True gives the same first gradient, and a second backward through it raises
    instead of silently dropping the KL's second-order terms."""
    inputs = make_inputs((1, 32), (1, 32), 2, (2, 2), (16, 16), torch.float32, DEVICE)
    plain = torch.autograd.grad(streamkl.kl(*inputs, backend="torch"), inputs[2:])
    graph = torch.autograd.grad(streamkl.kl(*inputs, backend="torch"), inputs[2:], create_graph=True)
    for a, b in zip(plain, graph):
        assert torch.equal(a, b.detach())
    with pytest.raises(RuntimeError, match="no second derivative"):
        (graph[0] ** 2).sum().backward()
