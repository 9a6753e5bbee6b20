"""Kernel configuration sweep on the GPU: the Triton forward and backward under several tile /
warp / pipeline settings against SDPA flash at the issue #5 shapes, plus a correctness check of
every configuration against the float64 reference on a small causal GQA problem.

    python benchmarks/tune_h200.py --out results_dir      # one GPU call, ~3-5 min
    python benchmarks/tune_h200.py --section gluon        # the Gluon kernels against the Triton ones

Writes tune.json (every timing) and prints one line per measurement. Timings: triton.testing.do_bench
(L2 flushed before each call), median ms. Backward = fwd+bwd - fwd.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import streamkl  # noqa: E402
import streamkl.backends.triton as tb  # noqa: E402
from streamkl.backends.triton import backward as tbwd  # noqa: E402
from streamkl.backends.triton import forward as tfwd  # noqa: E402

ORIGINAL_TILES = tb._tile_sizes


def bench(fn, rep=200, grads=None):
    return triton.testing.do_bench(fn, warmup=25, rep=rep, grad_to_none=grads, return_mode="median")


def kl_fn(x, backward=False, **kwargs):
    """A timed call: streamkl.kl on the triton backend, with or without its backward."""

    def fn():
        out = streamkl.kl(*x, backend="triton", **kwargs)
        if backward:
            out.backward()

    return fn


def inputs(n, h, d, dtype=torch.bfloat16, grads=(False, False, False, False), batch=1):
    g = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for need in grads:
        t = torch.randn(batch, n, h, d, device="cuda", dtype=dtype, generator=g)
        out.append(t.requires_grad_(need))
    return out


def sdpa_times(n, h, d, causal):
    q, k, v = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        fwd = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
        both = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal).sum().backward(),
                     grads=[q, k, v])
    return fwd, both - fwd


#: configuration keys -> the modules whose TUNE dict reads them ("fold": the score arithmetic of both)
TUNE_KEYS = {"fwd": (tfwd,), "tma": (tfwd,), "kv_tiles": (tbwd,), "kv_tiles2": (tbwd,), "kv": (tbwd,),
             "dq": (tbwd,), "fold": (tfwd, tbwd), "dq_tma": (tbwd,), "atomic2": (tbwd,),
             "dq_tiles": (tbwd,)}


def set_config(cfg):
    tfwd.TUNE.clear()
    tbwd.TUNE.clear()
    tb._tile_sizes = ORIGINAL_TILES
    if "tiles" in cfg:
        tiles = cfg["tiles"]
        tb._tile_sizes = lambda *a, **k: tiles
    for key, modules in TUNE_KEYS.items():
        if key in cfg:
            for module in modules:
                module.TUNE[key] = cfg[key]

def check(cfg):
    """Accuracy of this configuration on a small causal GQA bf16 problem (default and deterministic)."""
    from helpers import check_against_reference, make_inputs

    set_config(cfg)
    x = make_inputs((1, 1500), (1, 1500), 4, (2, 4), (128, 128), torch.bfloat16, "cuda")
    check_against_reference(x, "triton", causal=True)
    check_against_reference(x, "triton", causal=True, deterministic=True)
    x = make_inputs((1, 1000), (1, 1000), 4, (4, 4), (64, 64), torch.bfloat16, "cuda")
    check_against_reference(x, "triton", window=(300, 0))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--section", default="fwd,bwd,sparse")
    parser.add_argument("--fwd-configs", default=None, help="JSON list of configs")
    parser.add_argument("--bwd-configs", default=None, help="JSON list of configs")
    parser.add_argument("--bwd-modes", default="student,all",
                        help="backward modes of the bwd section: student, all, det (student, deterministic only)")
    parser.add_argument("--det-all", action="store_true", help="time every bwd config deterministic too")
    parser.add_argument("--bwd-dims", default="128,64", help="head dims of the bwd section")
    parser.add_argument("--gluon-parts", default="fwd,bwd",
                        help="parts of the gluon section: fwd, bwd, bwd-knobs (the backward's DQ_VEC2), "
                        "bwd-combos (every combination of --bwd-combos), "
                        "bwd-forced (the backward's forced-only scopes)")
    parser.add_argument("--bwd-combos", default="DQ_VEC2",
                        help="gluon section, part bwd-combos: the Gluon backward's switches to combine "
                        "(A|B: one of them or neither)")
    parser.add_argument("--chunk-ns", default="2048,4096,8192,16384", help="lengths of the 'chunks' section")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
               command=" ".join(sys.argv))
    print(json.dumps(env), flush=True)
    n, h = args.n, args.heads
    sections = args.section.split(",")
    start = time.time()

    log = (out / "tune.jsonl").open("a")

    def record(**row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        log.write(json.dumps(row) + "\n")
        log.flush()

    sdpa = {}
    for d in (128, 64):
        for causal in (False, True):
            sdpa[d, causal] = sdpa_times(n, h, d, causal)
            record(kind="sdpa", d=d, causal=causal, fwd=sdpa[d, causal][0], bwd=sdpa[d, causal][1])

    fwd_configs = json.loads(args.fwd_configs) if args.fwd_configs else [
        {},
        {"tiles": (128, 64), "fwd": (128, 8, 2)},
        {"tiles": (128, 64), "fwd": (128, 8, 4)},
        {"tiles": (128, 128), "fwd": (128, 8, 2)},
        {"tiles": (128, 128), "fwd": (128, 8, 3)},
        {"tiles": (128, 64), "fwd": (64, 4, 3)},
        {"tiles": (128, 32), "fwd": (128, 8, 3)},
    ]
    bwd_configs = json.loads(args.bwd_configs) if args.bwd_configs else [
        {},
        {"kv_tiles": (64, 128), "kv": (8, 1)},
        {"kv_tiles": (64, 128), "kv": (4, 2)},
        {"kv_tiles": (32, 128), "kv": (4, 2)},
        {"kv_tiles": (64, 64), "kv": (4, 2)},
        {"kv_tiles": (128, 128), "kv": (8, 2)},
        {"kv_tiles": (64, 128), "kv": (8, 3)},
    ]
    if "fwd" in sections:
        for cfg in fwd_configs:
            for d in (128, 64):
                for causal in (False, True):
                    set_config(cfg)
                    try:
                        x = inputs(n, h, d)
                        t = bench(kl_fn(x, causal=causal))
                        record(kind="fwd", cfg=cfg, d=d, causal=causal, ms=t, vs_sdpa=t / sdpa[d, causal][0])
                    except Exception as exc:  # noqa: BLE001
                        record(kind="fwd", cfg=cfg, d=d, causal=causal, error=repr(exc)[:300])
    if "bwd" in sections:
        set_config({})
        fwd_ms = {}
        for d in [int(v) for v in args.bwd_dims.split(",")]:
            for causal in (False, True):
                x = inputs(n, h, d)
                fwd_ms[d, causal] = bench(kl_fn(x, causal=causal))
        modes = args.bwd_modes.split(",")
        for cfg in bwd_configs:
            for d in [int(v) for v in args.bwd_dims.split(",")]:
                for causal in (False, True):
                    for mode, grads in (("student", (False, False, True, True)), ("all", (True,) * 4)):
                        wanted = mode in modes or (mode == "student" and "det" in modes)
                        if (mode == "all" and d == 64) or not wanted:
                            continue
                        for det in (False, True):
                            if det and cfg and not args.det_all and "det" not in modes:
                                continue
                            if mode == "student" and "student" not in modes and not det:
                                continue  # "det": the deterministic student backward only
                            set_config(cfg)
                            try:
                                x = inputs(n, h, d, grads=grads)
                                leaves = [t for t in x if t.requires_grad]
                                fn = kl_fn(x, True, causal=causal, deterministic=det)
                                t = bench(fn, grads=leaves) - fwd_ms[d, causal]
                                record(kind="bwd", cfg=cfg, d=d, causal=causal, mode=mode, deterministic=det, ms=t,
                                       vs_sdpa=t / sdpa[d, causal][1])
                                del leaves
                            except Exception as exc:  # noqa: BLE001
                                record(kind="bwd", cfg=cfg, d=d, causal=causal, mode=mode, deterministic=det,
                                       error=repr(exc)[:300])
    if "sparse" in sections:
        set_config({})
        d = 128
        for sparsity in (0.0, 0.9):
            g = torch.Generator(device="cuda").manual_seed(1)
            nb = n // 128
            pattern = torch.rand(1, h, nb, nb, device="cuda", generator=g) >= sparsity
            mask = streamkl.BlockMask.from_dense(pattern, 128)
            x = inputs(n, h, d)
            t = bench(kl_fn(x, mask1=mask, mask2=mask))
            xs = inputs(n, h, d, grads=(False, False, True, True))
            tb_ = bench(kl_fn(xs, True, mask1=mask, mask2=mask), grads=xs[2:])
            record(kind="sparse", sparsity=sparsity, fwd=t, fwdbwd_student=tb_)
        x = inputs(n, h, d)
        t = bench(kl_fn(x))
        xs = inputs(n, h, d, grads=(False, False, True, True))
        tb_ = bench(kl_fn(xs, True), grads=xs[2:])
        record(kind="sparse", sparsity="nomask", fwd=t, fwdbwd_student=tb_)
    if "gluon" in sections:
        # the experimental warp-specialized Gluon forward against the Triton one (same problem,
        # rows compared), then timed; an error is recorded, not raised
        from streamkl.backends.triton import gluon_backward, gluon_forward

        parts = args.gluon_parts.split(",")
        for d in (128, 64) if "fwd" in parts else ():
            for causal in (False, True):
                x = inputs(n, h, d)
                gluon_forward.USE_GLUON = False
                ref = streamkl.kl(*x, backend="triton", causal=causal, reduction="none")
                t_triton = bench(kl_fn(x, causal=causal))
                for overlap in (False, True):
                    try:
                        gluon_forward.USE_GLUON, gluon_forward.OVERLAP = True, overlap
                        got = streamkl.kl(*x, backend="triton", causal=causal, reduction="none")
                        err = ((got - ref).norm() / ref.norm()).item()
                        t = bench(kl_fn(x, causal=causal))
                        record(kind="gluon", d=d, causal=causal, overlap=overlap, ms=t, triton_ms=t_triton,
                               vs_sdpa=t / sdpa[d, causal][0], triton_vs_sdpa=t_triton / sdpa[d, causal][0],
                               rel_err_vs_triton=err)
                    except Exception as exc:  # noqa: BLE001
                        record(kind="gluon", d=d, causal=causal, overlap=overlap, error=repr(exc)[:600])
                    finally:
                        gluon_forward.USE_GLUON, gluon_forward.OVERLAP = None, False
        # the student backward (gluon_backward.py, with the plain Gluon forward) against backward.py
        for d in (128, 64) if "bwd" in parts else ():
            for causal in (False, True):
                xs = inputs(n, h, d, grads=(False, False, True, True))
                try:
                    times, grads = {}, {}
                    for use in (False, True):
                        gluon_forward.USE_GLUON = use
                        fwd = bench(kl_fn(xs, causal=causal))
                        times[use] = bench(kl_fn(xs, True, causal=causal), grads=xs[2:]) - fwd
                        grads[use] = torch.autograd.grad(streamkl.kl(*xs, backend="triton", causal=causal), xs[2:])
                    err = max(((a.float() - b.float()).norm() / b.float().norm()).item()
                              for a, b in zip(grads[True], grads[False]))
                    record(kind="gluon_bwd", d=d, causal=causal, ms=times[True], triton_ms=times[False],
                           vs_sdpa=times[True] / sdpa[d, causal][1], triton_vs_sdpa=times[False] / sdpa[d, causal][1],
                           rel_err_vs_triton=err)
                except Exception as exc:  # noqa: BLE001
                    record(kind="gluon_bwd", d=d, causal=causal, error=repr(exc)[:600])
                finally:
                    gluon_forward.USE_GLUON = None
        # the Gluon backward's switch against its default: dq2 by vector reductions (DQ_VEC2, by
        # default without causality) forced on and off
        if "bwd-knobs" in parts:
            knobs = {"vec2": ("DQ_VEC2", True), "novec2": ("DQ_VEC2", False)}
            for d in (128, 64):
                for causal in (False, True):
                    xs = inputs(n, h, d, grads=(False, False, True, True))
                    gluon_forward.USE_GLUON = True
                    try:
                        fwd = bench(kl_fn(xs, causal=causal))
                        base = bench(kl_fn(xs, True, causal=causal), grads=xs[2:]) - fwd
                        want = torch.autograd.grad(streamkl.kl(*xs, backend="triton", causal=causal), xs[2:])
                        for name, (attr, value) in knobs.items():
                            if not hasattr(gluon_backward, attr):
                                continue
                            default = getattr(gluon_backward, attr)
                            try:
                                setattr(gluon_backward, attr, value)
                                t = bench(kl_fn(xs, True, causal=causal), grads=xs[2:]) - fwd
                                got = torch.autograd.grad(streamkl.kl(*xs, backend="triton", causal=causal), xs[2:])
                                err = max(((a.float() - b.float()).norm() / b.float().norm()).item()
                                          for a, b in zip(got, want))
                                record(kind="gluon_bwd_knob", knob=name, d=d, causal=causal, ms=t, base_ms=base,
                                       vs_sdpa=t / sdpa[d, causal][1], rel_err_vs_base=err)
                            except Exception as exc:  # noqa: BLE001
                                record(kind="gluon_bwd_knob", knob=name, d=d, causal=causal, error=repr(exc)[:600])
                            finally:
                                setattr(gluon_backward, attr, default)
                    finally:
                        gluon_forward.USE_GLUON = None
        # every combination of the Gluon backward's boolean switches (--bwd-combos: attribute names),
        # Gluon forced, at D=128 (causal and not)
        if "bwd-combos" in parts:
            import itertools

            groups = [group.split("|") for group in args.bwd_combos.split(",")]  # "A|B": none, A or B
            names = [name for group in groups for name in group]
            defaults = {name: getattr(gluon_backward, name) for name in names}
            choices = [[{group[0]: value} for value in (True, False)] if len(group) == 1 else
                       [{name: name == pick for name in group} for pick in (None, *group)] for group in groups]
            for causal in (True, False):
                xs = inputs(n, h, 128, grads=(False, False, True, True))
                gluon_forward.USE_GLUON = True
                try:
                    fwd = bench(kl_fn(xs, causal=causal))
                    want = None
                    for picks in itertools.product(*choices):
                        setting = {name: value for pick in picks for name, value in pick.items()}
                        try:
                            for name, value in setting.items():
                                setattr(gluon_backward, name, value)
                            t = bench(kl_fn(xs, True, causal=causal), grads=xs[2:]) - fwd
                            got = torch.autograd.grad(streamkl.kl(*xs, backend="triton", causal=causal), xs[2:])
                            want = got if want is None else want
                            err = max(((a.float() - b.float()).norm() / b.float().norm()).item()
                                      for a, b in zip(got, want))
                            record(kind="gluon_bwd_combo", d=128, causal=causal, **setting, ms=t,
                                   vs_sdpa=t / sdpa[128, causal][1], rel_err_vs_first=err)
                        except Exception as exc:  # noqa: BLE001
                            record(kind="gluon_bwd_combo", d=128, causal=causal, **setting, error=repr(exc)[:600])
                        finally:
                            for name, value in defaults.items():
                                setattr(gluon_backward, name, value)
                finally:
                    gluon_forward.USE_GLUON = None
        # the Gluon backward's forced-only scopes against backward.py (seventh session, written after
        # its last GPU run): partial tiles, student GQA, a window, packed sequences with partial tiles
        if "bwd-forced" in parts:
            from streamkl.varlen import cu_seqlens_from_lengths

            forced = [
                ("tail N=16320 causal", dict(n=16320, hk=h), dict(causal=True)),
                ("gqa 16/4 causal", dict(n=n, hk=4), dict(causal=True)),
                ("gqa 16/4", dict(n=n, hk=4), dict()),
                ("window 1024/0", dict(n=n, hk=h), dict(window=(1024, 0))),
                ("packed 16 x 1000-4000 causal", dict(n=None, hk=h), dict(causal=True)),
                ("tail N=16320", dict(n=16320, hk=h), dict()),
                ("packed 16 x 1000-4000", dict(n=None, hk=h), dict()),
            ]
            for name, shape, kwargs in forced:
                try:
                    if shape["n"] is None:  # packed sequences of lengths 1000 ... 4000 (partial tiles)
                        lens = [1000 + 200 * i for i in range(16)]
                        cu = cu_seqlens_from_lengths(lens, device="cuda")
                        total = sum(lens)
                        xs = [torch.randn(total, h if i % 2 == 0 else shape["hk"], 128, device="cuda",
                                          dtype=torch.bfloat16).requires_grad_(i >= 2) for i in range(4)]
                        kwargs = dict(kwargs, cu_seqlens=cu)
                    else:
                        xs = [torch.randn(1, shape["n"], h if i % 2 == 0 else shape["hk"], 128, device="cuda",
                                          dtype=torch.bfloat16).requires_grad_(i >= 2) for i in range(4)]
                    times, grads = {}, {}
                    for use in (False, True):
                        gluon_forward.USE_GLUON = use
                        fwd = bench(kl_fn(xs, **kwargs))
                        times[use] = bench(kl_fn(xs, True, **kwargs), grads=xs[2:]) - fwd
                        grads[use] = torch.autograd.grad(streamkl.kl(*xs, backend="triton", **kwargs), xs[2:])
                    err = max(((a.float() - b.float()).norm() / b.float().norm()).item()
                              for a, b in zip(grads[True], grads[False]))
                    record(kind="gluon_bwd_forced", case=name, ms=times[True], triton_ms=times[False],
                           rel_err_vs_triton=err)
                except Exception as exc:  # noqa: BLE001
                    record(kind="gluon_bwd_forced", case=name, error=repr(exc)[:600])
                finally:
                    gluon_forward.USE_GLUON = None
    if "chunks" in sections:
        # student backward, D=128, by length: each key-major configuration with the atomic pass in
        # one launch or two head chunks (the chunks halve its float32 dq buffer), and the
        # deterministic two-kernel path (no float32 buffer)
        for n_c in [int(v) for v in args.chunk_ns.split(",")]:
            for causal in (False, True):
                set_config({})
                x = inputs(n_c, h, 128)
                fwd = bench(kl_fn(x, causal=causal))
                xs = inputs(n_c, h, 128, grads=(False, False, True, True))
                t = bench(kl_fn(xs, True, causal=causal, deterministic=True), grads=xs[2:]) - fwd
                record(kind="chunks", n=n_c, causal=causal, deterministic=True, ms=t)
                for cfg in bwd_configs:
                    set_config(cfg)
                    for chunks in (1, 2):
                        tbwd.CHUNKS_OVERRIDE = chunks
                        t = bench(kl_fn(xs, True, causal=causal), grads=xs[2:]) - fwd
                        record(kind="chunks", cfg=cfg, n=n_c, causal=causal, chunks=chunks, ms=t)
                    tbwd.CHUNKS_OVERRIDE = None
    if "host" in sections:
        # host time of one call while the GPU is busy (a long sleep kernel queued first), and one
        # profiled call: what the suite's synchronized timing adds on top of the kernels
        set_config({})
        for d, causal in ((128, False), (128, True)):
            x = inputs(n, h, d)
            xs = inputs(n, h, d, grads=(False, False, True, True))
            for label, fn in (("fwd", kl_fn(x, causal=causal)), ("fwdbwd_student", kl_fn(xs, True, causal=causal))):
                fn()
                torch.cuda.synchronize()
                host = []
                for _ in range(20):
                    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time
                    begin = time.perf_counter()
                    fn()
                    host.append((time.perf_counter() - begin) * 1e3)
                    torch.cuda.synchronize()
                host.sort()
                start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                synced = []
                for _ in range(10):
                    torch.cuda.synchronize()
                    start_ev.record()
                    fn()
                    end_ev.record()
                    end_ev.synchronize()
                    synced.append(start_ev.elapsed_time(end_ev))
                synced.sort()
                record(kind="host", what=label, d=d, causal=causal, host_ms_median=host[len(host) // 2],
                       host_ms_min=host[0], synced_event_ms_median=synced[len(synced) // 2],
                       do_bench_ms=bench(fn, grads=xs[2:] if "bwd" in label else None))
        x = inputs(n, h, 128)
        fn = kl_fn(x, causal=True)
        fn()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)
        print(table, flush=True)
        (out / "profile_fwd.txt").write_text(table)
        # where the host time goes: cProfile of real calls (kernels launched, GPU busy meanwhile)
        import cProfile
        import io
        import pstats

        xs = inputs(n, h, 128, grads=(False, False, True, True))
        x64 = inputs(n, h, 64)
        gen = torch.Generator(device="cuda").manual_seed(1)
        pattern = torch.rand(1, h, n // 128, n // 128, device="cuda", generator=gen)
        mask = streamkl.BlockMask.from_dense(pattern >= 0.9, 128)
        report = io.StringIO()
        cases = (("forward, causal", kl_fn(x, causal=True)), ("forward, D=64", kl_fn(x64)),
                 ("forward+backward student, causal", kl_fn(xs, True, causal=True)),
                 ("forward+backward student, 90 % block sparsity", kl_fn(xs, True, mask1=mask, mask2=mask)))
        for label, fn in cases:
            fn()
            torch.cuda.synchronize()
            profiler = cProfile.Profile()
            for _ in range(20):
                torch.cuda._sleep(100_000_000)
                profiler.enable()
                fn()
                profiler.disable()
                torch.cuda.synchronize()
            for order in ("tottime", "cumulative"):
                report.write(f"===== {label}: 20 calls, by {order}\n")
                pstats.Stats(profiler, stream=report).sort_stats(order).print_stats(30)
        (out / "host_profile.txt").write_text(report.getvalue())
    if "check" in sections:
        for cfg in fwd_configs + bwd_configs:
            try:
                check(cfg)
                record(kind="check", cfg=cfg, ok=True)
            except Exception as exc:  # noqa: BLE001
                record(kind="check", cfg=cfg, ok=False, error=repr(exc)[:300])
    set_config({})
    env["seconds"] = time.time() - start
    (out / "tune.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))


if __name__ == "__main__":
    main()
