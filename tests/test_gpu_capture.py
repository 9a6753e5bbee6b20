"""On a CUDA GPU: the fused backends under CUDA-graph capture (no host sync in the launch path when
max_seqlen is given) and under torch.compile(fullgraph=True). Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

import streamkl
from streamkl.dispatch import get_backend
from streamkl.varlen import cu_seqlens_from_lengths

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
GPU_BACKENDS = ["triton", "cupy"]


def _packed_inputs():
    lengths = [300, 0, 517, 64]
    cu = cu_seqlens_from_lengths(lengths, "cuda")
    total = sum(lengths) + 5
    q1, k1 = (torch.randn(total, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q2, k2 = (torch.randn(total, 4, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    return (q1, k1, q2, k2), cu, max(lengths)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_cuda_graph_capture_forward_backward(backend):
    if get_backend(backend).environment_reasons():
        pytest.skip(f"{backend} unavailable here")
    (q1, k1, q2, k2), cu, longest = _packed_inputs()

    def step():
        loss = streamkl.kl(
            q1, k1, q2, k2, cu_seqlens=cu, max_seqlen=longest, max_seqlen_k=longest, causal=True, backend=backend
        )
        return (loss, *torch.autograd.grad(loss, [q2, k2]))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compile kernels, fill the schedule cache
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    with torch.no_grad():  # new inputs in the same buffers, then replay
        for t in (q1, k1, q2, k2):
            t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    for a, b in zip(captured, eager):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_torch_compile_fullgraph_on_gpu(backend):
    if get_backend(backend).environment_reasons():
        pytest.skip(f"{backend} unavailable here")
    (q1, k1, q2, k2), cu, longest = _packed_inputs()

    def loss_fn(q1, k1, q2, k2):
        return 2.0 * streamkl.kl(q1, k1, q2, k2, cu_seqlens=cu, max_seqlen=longest, causal=True, backend=backend)

    compiled = torch.compile(loss_fn, fullgraph=True)
    out = compiled(q1, k1, q2, k2)
    grads = torch.autograd.grad(out, [q2, k2])
    eager = loss_fn(q1, k1, q2, k2)
    eager_grads = torch.autograd.grad(eager, [q2, k2])
    assert torch.allclose(out, eager)
    for a, b in zip(grads, eager_grads):
        assert torch.equal(a, b)
