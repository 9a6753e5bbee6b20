"""Call plans (streamkl/plans.py): a repeated eager call skips the front end and gives bitwise what the
full path gives; anything the path reads (the inputs' metadata, options, masks and cu_seqlens,
output options, grad mode, environment, the package's switches) makes another plan or none.
The Gluon forward's own launcher is tested on the GPU (test_triton_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from helpers import front_end_cases, make_inputs

import streamkl
from streamkl import api, plans
from streamkl import autograd as kl_autograd
from streamkl.backends import base
from streamkl.backends.torch_chunked import TorchChunkedBackend
from streamkl.varlen import cu_seqlens_from_lengths


@pytest.fixture
def builds(monkeypatch):
    """How many calls took the full path (built their problem) since the fixture was made."""
    calls = []
    build = api.build_problem
    monkeypatch.setattr(api, "build_problem", lambda *a, **k: calls.append(1) or build(*a, **k))
    return calls


def _run(inputs, grad, **kwargs):
    for t in inputs:
        t.grad = None
    with torch.set_grad_enabled(grad):
        out, lse1, lse2 = streamkl.kl(*inputs, return_lse=True, backend="torch", **kwargs)
    results = [out.detach(), lse1, lse2]
    if grad:
        weight = torch.linspace(0.5, 1.5, out.numel(), device=out.device).reshape(out.shape)
        (out.nan_to_num(posinf=0.0) * weight).sum().backward()
        results += [t.grad.clone() for t in inputs]
    return results


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("case", range(5))
def test_repeated_calls_take_the_plan(case, grad, builds, monkeypatch):
    """The second and third calls take the first one's plan (no problem built) and give bitwise the
    full path's outputs and gradients."""
    inputs, kwargs = front_end_cases(DEVICE)[case]
    first = _run(inputs, grad, **kwargs)
    assert len(builds) == 1
    for _ in range(2):
        again = _run(inputs, grad, **kwargs)
        assert len(builds) == 1
        for a, b in zip(first, again, strict=True):
            assert torch.equal(a, b)
    monkeypatch.setattr(plans, "find", lambda key, objects: None)  # every call the full path
    full = _run(inputs, grad, **kwargs)
    assert len(builds) == 2
    for a, b in zip(first, full, strict=True):
        assert torch.equal(a, b)


def test_what_the_key_holds(builds, monkeypatch):
    """A plan serves only calls with everything its path read the same."""
    q1, k1, q2, k2 = make_inputs((1, 48), (1, 48), 2, (2, 2), (16, 16), torch.float32, DEVICE, (False,) * 4)

    def misses(**kwargs):
        before = len(builds)
        streamkl.kl(q1, k1, q2, k2, **kwargs)
        return len(builds) - before

    base_call = dict(backend="torch", causal=True)
    assert misses(**base_call) == 1 and misses(**base_call) == 0
    for change in (dict(causal=False), dict(reduction="sum"), dict(return_lse=True), dict(scale1=0.5),
                   dict(window=(4, 4))):
        assert misses(**{**base_call, **change}) == 1, change
        assert misses(**{**base_call, **change}) == 0, change
    assert misses(**base_call) == 0
    with torch.no_grad():
        assert misses(**base_call) == 1 and misses(**base_call) == 0
    q2.requires_grad_(True)
    assert misses(**base_call) == 1 and misses(**base_call) == 0
    q2.requires_grad_(False)
    assert misses(**base_call) == 0
    # other inputs of the same metadata: the same plan (it reads no value)
    q1, k1, q2, k2 = (t.clone() for t in (q1, k1, q2, k2))
    assert misses(**base_call) == 0
    # the environment read at call time: the backend variable behind backend=None
    assert misses(causal=True) == 1 and misses(causal=True) == 0
    monkeypatch.setenv("STREAMKL_BACKEND", "torch")
    assert misses(causal=True) == 1 and misses(causal=True) == 0
    # a 1 where a True was (equal, and the same hash): another key, and the full path's checks refuse it
    with pytest.raises(TypeError, match="causal"):
        streamkl.kl(q1, k1, q2, k2, backend="torch", causal=1)


def test_a_switch_retires_every_plan(builds, monkeypatch):
    """An assignment to any module of the package (a switch, a monkeypatched function) advances
    GENERATION: the next call takes the full path (and reads the new setting)."""
    from streamkl.backends.triton import gluon_backward  # (loaded before the plan: watched from it on)

    x = make_inputs((1, 40), (1, 40), 2, (2, 2), (16, 16), torch.float32, DEVICE, (False,) * 4)
    streamkl.kl(*x, backend="torch")
    streamkl.kl(*x, backend="torch")
    assert len(builds) == 1
    generation = plans.GENERATION[0]
    monkeypatch.setattr(base, "POISON_OUTPUTS", False)  # (the suite's fixture set it True)
    assert plans.GENERATION[0] == generation + 1
    streamkl.kl(*x, backend="torch")
    streamkl.kl(*x, backend="torch")
    assert len(builds) == 2
    monkeypatch.setattr(gluon_backward, "_unused_switch_for_this_test", 1, raising=False)
    streamkl.kl(*x, backend="torch")
    assert len(builds) == 3


def test_cu_seqlens_changed_in_place_are_checked_again(builds):
    """cu_seqlens are keyed by identity and version: values changed in place take the full path,
    whose checks refuse bad ones."""
    x = make_inputs((64,), (64,), 2, (2, 2), (16, 16), torch.float32, DEVICE, (False,) * 4)
    cu = cu_seqlens_from_lengths([30, 34], DEVICE)
    for _ in range(2):
        streamkl.kl(*x, cu_seqlens=cu, backend="torch")
    assert len(builds) == 1
    cu[1] = 70  # past the packed length
    with pytest.raises(ValueError, match="cu_seqlens"):
        streamkl.kl(*x, cu_seqlens=cu, backend="torch")


def test_a_declining_launcher_takes_the_full_path(builds, monkeypatch):
    calls = []
    monkeypatch.setattr(TorchChunkedBackend, "forward_launcher",
                        lambda self, problem, schedule: lambda *x: calls.append(1))
    x = make_inputs((1, 40), (1, 40), 2, (2, 2), (16, 16), torch.float32, DEVICE)
    with torch.no_grad():
        first = streamkl.kl(*x, backend="torch")
        second = streamkl.kl(*x, backend="torch")
    assert len(calls) == 1 and len(builds) == 2 and torch.equal(first, second)
    # with gradients the autograd function asks the launcher, then runs the backend's forward
    for _ in range(2):
        out = streamkl.kl(*x, backend="torch")
        out.backward()
    assert len(calls) == 2 and len(builds) == 3 and torch.equal(out.detach(), first)
    assert all(t.grad is not None for t in x)


def test_no_plan_off_the_eager_path(monkeypatch):
    """Where the custom ops run (torch.compile, dispatch modes, functorch), no plan is made or used."""
    x = make_inputs((1, 40), (1, 40), 2, (2, 2), (16, 16), torch.float32, DEVICE, (False,) * 4)
    monkeypatch.setattr(kl_autograd, "eager_fast_path", lambda tensors: False)
    kept = dict(plans._PLANS)
    unpacked = []
    unpack = kl_autograd.unpack_problem
    monkeypatch.setattr(kl_autograd, "unpack_problem", lambda *a: unpacked.append(1) or unpack(*a))
    for _ in range(2):
        streamkl.kl(*x, backend="torch")
    assert dict(plans._PLANS) == kept and len(unpacked) == 2


def test_modules_are_watched_once_planned():
    """The switch modules are watched; the packages and the modules that code traced by
    torch.compile imports inside functions stay plain modules (TorchDynamo before 2.13 refuses
    an import whose result's type is not exactly ModuleType)."""
    import sys
    import types

    from streamkl.backends.triton import backward, common, forward, gluon_backward  # noqa: F401

    x = make_inputs((1, 40), (1, 40), 2, (2, 2), (16, 16), torch.float32, DEVICE, (False,) * 4)
    streamkl.kl(*x, backend="torch")
    for name in plans.WATCHED:
        assert type(sys.modules[f"streamkl.{name}"]) is plans._WatchedModule, name
    for name in ("streamkl", "streamkl.backends", "streamkl.backends.triton", "streamkl.backends.triton.common",
                 "streamkl.backends.torch_chunked", "streamkl.sparse.block_mask"):
        assert type(sys.modules[name]) is types.ModuleType, name


def test_a_first_import_keeps_the_plans():
    """A submodule imported for the first time is bound to its package (a module assignment): no
    switch, so the plans stay (a backend's first backward imports its modules lazily)."""
    from streamkl.backends.triton import gluon_backward as package

    generation = plans.GENERATION[0]
    x = make_inputs((1, 40), (1, 40), 2, (2, 2), (16, 16), torch.float32, DEVICE, (False,) * 4)
    streamkl.kl(*x, backend="torch")
    assert type(package) is plans._WatchedModule
    before = plans.GENERATION[0]
    package._test_submodule = plans  # (a module, as the import system assigns)
    assert plans.GENERATION[0] == before >= generation
    del package._test_submodule
    assert plans.GENERATION[0] == before + 1
