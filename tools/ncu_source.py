"""Summarize Nsight Compute source counters (warp stall sampling per SASS instruction) of one
kernel: the CSV of `ncu --section SourceCounters --section WarpStateStats --page source --csv
--print-source sass ...`, e.g. with `--kernel-name regex:_kl_`). Finds the loops
(backward branches) of 300-520 instructions, the consumer warpgroups' step loops of the Gluon
backward, and prints for each its share of the samples, the stall reasons, the samples by opcode
and the instructions with the most samples.

    python tools/ncu_source.py ncu_src.csv [--min 300 --max 520 --top 25]
"""

from __future__ import annotations

import argparse
import collections
import csv
import re


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("csv")
    parser.add_argument("--min", type=int, default=300)
    parser.add_argument("--max", type=int, default=520)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    rows = list(csv.reader(open(args.csv)))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    header = rows[start]
    data = [dict(zip(header, r)) for r in rows[start + 1:] if len(r) == len(header)]
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    samples = "Warp Stall Sampling (All Samples)"
    at = {d["Address"]: i for i, d in enumerate(data)}
    loops = set()
    for i, d in enumerate(data):
        m = re.search(r"BRA (0x[0-9a-f]+)", d["Source"])
        if m and at.get(m.group(1), i) < i:
            loops.add((at[m.group(1)], i))
    total = sum(number(d[samples]) for d in data)
    print(f"total samples {total:.0f}; SASS instructions {len(data)}")
    for lo, hi in sorted(loops):
        if not args.min <= hi - lo + 1 <= args.max:
            continue
        body = data[lo:hi + 1]
        got = sum(number(d[samples]) for d in body) or 1.0
        print(f"\nloop rows {lo}-{hi} ({hi - lo + 1} instructions): {got:.0f} samples ({got / total:.1%})")
        reasons = collections.Counter()
        opcodes = collections.Counter()
        for d in body:
            for s in stalls:
                reasons[s[6:]] += number(d[s])
            text = d["Source"].strip().split()
            opcodes[(text[1] if text[0].startswith("@") else text[0]).split(".")[0]] += number(d[samples])
        print("  stalls:", ", ".join(f"{k} {v / got:.1%}" for k, v in reasons.most_common(9)))
        print("  samples by opcode:", ", ".join(f"{k} {v / got:.1%}" for k, v in opcodes.most_common(12)))
        for i in sorted(sorted(range(lo, hi + 1), key=lambda i: -number(data[i][samples]))[:args.top]):
            d = data[i]
            why = sorted(((number(d[s]), s[6:]) for s in stalls), reverse=True)[:3]
            print(f"  {i:5d} {number(d[samples]):6.0f} {d['Source'].strip()[:62]:62s} "
                  + " ".join(f"{k}={v:.0f}" for v, k in why if v))


if __name__ == "__main__":
    main()
