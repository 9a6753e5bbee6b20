"""Backend choice: `backend=` argument > $STREAMKL_BACKEND (read at call time) > "auto".

"auto" walks the priority list and takes the first backend with no reason to refuse; a named
backend that cannot serve the inputs raises with its reasons, and when nothing fits the error
lists every backend's reasons.
"""

from __future__ import annotations

import os

import torch

from streamkl._cache import LRUCache
from streamkl.backends.base import Backend
from streamkl.problem import Problem

ENV_VAR = "STREAMKL_BACKEND"
PRIORITY = ("triton", "cupy", "torch")
_VALID = PRIORITY + ("auto",)
_NOT_CUDA = "inputs are not on a CUDA device (auto never picks an interpreted GPU kernel)"
_INSTANCES: dict[str, Backend] = {}


def _load(name: str) -> Backend:
    if name not in _INSTANCES:
        if name == "torch":
            from streamkl.backends.torch_chunked import TorchChunkedBackend as cls
        elif name == "triton":
            from streamkl.backends.triton import TritonBackend as cls
        elif name == "cupy":
            from streamkl.backends.cupy import CupyBackend as cls
        else:  # pragma: no cover - guarded by the callers
            raise KeyError(name)
        _INSTANCES[name] = cls()
    return _INSTANCES[name]


def get_backend(name: str) -> Backend:
    return _load(name)


def requested_backend(backend: str | None) -> str:
    """The name asked for: the argument, else the environment variable, else "auto"."""
    source = "backend"
    if backend is None:
        backend = os.environ.get(ENV_VAR) or "auto"
        source = f"${ENV_VAR}"
    if not isinstance(backend, str):
        raise TypeError(f"streamkl.kl: `backend` must be a str or None; got {type(backend).__name__}.")
    name = backend if backend in _VALID else backend.strip().lower()
    if name not in _VALID:
        names = ", ".join(repr(n) for n in _VALID)
        raise ValueError(f"streamkl.kl: `{source}` must be one of {names}; got {backend!r}.")
    return name


_CHOICES = LRUCache(64)


def choose_backend(problem: Problem, backend: str | None) -> Backend:
    """The backend that serves `problem`, kept per problem, name asked for and the environment the
    backends' checks read (`Backend.environment_key`), outside of torch.compile; a refusal raises
    and is not kept."""
    name = requested_backend(backend)
    if torch.compiler.is_compiling():  # (traced once; dynamo cannot enter the cache's lock)
        return _choose(problem, name)
    names = PRIORITY if name == "auto" else (name,)
    environment = tuple(_load(n).environment_key() for n in names)
    memo = problem.memo.get("backend")  # this problem's last choice: no hashing of its key
    if memo is not None and memo[0] == name and memo[1] == environment:
        return memo[2]
    key = (name, problem.key, environment)
    hit = _CHOICES.get(key)
    chosen = hit[0] if hit is not None else _choose(problem, name)
    problem.memo["backend"] = (name, environment, chosen)
    if hit is not None:
        return chosen
    _CHOICES.put(key, (chosen, problem))  # (the problem keeps the tables and patterns its key names alive)
    return chosen


def _choose(problem: Problem, name: str) -> Backend:
    if name != "auto":
        chosen = _load(name)
        reasons = chosen.not_supported_reasons(problem)
        if reasons:
            raise ValueError(
                f"streamkl.kl: backend {name!r} cannot serve these inputs ({problem.describe()}): " + "; ".join(reasons)
            )
        return chosen
    on_cuda = problem.device.type == "cuda"
    for candidate in PRIORITY:
        impl = _load(candidate)
        # a GPU backend serving CPU tensors runs under an interpreter (tests): never pick it by default,
        # and don't spend its checks on a call it cannot win (they are only needed for the error below)
        if (on_cuda or not impl.needs_cuda) and not impl.not_supported_reasons(problem):
            return impl
    refusals = []
    for candidate in PRIORITY:
        impl = _load(candidate)
        reasons = impl.not_supported_reasons(problem)
        if not reasons and impl.needs_cuda and not on_cuda:
            reasons = [_NOT_CUDA]
        refusals.append(f"{candidate}: " + "; ".join(reasons))
    raise ValueError("streamkl.kl: no backend can serve these inputs: " + " | ".join(refusals))


def backend_report() -> list[tuple[str, bool, list[str]]]:
    """(name, usable here, reasons) for every backend, in priority order."""
    rows = []
    for name in PRIORITY:
        reasons = _load(name).environment_reasons()
        rows.append((name, not reasons, reasons))
    return rows


def available_backends() -> list[str]:
    """Names of the backends that can run on this machine, fastest first."""
    return [name for name, usable, _ in backend_report() if usable]
