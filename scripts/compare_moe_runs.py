#!/usr/bin/env python3
"""Side-by-side layer times of two or more `qmoe bench moe` result directories (A/B runs of one build,
e.g. QMOE_FUSED_EPILOGUE=0 vs 1): per model and T, the det / fused graph-replay us of each run and the
ratio of the last run to the first. Usage: compare_moe_runs.py DIR_A DIR_B [...]"""
import glob
import sys


def table(directory):
    rows = {}
    for path in sorted(glob.glob(f"{directory}/*.md")):
        header = None
        for line in open(path):
            if not line.startswith("| "):
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cells[0] == "model":
                header = cells
            elif header and not set(cells[0]) <= {"-", ":"}:
                r = dict(zip(header, cells))
                rows[(r["model"], r["T"])] = r
    return rows


def num(r, key):
    try:
        return float(r.get(key, "nan"))
    except ValueError:
        return float("nan")


runs = [table(d) for d in sys.argv[1:]]
print("| model | T | " + " | ".join(f"det {i}" for i in range(len(runs))) + " | det last/first | "
      + " | ".join(f"fused {i}" for i in range(len(runs))) + " | fused last/first |")
print("|---|--:|" + "--:|" * (2 * len(runs) + 2))
for key in runs[0]:
    det = [num(r.get(key, {}), "qmoe det graph") for r in runs]
    fus = [num(r.get(key, {}), "qmoe fused graph") for r in runs]
    print(f"| {key[0]} | {key[1]} | " + " | ".join(f"{v:.1f}" for v in det) + f" | {det[-1] / det[0]:.3f} | "
          + " | ".join(f"{v:.1f}" for v in fus) + f" | {fus[-1] / fus[0]:.3f} |")
