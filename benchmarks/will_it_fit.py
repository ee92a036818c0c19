"""The table of docs/howto/will-it-fit.md: `sf.estimate` of a GPT-2-small-sized GPT on 1-8 ranks.

No tensor of the model is ever materialized: the GPT is built on the meta device and the
step runs on meta tensors, so this takes seconds on a laptop. The page's table sits
between two markers and is rewritten from this script; tests/estimate/test_estimate.py checks that
the page holds what this script prints.

    python -m benchmarks.will_it_fit            # print the table (markdown), write results/will_it_fit.json
    python -m benchmarks.will_it_fit --write    # and put it into docs/howto/will-it-fit.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re

import torch

import shardfn as sf
from shardfn._estimate import format_bytes
from shardfn.testing.models import GPT, GPTConfig

RESULTS = os.path.join(os.path.dirname(__file__), "results")
PAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "howto", "will-it-fit.md")
BEGIN, END = "<!-- begin table: python -m benchmarks.will_it_fit --write -->", "<!-- end table -->"

CONFIG = GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768, sdpa=True)  # 124M params
BATCH, SEQ = 8, 1024  # per rank
SIZES = (1, 2, 4, 8)

COLUMNS = [
    ("ranks", None),
    ("param shards", "param_bytes"),
    ("grad shards", "grad_bytes"),
    ("AdamW state", "opt_state_bytes"),
    ("peak gathered", "peak_gathered_bytes"),
    ("peak activations", "peak_activation_bytes"),
    ("total", "total"),
    ("all-gather / step", "all_gather_bytes"),
    ("reduce-scatter / step", "reduce_scatter_bytes"),
]
REMAT_COLUMNS = [("peak activations, remat", "peak_activation_bytes"), ("total, remat", "total")]


def estimates(sizes=SIZES, remat: bool = False, **shard_options) -> list[sf.Estimate]:
    """The GPT's estimates at each size; `remat`: every block under sf.remat (nothing saved)."""
    with torch.device("meta"):
        apply_fn, params = sf.functional(GPT(CONFIG), remat=True if remat else None)
    batch = (((BATCH, SEQ), torch.long), ((BATCH, SEQ), torch.long))  # (idx, targets)
    return [sf.estimate(lambda p, b: apply_fn(p, *b), params, batch, n, optimizer=sf.optim.adamw(3e-4),
                        mixed_precision=sf.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                        **shard_options) for n in sizes]


def markdown_table(results: list[sf.Estimate], remat: list[sf.Estimate]) -> str:
    columns = COLUMNS + REMAT_COLUMNS
    lines = ["| " + " | ".join(name for name, _ in columns) + " |",
             "|" + "|".join("---:" for _ in columns) + "|"]
    for est, rem in zip(results, remat):
        cells = [str(est.mesh_shape["data"])] + [format_bytes(getattr(est, key)) for _, key in COLUMNS[1:]]
        cells += [format_bytes(getattr(rem, key)) for _, key in REMAT_COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def page_table(path: str = PAGE) -> str:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    match = re.search(re.escape(BEGIN) + r"\n(.*?)\n" + re.escape(END), text, re.S)
    if match is None:
        raise ValueError(f"{path} has no table between {BEGIN!r} and {END!r}")
    return match.group(1)


def write(table: str, path: str = PAGE) -> None:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    old = page_table(path)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text.replace(BEGIN + "\n" + old + "\n" + END, BEGIN + "\n" + table + "\n" + END))


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite the table in {os.path.relpath(PAGE)}")
    parser.add_argument("--out", default=os.path.join(RESULTS, "will_it_fit"), help="JSON path, without .json")
    args = parser.parse_args(argv)
    results, remat = estimates(), estimates(remat=True)
    table = markdown_table(results, remat)
    print(table)
    rows = [dict(dataclasses.asdict(est), total=est.total, remat=dict(dataclasses.asdict(rem), total=rem.total))
            for est, rem in zip(results, remat)]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w", encoding="utf-8") as f:
        json.dump({"config": dataclasses.asdict(CONFIG), "batch": [BATCH, SEQ], "results": rows}, f, indent=1)
    if args.write:
        write(table)
    return rows


if __name__ == "__main__":
    main()
