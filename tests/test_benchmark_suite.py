"""The benchmark suite still runs: `benchmarks/suite.py --quick --device cpu` end to end, at a tiny N."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_suite_quick_cpu(tmp_path):
    pytest.importorskip("matplotlib")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("STREAMKL_BACKEND", None)
    command = [
        sys.executable, str(ROOT / "benchmarks" / "suite.py"), "--quick", "--device", "cpu", "--out", str(tmp_path),
        "--compile-backend", "eager", "--rep-ms", "2",
    ]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "suite_quick.json").read_text())
    assert report["environment"]["torch"] and report["environment"]["command"].startswith("python benchmarks/suite.py")
    rows = report["results"]
    assert {r["section"] for r in rows} == {"nsweep", "dsweep", "sparsity", "varlen"}
    assert {r["provider"] for r in rows} == {"streamkl-torch", "naive", "naive-compile", "sdpa"}
    for row in rows:
        assert row["error"] is None, row
        assert row["ms"] is not None and row["ms"] > 0, row
    assert {r["mode"] for r in rows} == {"forward", "fwd+bwd student", "fwd+bwd all"}
    sdpa = [r for r in rows if r["provider"] == "sdpa"]
    assert {r["mode"] for r in sdpa} == {"forward", "fwd+bwd all"}
    assert all(r["sdpa_backend"] for r in sdpa), sdpa
    host = report["host"]
    assert {(r["provider"], r["mode"]) for r in host} == {
        (provider, mode) for provider in ("streamkl-torch", "sdpa")
        for mode in ("forward", "training forward", "backward")
    }
    assert all(r["error"] is None and r["host_us"] > 0 for r in host), host
    assert report["targets"] and all("met" in t and "met_sdpa" in t for t in report["targets"])
    assert any(t["value_sdpa"] is not None for t in report["targets"])
    md = (tmp_path / "suite_quick.md").read_text()
    assert "## Targets" in md and "| streamkl-torch |" in md and "## Host time per call" in md
    assert "value vs default SDPA" in md and "| sdpa (default) |" in md and "default SDPA backend:" in md
    assert (tmp_path / "suite_quick_time.png").exists()
