"""The CPU benchmark still runs: `benchmarks/cpu.py --quick` end to end, at a tiny N."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_cpu_benchmark_quick(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "cpu.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "cpu.json").read_text())
    assert report["environment"]["torch"]
    rows = report["results"]
    assert {row["mode"] for row in rows} == {"forward", "backward_all", "backward_student"}
    for row in rows:
        naive, ours = row["naive"], row["torch"]
        assert abs(naive["value"] - ours["value"]) <= 1e-4 * max(1.0, abs(naive["value"])), row
        for provider in (naive, ours):
            assert provider["forward_s"] > 0 and provider["peak_extra_bytes"] >= 0
            assert (provider["backward_s"] is None) == (row["mode"] == "forward")
    assert "| N | mode |" in (tmp_path / "cpu.md").read_text()


def test_ab_trees_report_and_arguments(tmp_path):
    """tools/ab_trees.py (GPU only to run): its B/A table, and the refusal of a tree without streamkl."""
    import pytest

    sys.path.insert(0, str(ROOT / "tools"))
    import ab_trees

    rows = [dict(case="forward D=128", metric="kernel_ms", value=value, tree=tree, round=index // 2)
            for index, (tree, value) in enumerate([("A", 4.0), ("B", 3.8), ("B", 3.9), ("A", 4.2)])]
    rows += [dict(case="host backward, N=1024 D=128 causal", metric="host_us", value=value, tree=tree, round=0)
             for tree, value in (("A", 900.0), ("B", 450.0))]
    table = ab_trees.report(rows, {"A": "/old", "B": "/new"})
    assert "| forward D=128 | kernel_ms | 4.100 | 3.850 | 0.939 |" in table
    assert "| host backward, N=1024 D=128 causal | host_us | 900 | 450 | 0.500 |" in table
    with pytest.raises(SystemExit):
        ab_trees.main([str(tmp_path), str(ROOT)])
