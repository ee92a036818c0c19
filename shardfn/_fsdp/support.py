"""What works with what: one table of `shard`'s options x its entry points.

[Note: the composition table]
Every option of `shard` either works under an entry point, equal to its reference, or is
refused there before anything runs, by an error that gives the table's reason and
fallback. The table below is the one place that says which: the entry points ask it
(`check(entry, step, plan)`: `sf.jit`, `sf.estimate`, `vmap` over the batch), the docs
page docs/composition.md is generated from it (`python -m shardfn._fsdp.support`), and
the matrix tests (tests/fsdp/test_composition.py) run every cell: a supported cell against its
reference, a refused one for this message. A cell left out of `REFUSED` is supported, so
a new option is supported everywhere until someone writes the refusal and its reason;
the matrix then fails on any cell that is neither right nor refused.

An option is a predicate of the step's `Config` and `Plan` (`OPTIONS`): the checks see
what the step was built with, not what the user meant, so an option turned on through
another door (a frozen leaf given by `frozen=`, TP by `param_specs`) is found alike.
`remat` is not a `shard` argument but a call inside `loss_fn`; it is found when the loss
runs (sf.remat asks `refused_here`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .._errors import SpecError, bullet_list

__all__ = ["ENTRIES", "OPTIONS", "REFUSED", "Refusal", "active_options", "check", "refusal", "cell", "markdown"]


class Entry(NamedTuple):
    key: str
    label: str  # as the docs and errors name it


class Option(NamedTuple):
    key: str
    label: str  # how a user turns it on
    active: Callable  # (config, plan | None) -> bool


class Refusal(NamedTuple):
    reason: str
    fallback: str


ENTRIES = (
    Entry("call", "step(shards, batch)"),
    Entry("train_step", "sf.train_step(step, opt)"),
    Entry("grad_and_value", "step.grad_and_value"),
    Entry("func_grad", "torch.func.grad / grad_and_value of the step"),
    Entry("backward", "loss.backward()"),
    Entry("jvp", "torch.func.jvp(step) (forward mode)"),
    Entry("hvp", "jvp(grad(step)) (Hessian-vector product)"),
    Entry("hvp_rev", "grad(<grad(step), v>) (reverse over reverse)"),
    Entry("vmap", "vmap(grad(step), in_dims=(None, 0))"),
    Entry("accumulate", "step.accumulate (both modes)"),
    Entry("jit", "sf.jit(step, opt)"),
    Entry("estimate", "sf.estimate"),
)


def _mp(config, field: str):
    return getattr(config.mixed_precision, field, None) if config.mixed_precision is not None else None


def _wire_kinds(config) -> set[str]:
    """The kinds of the step's wire formats ("int8", "fp8", "cast")."""
    mp = config.mixed_precision
    return set() if mp is None else {w.kind for w in mp.wires() if w is not None}


def _low_precision(config) -> bool:
    dtype = _mp(config, "param_dtype")
    return dtype is not None and dtype.itemsize < 4


OPTIONS = (
    Option("none", "(defaults)", lambda c, p: False),
    Option("low_precision", "MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)",
           lambda c, p: _low_precision(c)),
    Option("wire_int8", "MixedPrecision(all_gather_dtype='int8', reduce_scatter_dtype='int8')",
           lambda c, p: "int8" in _wire_kinds(c)),
    Option("wire_fp8", "MixedPrecision(all_gather_dtype=torch.float8_e4m3fn)",
           lambda c, p: "fp8" in _wire_kinds(c)),
    Option("wire_cast", "MixedPrecision(all_gather_dtype=torch.bfloat16)",
           lambda c, p: "cast" in _wire_kinds(c)),
    Option("hsdp", "shard_axes within data_axes (HSDP)", lambda c, p: c.shard_axes != c.data_axes),
    Option("hpz", "reshard_after_forward=<inner shard axes> (hpZ)", lambda c, p: bool(c.reshard_axes)),
    Option("frozen", "frozen=<key path -> bool>", lambda c, p: c.frozen is not None),
    Option("tp", "param_specs=... (FSDP x TP)",
           lambda c, p: (bool(p.tp_axes) if p is not None else c.param_specs is not None)),
    Option("check_finite", "check_finite=True", lambda c, p: c.check_finite),
    Option("global_mean", "batch_weighting='global_mean'", lambda c, p: c.batch_weighting == "global_mean"),
    Option("prefetch", "prefetch=2", lambda c, p: c.prefetch > 1),
    Option("no_reshard", "reshard_after_forward=False", lambda c, p: not c.reshard_after_forward),
    Option("remat", "sf.remat(block) inside loss_fn", lambda c, p: False),  # found at run time
)

_EAGER = "train eagerly with sf.train_step(step, opt), which supports it"

REFUSED: dict[tuple[str, str], Refusal] = {
    ("vmap", "global_mean"): Refusal(
        "vmap over the batch hides each rank's batch size (the leading dim is the vmapped one), so the ranks' "
        "losses cannot be weighted by it",
        "use batch_weighting='equal' (every rank the same number of examples) for per-example gradients"),
}


def _label(table, key: str) -> str:
    return next(item.label for item in table if item.key == key)


def cell(entry: str, option: str) -> Refusal | None:
    """The table's cell: None (supported) or the Refusal."""
    if entry not in {e.key for e in ENTRIES} or option not in {o.key for o in OPTIONS}:
        raise KeyError(f"no cell ({entry!r}, {option!r}) in the composition table")
    return REFUSED.get((entry, option))


def active_options(config, plan=None) -> list[str]:
    """The keys of the options a step was built with."""
    return [o.key for o in OPTIONS if o.active(config, plan)]


def refusal(entry: str, options) -> SpecError | None:
    """The error for `options` under `entry` (None when every one is supported): one line
    per refused option, each with its reason, then the fallbacks."""
    refused = [(o, REFUSED[(entry, o)]) for o in options if (entry, o) in REFUSED]
    if not refused:
        return None
    where = _label(ENTRIES, entry)
    lines = [f"{_label(OPTIONS, o)}: {r.reason}" for o, r in refused]
    fixes = list(dict.fromkeys(r.fallback for _, r in refused))
    head = (f"{where} does not support {_label(OPTIONS, refused[0][0])}: {refused[0][1].reason}."
            if len(refused) == 1 else f"{where} does not support these options of the step:\n{bullet_list(lines)}")
    return SpecError(f"{head}\nFix: drop the option, or {'; or '.join(fixes)}. "
                     f"(docs/composition.md: what works with what)")


def check(entry: str, step, plan=None) -> None:
    """Raise the table's SpecError if `step` uses an option `entry` refuses."""
    error = refusal(entry, active_options(step.config, plan))
    if error is not None:
        raise error


def refused_here(entry: str, option: str) -> None:
    """Raise the table's SpecError for one option found at run time (e.g. sf.remat)."""
    error = refusal(entry, [option])
    if error is not None:
        raise error


def markdown() -> str:
    """The table as the docs page shows it: options down, entry points across; a refused
    cell is a number into the list of reasons below."""
    head = "| option | " + " | ".join(f"`{e.label}`" for e in ENTRIES) + " |"
    rows = [head, "|---|" + "---|" * len(ENTRIES)]
    notes: list[str] = []
    for option in OPTIONS:
        cells = []
        for entry in ENTRIES:
            r = REFUSED.get((entry.key, option.key))
            if r is None:
                cells.append("yes")
            else:
                notes.append(f"{len(notes) + 1}. `{entry.label}` with `{option.label}`: refused — {r.reason}. "
                             f"Fix: {r.fallback}.")
                cells.append(f"no ({len(notes)})")
        rows.append(f"| `{option.label}` | " + " | ".join(cells) + " |")
    total = len(OPTIONS) * len(ENTRIES)
    counts = f"{total - len(REFUSED)} of {total} cells supported, {len(REFUSED)} refused with a reason and a fix."
    return "\n".join(rows) + "\n\n" + counts + "\n\n" + "\n".join(notes) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
