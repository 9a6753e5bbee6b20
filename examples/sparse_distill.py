"""Block-sparse distillation: a MoBA / NSA-style sparse student learns a dense causal teacher at long context.

Teacher: layer `--layer` of all-MiniLM-L6-v2 reading CPython's whole reference manual
(`pydoc_data.topics`) as one long document. MiniLM has 512 positions, so the manual is encoded in
consecutive 510-token windows ([CLS] window [SEP], positions restarting in every window) and the
hidden states that enter layer `--layer` are concatenated into one long sequence (special tokens
dropped). The layer's own query/key projections are then applied to that long sequence and the
teacher is the dense causal softmax over it: real pretrained weights reading real text, at any
length, with the causal mask applied at the distilled layer only. (The hidden states are
contextualized within their 512-token window, bidirectionally, by the layers below: the teacher
is a fixed causal attention with real structure, not MiniLM's own bidirectional behaviour.)

Student: trainable query/key projections from the same hidden states (12 heads of dim 16 by
default) and a block-sparse support chosen from them, MoBA-style: mean-pool the student's queries
and keys per block of `--block-size` tokens, score query blocks against key blocks, and keep the
`--topk` best earlier key blocks per query block plus the diagonal one
(`BlockMask.from_topk(..., causal=True, keep_diagonal=True)`). By default the selection is
shared by all heads, as NSA shares it within a GQA group (`--selection per-head` for MoBA's
per-head choice). The selection is not differentiable; it improves because the q/k it pools are
trained.

A dense teacher against a sparse student has KL = +inf (SPEC section 1), so two students are
trained side by side from the same initialization, one per formulation:
  (a) conditioned: KL(teacher restricted to the student's support || student), the same BlockMask as
      mask1 and mask2 (DeepSeek-V3.2's sparse-stage indexer loss);
  (b) reverse:     KL(student || dense teacher), the student as side 1 with its mask, the teacher
      as side 2 with no mask.

What is watched: the teacher's attention mass that the student's selected blocks capture, on a
held-out stretch of the manual (its last `--seq-len` tokens, never trained on). streamkl computes it
without materializing anything: with `return_lse=True`, lse1 of the teacher against itself over the
student's support, minus the teacher's dense lse, is log(captured mass) per row and head. It is
compared with three selections of the same budget: the most recent blocks (a sliding window), the
teacher's own pooled q/k (MoBA applied to the teacher), and the oracle top-k by the teacher's true
block mass (computed chunk by chunk, evaluation only).

    python examples/sparse_distill.py                         # CPU: 1024 tokens, a few minutes
    python examples/sparse_distill.py --device cuda --seq-len 32768 --block-size 64 --topk 16 --steps 500 \\
        --dtype bfloat16                                      # GPU, 32K tokens of context

Outputs: report.json, report.md and loss.png in runs/sparse_distill/ (or --out; the committed
reports are in examples/results/).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import streamkl  # noqa: E402

SCRIPT = "sparse_distill"
WINDOW = 510  # MiniLM's 512 positions minus [CLS] and [SEP]


def parse_args(argv=None) -> argparse.Namespace:
    parser = common.example_parser(__doc__, SCRIPT, lr=5e-3, quick="tiny run for smoke tests: short context, few steps")
    parser.add_argument("--layer", type=int, default=1, help="teacher layer (0..5)")
    parser.add_argument("--seq-len", type=int, default=1024, help="context length (a multiple of --block-size)")
    parser.add_argument("--block-size", type=int, default=32, choices=[16, 32, 64, 128, 256], help="mask block size")
    parser.add_argument("--topk", type=int, default=4, help="selected earlier key blocks per query block (+ diagonal)")
    parser.add_argument(
        "--selection",
        default="shared",
        choices=["shared", "per-head"],
        help="one block pattern for all heads (NSA) or one per head (MoBA)",
    )
    parser.add_argument("--student-dim", type=int, default=16, help="student head dim (teacher: 32), 12 heads")
    parser.add_argument(
        "--train-tokens",
        type=int,
        default=0,
        help="tokens of the manual to draw training crops from (0: 8 x seq-len, capped by the manual)",
    )
    parser.add_argument("--steps", type=int, default=40, help="training steps")
    parser.add_argument("--batch", type=int, default=1, help="random crops per training step")
    parser.add_argument("--eval-every", type=int, default=10, help="held-out evaluation interval, steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.seq_len = min(args.seq_len, 256)
        args.block_size = min(args.block_size, 32)
        args.topk = min(args.topk, 2)
        args.train_tokens = args.train_tokens or 2 * args.seq_len
        args.eval_every = min(args.eval_every, max(args.steps, 1))
    if args.seq_len % args.block_size:
        parser.error("--seq-len must be a multiple of --block-size")
    if not 0 <= args.layer <= 5:
        parser.error("--layer must be in 0..5 (MiniLM-L6 has 6 layers)")
    return args


# ---------------------------------------------------------------- the teacher over a long document
@torch.no_grad()
def encode_long(model, tokenizer, token_ids: list[int], layer: int, device, batch_size: int = 16) -> torch.Tensor:
    """Hidden states entering `layer` for an arbitrarily long token list: (N, hidden)."""
    windows = [token_ids[i : i + WINDOW] for i in range(0, len(token_ids), WINDOW)]
    hidden = []
    with common.capture_qk(model, layer) as captured:
        for start in range(0, len(windows), batch_size):
            chunk = [[tokenizer.cls_token_id, *w, tokenizer.sep_token_id] for w in windows[start : start + batch_size]]
            batch = tokenizer.pad({"input_ids": chunk}, return_tensors="pt").to(device)
            model(**batch)
            for row, window in enumerate(windows[start : start + batch_size]):
                hidden.append(captured["hidden"][row, 1 : 1 + len(window)])  # drop [CLS], [SEP], padding
    return torch.cat(hidden)


def teacher_qk(model, layer: int, hidden: torch.Tensor):
    """The layer's own query/key projections applied to a long hidden sequence: (..., 12, 32) each."""
    attention = model.encoder.layer[layer].attention.self
    heads, head_dim = common.minilm_heads(model)
    with torch.no_grad():
        q, k = attention.query(hidden), attention.key(hidden)
    return q.view(*hidden.shape[:-1], heads, head_dim), k.view(*hidden.shape[:-1], heads, head_dim)


# ---------------------------------------------------------------- block selection
def select_blocks(block_scores: torch.Tensor, args) -> streamkl.BlockMask:
    """Top-k earlier key blocks per query block, plus the diagonal one, from (B, H, nb, nb) scores.

    The diagonal block is always kept, so it is taken out of the competition: every selection
    (student, window, teacher-pooled, oracle) then keeps exactly the same number of blocks."""
    if args.selection == "shared":
        block_scores = block_scores.sum(1, keepdim=True)  # NSA: importance summed over the group's heads
    nb = block_scores.shape[-1]
    diagonal = torch.eye(nb, dtype=torch.bool, device=block_scores.device)
    block_scores = block_scores.float().masked_fill(diagonal, float("-inf"))
    return streamkl.BlockMask.from_topk(
        block_scores,
        args.topk,
        args.block_size,
        causal=True,
        keep_diagonal=True,
        seqlen_q=args.seq_len,
        seqlen_k=args.seq_len,
    )


def pooled_scores(q: torch.Tensor, k: torch.Tensor, block_size: int) -> torch.Tensor:
    """MoBA's gate at block granularity: mean-pooled queries . mean-pooled keys, (B, H, nb, nb)."""
    b, n, h, d = q.shape
    q_pooled = q.float().view(b, n // block_size, block_size, h, d).mean(2)
    k_pooled = k.float().view(b, n // block_size, block_size, h, d).mean(2)
    return torch.einsum("bihd,bjhd->bhij", q_pooled, k_pooled) / math.sqrt(d)


def window_scores(batch: int, heads: int, nb: int, device) -> torch.Tensor:
    """Recency: the nearest earlier blocks score highest (a sliding window of the same budget)."""
    index = torch.arange(nb, device=device, dtype=torch.float32)
    return (index[None, :] - index[:, None]).expand(batch, heads, nb, nb)


@torch.no_grad()
def oracle_scores(q1: torch.Tensor, k1: torch.Tensor, block_size: int) -> torch.Tensor:
    """The teacher's true attention mass per (query block, key block), summed over the block's rows:
    materialized one query block at a time, for evaluation only. (B, H, nb, nb)."""
    b, n, h, d = q1.shape
    nb = n // block_size
    out = torch.zeros(b, h, nb, nb, device=q1.device)
    keys = k1.float().transpose(1, 2)  # [B, H, N, D]
    for i in range(nb):
        rows = slice(i * block_size, (i + 1) * block_size)
        visible = (i + 1) * block_size
        scores = torch.einsum("bnhd,bhmd->bhnm", q1[:, rows].float(), keys[:, :, :visible]) / math.sqrt(d)
        causal = (
            torch.arange(visible, device=q1.device)[None, :]
            <= torch.arange(rows.start, rows.stop, device=q1.device)[:, None]
        )
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)  # [B, H, bs, visible]
        out[:, :, i, : i + 1] = probs.view(b, h, block_size, i + 1, block_size).sum((2, 4))
    return out


# ---------------------------------------------------------------- held-out measurements
class HeldOut:
    """The held-out crop: teacher q/k, and the teacher's dense lse computed once by streamkl."""

    def __init__(self, hidden, q1, k1, args):
        self.hidden, self.q1, self.k1, self.args = hidden, q1, k1, args
        dtype = common.parse_dtype(args.dtype)
        with torch.no_grad():
            _, self.dense_lse, _ = streamkl.kl(
                q1.to(dtype),
                k1.to(dtype),
                q1.to(dtype),
                k1.to(dtype),
                causal=True,
                reduction="none",
                return_lse=True,
                backend=args.backend,
            )

    @torch.no_grad()
    def captured_mass(self, mask: streamkl.BlockMask) -> float:
        """Mean over rows and heads of the teacher's attention mass inside `mask`: exp(lse over the
        support - dense lse). Only the support's blocks are visited."""
        dtype = common.parse_dtype(self.args.dtype)
        q1, k1 = self.q1.to(dtype), self.k1.to(dtype)
        _, support_lse, _ = streamkl.kl(
            q1,
            k1,
            q1,
            k1,
            causal=True,
            mask1=mask,
            mask2=mask,
            reduction="none",
            return_lse=True,
            backend=self.args.backend,
        )
        return float(torch.exp(support_lse - self.dense_lse).clamp(max=1.0).mean())

    @torch.no_grad()
    def measure(self, student) -> dict:
        dtype = common.parse_dtype(self.args.dtype)
        q2, k2 = student(self.hidden)
        mask = select_blocks(pooled_scores(q2, k2, self.args.block_size), self.args)
        q1, k1, q2, k2 = (t.to(dtype) for t in (self.q1, self.k1, q2, k2))
        conditioned = streamkl.kl(q1, k1, q2, k2, causal=True, mask1=mask, mask2=mask, backend=self.args.backend)
        reverse = streamkl.kl(q2, k2, q1, k1, causal=True, mask1=mask, backend=self.args.backend)
        return {
            "captured_mass": self.captured_mass(mask),
            "conditioned_kl": float(conditioned),
            "reverse_kl": float(reverse),
        }


def causal_block_density(args) -> float:
    """Fraction of the causal key blocks each selection keeps (the same for all of them)."""
    nb = args.seq_len // args.block_size
    kept = sum(min(args.topk, i) + 1 for i in range(nb))
    return kept / (nb * (nb + 1) / 2)


# ---------------------------------------------------------------- main
def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = common.pick_device(args.device)
    dtype = common.parse_dtype(args.dtype)
    out = common.output_dir(args.out, SCRIPT)
    started = time.perf_counter()

    # -- the manual as one long document: training crops from its start, held-out from its end
    model, tokenizer = common.load_minilm(device, num_layers=args.layer + 1)
    heads, teacher_dim = common.minilm_heads(model)
    document = "\n\n".join(text for _, text in common.pydoc_topics())
    token_ids = tokenizer(document, add_special_tokens=False)["input_ids"]
    train_tokens = args.train_tokens or 8 * args.seq_len
    train_tokens = min(train_tokens, len(token_ids) - args.seq_len)
    if train_tokens < args.seq_len:
        raise SystemExit(
            f"the manual has {len(token_ids)} tokens: too few for --seq-len {args.seq_len} plus a "
            "held-out stretch of the same length"
        )
    print(
        f"teacher: all-MiniLM-L6-v2 layer {args.layer}, {heads} heads x dim {teacher_dim}, dense causal; "
        f"encoding {train_tokens} + {args.seq_len} of the manual's {len(token_ids)} tokens ...",
        flush=True,
    )
    t0 = time.perf_counter()
    train_hidden = encode_long(model, tokenizer, token_ids[:train_tokens], args.layer, device)
    heldout_hidden = encode_long(model, tokenizer, token_ids[-args.seq_len :], args.layer, device)[None]
    common.synchronize(device)
    teacher_seconds = time.perf_counter() - t0

    # -- held-out baselines, all with the same block budget
    heldout = HeldOut(heldout_hidden, *teacher_qk(model, args.layer, heldout_hidden), args)
    nb = args.seq_len // args.block_size
    baselines = {
        "window": heldout.captured_mass(select_blocks(window_scores(1, heads, nb, device), args)),
        "teacher_pooled": heldout.captured_mass(
            select_blocks(pooled_scores(heldout.q1, heldout.k1, args.block_size), args)
        ),
        "oracle": heldout.captured_mass(select_blocks(oracle_scores(heldout.q1, heldout.k1, args.block_size), args)),
    }
    density = causal_block_density(args)
    print(
        f"  held-out captured mass at {density:.1%} of the causal blocks: window {baselines['window']:.3f}, "
        f"teacher's own pooled q/k {baselines['teacher_pooled']:.3f}, oracle {baselines['oracle']:.3f}"
    )

    # -- two students from one initialization, one per formulation
    students = {"conditioned": common.Student(train_hidden.shape[-1], heads, args.student_dim).to(device)}
    students["reverse"] = common.Student(train_hidden.shape[-1], heads, args.student_dim).to(device)
    students["reverse"].load_state_dict(students["conditioned"].state_dict())
    optimizers = {name: torch.optim.AdamW(s.parameters(), lr=args.lr, weight_decay=0.0) for name, s in students.items()}
    before = heldout.measure(students["conditioned"])

    def loss_of(name: str, hidden, q1, k1):
        q2, k2 = students[name](hidden)
        with torch.no_grad():
            mask = select_blocks(pooled_scores(q2, k2, args.block_size), args)
        q1, k1, q2, k2 = (t.to(dtype) for t in (q1, k1, q2, k2))
        if name == "conditioned":  # (a) the teacher conditioned on the student's support
            return streamkl.kl(q1, k1, q2, k2, causal=True, mask1=mask, mask2=mask, backend=args.backend)
        return streamkl.kl(q2, k2, q1, k1, causal=True, mask1=mask, backend=args.backend)  # (b) reverse KL

    from tqdm.auto import tqdm

    history = {"step": [], "eval_step": [0]}
    for name in students:
        history[f"train_{name}"] = []
        history[f"heldout_{name}"] = [before]
    generator = torch.Generator().manual_seed(args.seed)
    common.synchronize(device)
    t0 = time.perf_counter()
    progress = tqdm(range(1, args.steps + 1), desc="sparse distillation", dynamic_ncols=True)
    for step in progress:
        starts = torch.randint(0, train_tokens - args.seq_len + 1, (args.batch,), generator=generator).tolist()
        hidden = torch.stack([train_hidden[s : s + args.seq_len] for s in starts])  # [B, N, 384]
        q1, k1 = teacher_qk(model, args.layer, hidden)
        history["step"].append(step)
        for name in students:
            loss = loss_of(name, hidden, q1, k1)
            optimizers[name].zero_grad(set_to_none=True)
            loss.backward()
            optimizers[name].step()
            history[f"train_{name}"].append(loss.item())
        progress.set_postfix(cond=f"{history['train_conditioned'][-1]:.3f}", rev=f"{history['train_reverse'][-1]:.3f}")
        if step % args.eval_every == 0 or step == args.steps:
            history["eval_step"].append(step)
            for name, student in students.items():
                history[f"heldout_{name}"].append(heldout.measure(student))
            progress.write(
                f"step {step:4d}  captured mass: (a) conditioned "
                f"{history['heldout_conditioned'][-1]['captured_mass']:.3f}  (b) reverse "
                f"{history['heldout_reverse'][-1]['captured_mass']:.3f}"
            )
    common.synchronize(device)
    train_seconds = time.perf_counter() - t0

    # -- report
    after = {name: history[f"heldout_{name}"][-1] for name in students}
    report = {
        "script": SCRIPT,
        "command": " ".join(["python", "examples/sparse_distill.py", *(sys.argv[1:] if argv is None else argv)]),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "teacher": {
            "model": "all-MiniLM-L6-v2",
            "layer": args.layer,
            "heads": heads,
            "head_dim": teacher_dim,
            "attention": "dense causal over the long hidden sequence",
        },
        "student": {
            "heads": heads,
            "head_dim": args.student_dim,
            "selection": args.selection,
            "parameters": sum(p.numel() for p in students["reverse"].parameters()),
        },
        "data": {"manual_tokens": len(token_ids), "train_tokens": train_tokens, "heldout_tokens": args.seq_len},
        "budget": {
            "block_size": args.block_size,
            "blocks_per_row": nb,
            "topk_plus_diagonal": args.topk + 1,
            "causal_block_density": density,
        },
        "heldout_captured_mass": {
            "window": baselines["window"],
            "teacher_pooled": baselines["teacher_pooled"],
            "oracle": baselines["oracle"],
            "student_init": before["captured_mass"],
            "student_a_conditioned": after["conditioned"]["captured_mass"],
            "student_b_reverse": after["reverse"]["captured_mass"],
        },
        "heldout": {"init": before, "a_conditioned": after["conditioned"], "b_reverse": after["reverse"]},
        "timing_s": {
            "teacher_encoding": teacher_seconds,
            "training_both_students": train_seconds,
            "per_step": train_seconds / max(args.steps, 1),
            "total": time.perf_counter() - started,
        },
        "environment": common.environment(device, args.backend),
        "history": history,
    }
    mass = report["heldout_captured_mass"]
    lines = [
        f"# Block-sparse distillation at {args.seq_len:,} tokens: MiniLM layer {args.layer} (dense causal) -> "
        "MoBA/NSA-style student",
        "",
        f"Student: 12 heads x dim {args.student_dim}, {args.selection} block selection from mean-pooled q/k, "
        f"blocks of {args.block_size}, top-{args.topk} + diagonal = {density:.1%} of the causal blocks. "
        f"{args.steps} steps x {args.batch} random crop(s) of {args.seq_len:,} tokens from the first "
        f"{train_tokens:,} tokens of CPython's manual; held out: its last {args.seq_len:,} tokens.",
        "",
        "Teacher attention mass captured by the selected blocks (held out, mean over rows and heads):",
        "",
        "| selection (same budget) | captured mass |",
        "| --- | ---: |",
        f"| sliding window (most recent blocks) | {mass['window']:.3f} |",
        f"| teacher's own mean-pooled q/k (MoBA on the teacher) | {mass['teacher_pooled']:.3f} |",
        f"| oracle top-k by true teacher block mass | {mass['oracle']:.3f} |",
        f"| student, random init | {mass['student_init']:.3f} |",
        f"| student (a), trained on KL(teacher on support ‖ student) | {mass['student_a_conditioned']:.3f} |",
        f"| student (b), trained on KL(student ‖ dense teacher) | {mass['student_b_reverse']:.3f} |",
        "",
        "Both objectives, measured on both trained students (held out, nats per row and head):",
        "",
        "| student | KL(teacher on support ‖ student) | KL(student ‖ dense teacher) |",
        "| --- | ---: | ---: |",
    ]
    for label, metrics in (
        ("random init", before),
        ("(a) conditioned", after["conditioned"]),
        ("(b) reverse", after["reverse"]),
    ):
        lines.append(f"| {label} | {metrics['conditioned_kl']:.4f} | {metrics['reverse_kl']:.4f} |")
    lines += [
        "",
        f"Teacher encoding {teacher_seconds:.1f} s; training both students {train_seconds:.1f} s "
        f"({report['timing_s']['per_step']:.2f} s/step) on {report['environment']['device']}, backend "
        f"{report['environment']['backend_asked']}, torch {torch.__version__}.",
        "",
        f"Command: `{report['command']}`",
    ]
    plot(history, mass, out / "loss.png", args)
    common.write_report(out, report, "\n".join(lines))
    return report


def plot(history: dict, mass: dict, path: Path, args) -> None:
    plt, fig, (ax_loss, ax_mass, ax_cross) = common.new_figure(3)
    labels = {"conditioned": "(a) KL(teacher|support ‖ student)", "reverse": "(b) KL(student ‖ teacher)"}
    for name, label in labels.items():
        ax_loss.plot(history["step"], history[f"train_{name}"], lw=0.9, label=label)
        ax_mass.plot(
            history["eval_step"],
            [m["captured_mass"] for m in history[f"heldout_{name}"]],
            "o-",
            label=f"student {label[:3]} {name}",
        )
    ax_loss.set_yscale("log")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss, nats per row")
    ax_loss.set_title(f"{args.seq_len:,} tokens, blocks of {args.block_size}, top-{args.topk}+diag")
    ax_loss.legend()
    for key, style, label in (
        ("oracle", ":", "oracle"),
        ("teacher_pooled", "--", "teacher pooled q/k"),
        ("window", "-.", "sliding window"),
    ):
        ax_mass.axhline(mass[key], ls=style, color="gray", label=label)
    ax_mass.set_xlabel("step")
    ax_mass.set_ylabel("held-out teacher mass captured")
    ax_mass.set_ylim(0, 1)
    ax_mass.legend()
    for name, color in (("conditioned", "C0"), ("reverse", "C1")):
        runs = history[f"heldout_{name}"]
        ax_cross.plot(
            history["eval_step"],
            [m["conditioned_kl"] for m in runs],
            "o-",
            color=color,
            label=f"student {name}: conditioned KL",
        )
        ax_cross.plot(
            history["eval_step"],
            [m["reverse_kl"] for m in runs],
            "s--",
            color=color,
            label=f"student {name}: reverse KL",
        )
    ax_cross.set_yscale("log")
    ax_cross.set_xlabel("step")
    ax_cross.set_ylabel("held-out KL, nats per row")
    ax_cross.legend(fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
