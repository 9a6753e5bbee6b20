"""Which part of a varlen student step breaks CUDA-graph capture (variants in subprocesses)."""
import subprocess
import sys

BODY = r'''
import sys, torch, streamkl
sys.path.insert(0, "tests")
from test_gpu_capture import _packed_inputs
from streamkl import autograd
from streamkl.backends.triton import backward
variant, backend = sys.argv[1], sys.argv[2]
reduction = "mean"
if variant == "expect":
    autograd._expect_to_save = lambda ctx, lse1, expect: expect
elif variant == "no_tma":
    backward.DQ_TMA = False
elif variant == "sum":
    reduction = "sum"
elif variant == "none":
    reduction = "none"
(q1, k1, q2, k2), cu, longest = _packed_inputs()
def step():
    out = streamkl.kl(q1, k1, q2, k2, cu_seqlens=cu, max_seqlen=longest, max_seqlen_k=longest, causal=True,
                      backend=backend, reduction=reduction)
    loss = out.sum() if reduction == "none" else out
    return (loss, *torch.autograd.grad(loss, [q2, k2]))
side = torch.cuda.Stream(); side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    for _ in range(2): step()
torch.cuda.current_stream().wait_stream(side)
g = torch.cuda.CUDAGraph()
try:
    with torch.cuda.graph(g):
        cap = step()
    print(variant, backend, "capture OK")
except Exception as exc:
    print(variant, backend, "FAILED", repr(exc).splitlines()[0][:150])
'''
for backend in ("triton", "cupy"):
    for variant in ("base", "expect", "no_tma", "sum", "none"):
        r = subprocess.run([sys.executable, "-c", BODY, variant, backend], capture_output=True, text=True, timeout=120)
        lines = [l for l in (r.stdout + r.stderr).splitlines() if "capture OK" in l or "FAILED" in l]
        print(lines[-1] if lines else f"{variant} {backend} no result: {r.stderr[-300:]}", flush=True)
