"""Memory scaling of the torch backend: Nq = Nk = 32768 forward + backward stays far below one
materialized score matrix (32768^2 float32 = 4 GiB), measured as peak-RSS growth in a fresh process.

Not a timing test: it asserts memory and correctness only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
N, HEADS, HEAD_DIM = 32768, 1, 16
LIMIT_BYTES = 2**30
CHECKED_ROWS = 64  # rows compared with the float64 reference (row i's KL and dq need only row i)

WORKER = textwrap.dedent(
    """
    import json, resource, sys
    import torch
    import streamkl
    from streamkl.reference import reference_kl

    n, heads, head_dim, checked = (int(a) for a in sys.argv[1:5])

    def peak_rss_bytes():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB

    def run(inputs):
        leaves = [t.detach().requires_grad_() for t in inputs]
        kl_rows = streamkl.kl(*leaves, reduction="none", backend="torch")
        kl_rows.sum().backward()
        return kl_rows.detach(), [t.grad for t in leaves]

    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(1, n, heads, head_dim, generator=generator) for _ in range(4)]
    run([t[:, :64] for t in inputs])  # first call: lazy imports and code paths, outside the peak
    try:  # reset the peak-RSS mark to the current RSS (Linux >= 4.0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    before = peak_rss_bytes()
    kl_rows, grads = run(inputs)
    growth = peak_rss_bytes() - before

    # correctness on the first rows: against float64 autograd over all keys
    q1, k1, q2, k2 = (t.double().requires_grad_() for t in inputs)
    ref_rows, _, _ = reference_kl(q1[:, :checked], k1, q2[:, :checked], k2)
    ref_rows.sum().backward()
    def rel(a, b):
        return float((a.double() - b).norm() / b.norm())
    print(json.dumps({
        "growth_bytes": growth,
        "kl_rel_error": rel(kl_rows[:, :checked], ref_rows.detach()),
        "dq1_rel_error": rel(grads[0][:, :checked], q1.grad[:, :checked]),
        "dq2_rel_error": rel(grads[2][:, :checked], q2.grad[:, :checked]),
        "all_finite": all(bool(torch.isfinite(t).all()) for t in [kl_rows, *grads]),
        "shapes_ok": [tuple(g.shape) for g in grads] == [tuple(t.shape) for t in inputs],
    }))
    """
)


def test_peak_memory_grows_less_than_1gb_at_32k():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, str(N), str(HEADS), str(HEAD_DIM), str(CHECKED_ROWS)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["all_finite"] and result["shapes_ok"], result
    assert result["kl_rel_error"] <= 1e-4, result
    assert result["dq1_rel_error"] <= 1e-4, result
    assert result["dq2_rel_error"] <= 1e-4, result
    # a materialized float32 score matrix alone would be 4 GiB
    assert result["growth_bytes"] < LIMIT_BYTES, result
