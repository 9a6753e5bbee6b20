"""DSA lightning indexer: train a cheap key selector by `streamkl.indexer_kl`, dense stage then top-k stage.

Teacher: layer `--layer` of all-MiniLM-L6-v2 made causal, reading CPython's reference manual
(`pydoc_data.topics`) as one long document (encoded in 510-token windows whose hidden states are
concatenated, as examples/sparse_distill.py does; the layer's own query/key projections then attend
causally over the whole stretch). Its attention distribution is the mean of its 12 heads' softmaxes.

Indexer (DeepSeek-V3.2's lightning indexer): from the same hidden states, `--index-heads` query heads
of dim `--index-dim`, one shared key of that dim per token, and per-head weights from a linear layer;
its logits are z[i, j] = sum_t w_t[i] relu(<qi_t[i], ki[j]>), and each query keeps its `--topk`
highest-scoring earlier keys. Training, as DSA does it:
  1. dense stage (`--dense-steps`): KL(teacher || softmax(z)) over all causal keys;
  2. top-k stage (`--sparse-steps`): the same KL over each row's selected keys only, the teacher
     renormalized over them (the sparse main attention's view).

What is watched, on a held-out stretch of the manual (its last `--seq-len` tokens): the fraction of the
teacher's attention mass that the indexer's top-k captures, per query row with more than `--topk`
visible keys, before training, after each stage, against a sliding window of the same budget (the
`--topk` most recent keys) and the oracle (the teacher's own top-k).

    python examples/dsa_indexer.py                            # CPU: 1024 tokens, a few minutes
    python examples/dsa_indexer.py --device cuda --dtype bfloat16 --seq-len 32768 --topk 2048 \\
        --index-heads 16 --index-dim 64 --dense-steps 200 --sparse-steps 200    # H200, 32K tokens

Outputs: report.json, report.md and loss.png in runs/dsa_indexer/ (or --out).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from sparse_distill import encode_long, teacher_qk  # noqa: E402

import streamkl  # noqa: E402

SCRIPT = "dsa_indexer"


def parse_args(argv=None) -> argparse.Namespace:
    parser = common.example_parser(__doc__, SCRIPT, lr=3e-3, quick="tiny run for smoke tests (256 tokens, 2 + 2 steps)")
    parser.add_argument("--layer", type=int, default=1, help="teacher layer (0..5)")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per training crop and held-out stretch")
    parser.add_argument("--topk", type=int, default=64, help="keys each query selects")
    parser.add_argument("--index-heads", type=int, default=4, help="indexer heads (DSA: 64)")
    parser.add_argument("--index-dim", type=int, default=32, help="indexer head dim (DSA: 128)")
    parser.add_argument("--dense-steps", type=int, default=60, help="steps of the dense stage")
    parser.add_argument("--sparse-steps", type=int, default=60, help="steps of the top-k stage")
    parser.add_argument("--train-tokens", type=int, default=0,
                        help="tokens of the manual to draw training crops from (0: 8 x seq-len)")
    args = parser.parse_args(argv)
    if args.quick:
        args.seq_len, args.topk = min(args.seq_len, 256), min(args.topk, 16)
        args.dense_steps, args.sparse_steps = min(args.dense_steps, 2), min(args.sparse_steps, 2)
        args.train_tokens = args.train_tokens or 2 * args.seq_len
    if not 0 <= args.layer <= 5:
        parser.error("--layer must be in 0..5 (MiniLM-L6 has 6 layers)")
    if not 0 < args.topk < args.seq_len:
        parser.error("--topk must be in 1..seq-len - 1")
    return args


class LightningIndexer(nn.Module):
    """DSA's indexer: per-head queries, one shared key, per-head weights, all linear in the hidden state."""

    def __init__(self, hidden_size: int, heads: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.query = nn.Linear(hidden_size, heads * head_dim)
        self.key = nn.Linear(hidden_size, head_dim)
        self.weights = nn.Linear(hidden_size, heads)

    def forward(self, hidden: torch.Tensor):
        qi = self.query(hidden).view(*hidden.shape[:-1], self.heads, self.head_dim)
        # as DSA scales them: the weights carry 1/sqrt(heads * head_dim), so z stays O(1) at init
        w = self.weights(hidden) * (self.heads * self.head_dim) ** -0.5
        return qi, self.key(hidden), w


def rows_per_chunk(width: int, seq_len: int, budget: int = 1 << 25) -> int:
    return max(1, min(seq_len, budget // max(width * seq_len, 1)))


@torch.no_grad()
def indexer_topk(qi, ki, w, topk: int) -> torch.Tensor:
    """(B, N, K) int32: each row's `topk` highest indexer logits over its causal keys (-1 where the row
    sees fewer), computed a chunk of rows at a time (never all N x N logits at once)."""
    batch, seq_len, heads, _ = qi.shape
    out = torch.empty(batch, seq_len, topk, dtype=torch.int32, device=qi.device)
    step = rows_per_chunk(heads, seq_len)
    keys = torch.arange(seq_len, device=qi.device)
    for r0 in range(0, seq_len, step):
        r1 = min(r0 + step, seq_len)
        logits = torch.einsum("bnhd,bmd->bnhm", qi[:, r0:r1].float(), ki.float()).relu()
        logits = torch.einsum("bnh,bnhm->bnm", w[:, r0:r1].float(), logits)
        causal = keys[None, :] <= torch.arange(r0, r1, device=qi.device)[:, None]
        values, index = logits.masked_fill(~causal, float("-inf")).topk(topk, dim=-1)
        out[:, r0:r1] = torch.where(values == float("-inf"), -1, index).int()
    return out


def window_topk(batch: int, seq_len: int, topk: int, device) -> torch.Tensor:
    """The sliding window of the same budget: the `topk` most recent keys (-1 before the start)."""
    rows = torch.arange(seq_len, device=device)[:, None]
    index = rows - torch.arange(topk, device=device)[None, :]
    return torch.where(index >= 0, index, -1).int().expand(batch, -1, -1)


@torch.no_grad()
def captured_mass(q, k, selections: dict, topk: int) -> dict:
    """Mean over rows with more than `topk` causal keys of the teacher's mass on each selection's keys;
    "oracle" is the teacher's own top-k. The teacher's rows are materialized a chunk at a time."""
    batch, seq_len, heads, dim = q.shape
    step = rows_per_chunk(heads, seq_len)
    totals = dict.fromkeys([*selections, "oracle"], 0.0)
    keys = torch.arange(seq_len, device=q.device)
    for r0 in range(topk, seq_len, step):  # rows < topk see every key they may: nothing to choose
        r1 = min(r0 + step, seq_len)
        scores = torch.einsum("bnhd,bmhd->bhnm", q[:, r0:r1].float(), k.float()) / math.sqrt(dim)
        causal = keys[None, :] <= torch.arange(r0, r1, device=q.device)[:, None]
        teacher = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1).mean(1)  # [B, R, N]
        for name, index in selections.items():
            chosen = index[:, r0:r1].long()
            mass = torch.where(chosen >= 0, teacher.gather(-1, chosen.clamp(min=0)), 0.0)
            totals[name] += mass.sum().item()
        totals["oracle"] += teacher.topk(topk, dim=-1).values.sum().item()
    count = batch * (seq_len - topk)
    return {name: total / count for name, total in totals.items()}


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = common.pick_device(args.device)
    dtype = common.parse_dtype(args.dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    model, tokenizer = common.load_minilm(device, num_layers=args.layer + 1)
    heads, teacher_dim = common.minilm_heads(model)
    document = "\n\n".join(text for _, text in common.pydoc_topics())
    token_ids = tokenizer(document, add_special_tokens=False)["input_ids"]
    train_tokens = min(args.train_tokens or 8 * args.seq_len, len(token_ids) - args.seq_len)
    if train_tokens < args.seq_len:
        raise SystemExit(f"the manual has {len(token_ids)} tokens: too few for --seq-len {args.seq_len} twice")
    print(f"teacher: all-MiniLM-L6-v2 layer {args.layer} made causal, {heads} heads x {teacher_dim}; "
          f"encoding {train_tokens} + {args.seq_len} of the manual's {len(token_ids)} tokens ...", flush=True)
    train_hidden = encode_long(model, tokenizer, token_ids[:train_tokens], args.layer, device)
    heldout_hidden = encode_long(model, tokenizer, token_ids[-args.seq_len:], args.layer, device)[None]
    heldout_q, heldout_k = teacher_qk(model, args.layer, heldout_hidden)

    indexer = LightningIndexer(train_hidden.shape[-1], args.index_heads, args.index_dim).to(device)
    optimizer = torch.optim.AdamW(indexer.parameters(), lr=args.lr, weight_decay=0.0)
    window = window_topk(1, args.seq_len, args.topk, device)

    def evaluate() -> dict:
        with torch.no_grad():
            qi, ki, w = indexer(heldout_hidden)
            chosen = indexer_topk(qi, ki, w, args.topk)
        return captured_mass(heldout_q, heldout_k, {"indexer": chosen, "window": window}, args.topk)

    evaluations = {"init": evaluate()}
    print(f"  held-out mass captured by top-{args.topk}: indexer {evaluations['init']['indexer']:.3f}, "
          f"window {evaluations['init']['window']:.3f}, oracle {evaluations['init']['oracle']:.3f}")
    history = {"dense": [], "topk": []}
    generator = torch.Generator().manual_seed(args.seed)
    common.synchronize(device)
    t0 = time.perf_counter()
    for stage, steps in (("dense", args.dense_steps), ("topk", args.sparse_steps)):
        for step in range(1, steps + 1):
            start = int(torch.randint(0, train_tokens - args.seq_len + 1, (1,), generator=generator))
            hidden = train_hidden[None, start : start + args.seq_len]
            q, k = teacher_qk(model, args.layer, hidden)
            qi, ki, w = indexer(hidden)
            topk = indexer_topk(qi, ki, w, args.topk) if stage == "topk" else None
            loss = streamkl.indexer_kl(q.to(dtype), k.to(dtype), qi.to(dtype), ki.to(dtype), w.to(dtype),
                                       causal=True, topk_indices=topk, backend=args.backend)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            history[stage].append(loss.item())
            if step == steps or step % 10 == 0:
                print(f"  {stage} step {step}/{steps}: loss {history[stage][-1]:.4f}", flush=True)
        evaluations[f"after_{stage}"] = evaluate()
        print(f"  after the {stage} stage: indexer captures {evaluations[f'after_{stage}']['indexer']:.3f}")
    common.synchronize(device)
    train_seconds = time.perf_counter() - t0

    report = {
        "script": SCRIPT,
        "command": "python examples/dsa_indexer.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "settings": {key: value for key, value in vars(args).items() if key != "out"},
        "teacher": {"model": "all-MiniLM-L6-v2", "layer": args.layer, "heads": heads, "head_dim": teacher_dim,
                    "attention": "dense causal over the long hidden sequence"},
        "indexer": {"heads": args.index_heads, "head_dim": args.index_dim,
                    "parameters": sum(p.numel() for p in indexer.parameters())},
        "captured_mass": evaluations,
        "final_loss": {stage: values[-1] for stage, values in history.items() if values},
        "train_seconds": train_seconds,
        "total_seconds": time.perf_counter() - started,
        "environment": common.environment(device, args.backend),
    }
    rows = "\n".join(f"| {name} | {m['indexer']:.3f} | {m['window']:.3f} | {m['oracle']:.3f} |"
                     for name, m in evaluations.items())
    markdown = f"""# DSA lightning indexer trained by streamkl.indexer_kl

Teacher: all-MiniLM-L6-v2 layer {args.layer}, causal, mean of {heads} heads; indexer {args.index_heads} heads x
{args.index_dim}; {args.seq_len} tokens of CPython's manual per crop; {args.dense_steps} dense then
{args.sparse_steps} top-{args.topk} steps ({train_seconds:.0f} s on {report['environment']['device']}).

Held-out teacher attention mass captured by {args.topk} keys per query (rows with more than {args.topk} keys):

| when | indexer top-k | sliding window | oracle (teacher top-k) |
| --- | --- | --- | --- |
{rows}
"""
    plot(history, evaluations, out / "loss.png", args)
    common.write_report(out, report, markdown)
    return report


def plot(history: dict, evaluations: dict, path: Path, args) -> None:
    plt, fig, (ax_loss, ax_mass) = common.new_figure(2)
    dense = history["dense"]
    ax_loss.plot(range(1, len(dense) + 1), dense, lw=0.9, label="dense stage")
    ax_loss.plot(range(len(dense) + 1, len(dense) + len(history["topk"]) + 1), history["topk"], lw=0.9,
                 label=f"top-{args.topk} stage")
    ax_loss.set_yscale("log")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("indexer KL, nats per row")
    ax_loss.legend()
    names = list(evaluations)
    ax_mass.plot(names, [evaluations[n]["indexer"] for n in names], "o-", label="indexer top-k")
    ax_mass.axhline(evaluations["init"]["window"], ls="-.", color="gray", label="sliding window")
    ax_mass.axhline(evaluations["init"]["oracle"], ls=":", color="gray", label="oracle")
    ax_mass.set_ylim(0, 1)
    ax_mass.set_ylabel(f"held-out teacher mass in {args.topk} keys")
    ax_mass.legend()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
