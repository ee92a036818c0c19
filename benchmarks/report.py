"""docs/benchmarks.md's tables, generated from the benchmarks' JSON in benchmarks/results/.

Every figure on the page sits between a pair of markers and is written here from the
JSON the benchmark scripts wrote (date, machine, load average and command included), so
the page never holds a hand-copied number; tests/test_benchmarks.py checks that the page
holds what this script makes of the JSON committed beside it.

    python -m benchmarks.report            # print the generated sections
    python -m benchmarks.report --write    # put them into docs/benchmarks.md (+ docs/img/fsdp_vs_ddp.png)
    python -m benchmarks.report --check    # exit status 1 when the page is stale
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from benchmarks import _common
from benchmarks.fsdp_vs_ddp import ALL_METHODS, best, ratios

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "benchmarks.md")
IMG = os.path.join(ROOT, "docs", "img", "fsdp_vs_ddp.png")
LOADED = ("fsdp_vs_ddp_load", "fsdp_vs_ddp_load2")  # the --load runs, in order of load
BEGIN = "<!-- begin generated: {} (python -m benchmarks.report --write) -->"
END = "<!-- end generated: {} -->"

NAMES = {"shardfn-foreach": "shardfn foreach", "shardfn-fused": "shardfn fused", "fsdp2-foreach": "FSDP2 foreach",
         "fsdp2-fused": "FSDP2 fused", "ddp": "DDP (fused)", "shardfn-compiled": "shardfn compiled", "shardfn-compiled-step": "shardfn torch.compile(train)",
         "fsdp2-compiled": "FSDP2 compiled",
         "shardfn-jaxloop": "shardfn JAX-style loop", "shardfn-jaxloop-pure": "shardfn JAX-style loop, pure adamw",
         "shardfn-traced": "shardfn sf.jit (traced)",
         "shardfn-wire-bf16": "shardfn bf16 wire", "shardfn-wire-fp8": "shardfn fp8 wire",
         "shardfn-wire-int8": "shardfn int8 wire", "fsdp2-bf16": "FSDP2 bf16 params",
         "shardfn-noreshard": "shardfn fused, no re-gather", "fsdp2-noreshard": "FSDP2 fused, no re-gather",
         "shardfn-traced-noreshard": "shardfn sf.jit, no re-gather"}
# (what, the ratio's key in fsdp_vs_ddp.ratios, at most, the world sizes); on every GPT row
TARGETS = [
    ("shardfn / FSDP2, both foreach AdamW", "foreach: shardfn / fsdp2", 0.85, (2, 4)),
    ("shardfn / FSDP2, both at their best", "best: shardfn / fsdp2", 1.0, (2, 4)),
    ("shardfn (best) / DDP", "best: shardfn / ddp", 1.1, (2,)),
]


def load(name: str, results: str = RESULTS) -> dict | None:
    path = os.path.join(results, name + ".json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def table(head: list[str], rows: list[list[str]], align: str | None = None) -> str:
    align = align or "|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|"
    return "\n".join(["| " + " | ".join(head) + " |", align] + ["| " + " | ".join(r) + " |" for r in rows])


def fmt(x, spec: str = ".3f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def mb(nbytes) -> str:
    return f"{nbytes / 2**20:.1f}"


def run_line(report: dict) -> str:
    """Date, machine, load and the command of a result, from its JSON (older JSON: what it has)."""
    env = report.get("env", {})
    cmd = env.get("command") or report.get("command")
    parts = []
    if "date" in env:
        parts.append(f"Run {env['date']}")
    if "machine" in env:
        parts.append(f"on {env['machine']}")
    torch_v = env.get("torch") or report.get("torch")
    if torch_v:
        parts.append(f"torch {torch_v}")
    if "python" in env:
        parts.append(f"Python {env['python']}")
    line = ", ".join(parts) + "." if parts else "Date and machine not recorded in this JSON."
    if "loadavg_start" in env:
        la = lambda v: "/".join(f"{x:.1f}" for x in v)  # noqa: E731
        line += f" Load average (1/5/15 min) {la(env['loadavg_start'])} at the start"
        line += f", {la(env['loadavg_end'])} at the end." if "loadavg_end" in env else "."
    elif "loadavg_1m_at_end" in env:
        line += f" Load average {env['loadavg_1m_at_end']:.1f} at the end."
    if cmd:
        line += f" Command: `{cmd}`."
    return line


# -- fsdp_vs_ddp ----------------------------------------------------------------------------


def _methods(rows: list[dict]) -> list[str]:
    return [m for m in ALL_METHODS if any(m in r["step_s"] or m in r["unsupported"] for r in rows)]


def step_time_table(report: dict) -> str:
    rows = [r for r in report["results"] if r["world"] > 1]
    methods = _methods(rows)
    body = []
    for r in rows:
        cells = [fmt(r["step_s"].get(m)) if m in r["step_s"] else "unsupported" for m in methods]
        dloss = max(r["max_loss_diff_vs_ddp"].values(), default=None)
        other = fmt(r["machine_use"]["other_work_cores"], ".2f") if "machine_use" in r else "-"
        body.append([r["label"], str(r["world"])] + cells + [fmt(dloss, ".1e"), other])
    cfg = report["config"]
    steps = sorted({(r["label"], r["steps_per_block"]) for r in report["results"]}, key=lambda x: x[0])
    note = (f"Median over {cfg['reps']} interleaved repetitions of the slowest rank's mean step time, in seconds "
            f"(steps per timed block: " + ", ".join(f"{label} {s}" for label, s in steps) + f"; "
            f"{cfg['warmup']} warm-up steps). dloss: the largest |loss - DDP's loss| of any method over "
            f"the first {cfg['parity_steps']} steps from the same initial weights. Other work: how many of the "
            f"machine's cores other processes kept busy on average during the row's run (/proc/stat's busy time "
            f"less the benchmark's own processes'; a `--load` counts as other work).")
    return run_line(report) + "\n\n" + note + "\n\n" + table(
        ["model", "N"] + [NAMES[m] + " s" for m in methods] + ["max dloss vs DDP", "other work, cores"], body)


def ratio_table(report: dict) -> str:
    rows = [r for r in report["results"] if r["world"] > 1]
    keys = [k for k in ratios(rows[0]) if any(ratios(r)[k] is not None for r in rows)]
    body = []
    for r in rows:
        rs = ratios(r)
        sb, fb = best(r, "shardfn"), best(r, "fsdp2")
        body.append([r["label"], str(r["world"])] + [fmt(rs[k]) for k in keys]
                    + [f"{NAMES[sb[0]]} / {NAMES[fb[0]]}" if sb and fb else "-"])
    return table(["model", "N"] + keys + ["best = (shardfn / FSDP2)"], body,
                 "|---|---:|" + "---:|" * len(keys) + "---|")


def target_rows(report: dict) -> list[tuple]:
    """(what, model, N, ratio, at most, met) for every target on every GPT row."""
    out = []
    for what, key, limit, worlds in TARGETS:
        for r in report["results"]:
            if r["model"].startswith("gpt") and r["world"] in worlds:
                value = ratios(r)[key]
                out.append((what, r["label"], r["world"], value, limit, value is not None and value <= limit))
    return out


def targets_table(report: dict) -> str:
    rows = target_rows(report)
    body = [[what, label, str(n), fmt(v), f"<= {limit:g}", "**met**" if ok else "not met"]
            for what, label, n, v, limit, ok in rows]
    lines = []
    for what, _, limit, worlds in TARGETS:
        mine = [r for r in rows if r[0] == what]
        hit = [f"{label} N={n}" for _, label, n, _, _, ok in mine if ok]
        lines.append(f"- {what} <= {limit:g}: met on {len(hit)} of {len(mine)} rows"
                     + (f" ({', '.join(hit)})." if hit else "."))
    summary = "\n".join(lines)
    return table(["target", "model", "N", "ratio", "target", "status"], body,
                 "|---|---|---:|---:|---:|---|") + "\n\n" + summary


def scaling_table(report: dict) -> str:
    by = {(r["model"], r["world"]): r for r in report["results"]}
    models = list(dict.fromkeys(r["model"] for r in report["results"]))
    worlds = sorted({r["world"] for r in report["results"]})
    body = []
    for model in models:
        for family in ("shardfn", "fsdp2", "ddp"):
            rate, names = {}, []
            for n in worlds:
                r = by.get((model, n))
                if r is None:
                    continue
                pick = ("ddp", r["step_s"]["ddp"]) if family == "ddp" and "ddp" in r["step_s"] else best(r, family)
                if pick is None:
                    continue
                rate[n] = r["items_per_step_per_rank"] / pick[1]
                names.append(pick[0])
            if not rate:
                continue
            r0 = next(r for r in report["results"] if r["model"] == model)
            base = rate.get(1)
            cells = [fmt(rate.get(n), ",.0f") for n in worlds]
            cells += [fmt(rate[n] / base if base and n in rate else None, ".2f") for n in worlds if n > 1]
            variants = ", ".join(dict.fromkeys(NAMES[m] for m in names))
            body.append([r0["label"], variants, r0["unit"]] + cells)
    head = (["model", "method (fastest variant at each N)", "per rank"] + [f"N={n} /s" for n in worlds]
            + [f"efficiency N={n}" for n in worlds if n > 1])
    return table(head, body, "|---|---|---|" + "---:|" * (len(head) - 3))


def cpu_table(report: dict, world: int = 2) -> str:
    body = []
    for r in report["results"]:
        if r["world"] != world:
            continue
        for m, c in r["cpu_per_step"].items():
            body.append([r["label"], NAMES[m], fmt(c["wall_s"]), fmt(c["main_cpu_s"]), fmt(c["other_threads_cpu_s"]),
                         fmt(c["main_blocked_s"]), fmt(c["main_runqueue_s"]), fmt(c.get("main_sleeps"), ".0f"),
                         fmt(c.get("main_preemptions"), ".0f"), fmt(c.get("minor_page_faults"), ",.0f")])
    return table(["model", "method", "wall s", "main thread CPU s", "other threads CPU s", "main blocked s",
                  "main waiting for a core s", "main sleeps", "main preemptions", "page faults"], body,
                 "|---|---|" + "---:|" * 8)


def profile_table(report: dict, world: int = 2) -> str:
    body = []
    for r in report["results"]:
        if r["world"] != world or "profile" not in r:
            continue
        for m, p in r["profile"].items():
            s = _common.shares(p)
            pct = lambda x: f"{x:.0f} ({100 * x / p['wall_ms']:.0f}%)"  # noqa: E731
            body.append([r["label"], NAMES[m], f"{p['wall_ms']:.0f}", pct(s["compute"]), pct(s["copies"]),
                         pct(s["python_other"]), pct(s["collective_wait"]), pct(s["runqueue"]),
                         f"{p['other_threads_cpu_ms']:.0f}"])
    if not body:
        return "(no profile in this run: `--profile`)"
    return table(["model", "method", "step ms", "compute ms", "copies ms", "Python & other ms",
                  "waiting on collectives ms", "waiting for a core ms", "other threads CPU ms"], body,
                 "|---|---|" + "---:|" * 7)


def memory_table(report: dict) -> str:
    body = []
    for r in report["results"]:
        if r["world"] == 1:
            continue
        sb = r["state_bytes_per_rank"]
        full = sb.get("ddp")
        body.append([r["label"], str(r["world"]), mb(sb["shardfn-fused"]) if "shardfn-fused" in sb else "-",
                     mb(sb["fsdp2-fused"]) if "fsdp2-fused" in sb else "-", mb(full) if full else "-",
                     mb(full / r["world"]) if full else "-"])
    return table(["model", "N", "shardfn MB", "FSDP2 MB", "DDP MB", "DDP / N MB"], body)


def comm_table(report: dict) -> str:
    body = [[r["label"], str(r["world"]), mb(r["comm_bytes_per_rank"]), mb(r["comm_theory_bytes_per_rank"]),
             fmt(r["comm_bytes_per_rank"] / r["comm_theory_bytes_per_rank"])]
            for r in report["results"] if r["world"] > 1 and "comm_bytes_per_rank" in r]
    return table(["model", "N", "shardfn MB / step", "ZeRO-3 3Ψ(N-1)/N MB", "ratio"], body)


def wire_bytes_table(report: dict) -> str:
    """Bytes one step moved per rank, by shardfn method (`stats()`, encoded bytes where
    compressed), against shardfn fp32's."""
    body = []
    for r in report["results"]:
        by = r.get("stats_by_method") or {}
        base = by.get("shardfn-fused")
        for m, st in by.items():
            rel = (f"{st['all_gather_bytes'] / base['all_gather_bytes']:.3f} / "
                   f"{st['reduce_scatter_bytes'] / base['reduce_scatter_bytes']:.3f}") if base else "-"
            body.append([r["label"], str(r["world"]), NAMES.get(m, m), mb(st["all_gather_bytes"]),
                         mb(st["reduce_scatter_bytes"]), rel])
    return table(["model", "N", "method", "all-gather MB", "reduce-scatter MB", "vs fp32 (ag / rs)"], body)


def census_table(census: dict) -> str:
    body = []
    for m, c in census["methods"].items():
        if "unsupported" in c:
            body.append([NAMES[m], "unsupported", "", "", ""])
            continue
        names = ", ".join(f"{k} x{v}" for k, v in c["threads_after"].items())
        cps = c["cpu_per_step"]
        body.append([NAMES[m], f"{c['count_before']} -> {c['count_after']}", names, fmt(cps["main_cpu_s"]),
                     fmt(cps["other_threads_cpu_s"])])
    return (f"Each method alone in fresh processes ({census['model']}, N = {census['world']}): threads per process "
            f"after `init_mesh` -> after two steps, and CPU seconds per step.\n\n"
            + table(["method", "threads", "threads by name (after)", "main thread CPU s", "other threads CPU s"],
                    body, "|---|---:|---|---:|---:|"))


def load_table(quiet: dict, loaded: list[dict]) -> str:
    """The quiet run's rows beside the same rows under each `--load K` run."""
    q = {(r["model"], r["world"]): r for r in quiet["results"]}
    runs = [(str(rep["config"]["load_processes"]), r) for rep in loaded for r in rep["results"]]
    body = []
    for key in dict.fromkeys((r["model"], r["world"]) for _, r in runs):
        for tag, row in [("no", q.get(key))] + [(k, r) for k, r in runs if (r["model"], r["world"]) == key]:
            if row is None:
                continue
            rs = ratios(row)
            t = row["step_s"]
            other = fmt(row["machine_use"]["other_work_cores"], ".2f") if "machine_use" in row else "-"
            body.append([row["label"], str(row["world"]), tag, other, fmt(t.get("shardfn-foreach")),
                         fmt(t.get("fsdp2-foreach")), fmt(t.get("ddp")), fmt(rs["foreach: shardfn / fsdp2"]),
                         fmt(rs["fused: shardfn / fsdp2"]), fmt(rs["best: shardfn / ddp"])])
    return "\n".join(run_line(rep) for rep in loaded) + "\n\n" + table(
        ["model", "N", "busy-loop processes", "other work, cores", "shardfn foreach s", "FSDP2 foreach s", "DDP s",
         "foreach: shardfn / FSDP2", "fused: shardfn / FSDP2", "best: shardfn / DDP"], body,
        "|---|---:|---:|" + "---:|" * 7)


def load_cpu_table(loaded: list[dict]) -> str:
    return "\n\n".join(f"{rep['config']['load_processes']} busy-loop process(es):\n\n"
                       + cpu_table(rep, world=rep["results"][0]["world"]) for rep in loaded)


# -- the other benchmarks -------------------------------------------------------------------


def fsdp_tp_table(report: dict) -> str:
    r = report["result"]
    t, sb = r["median_step_s"], r["state_bytes_per_rank"]
    return run_line(report) + "\n\n" + table(
        ["mesh", "parameters", "shardfn s", "torch FSDP2 + TP s", "shardfn / torch", "state per rank MB (shardfn / torch)",
         "unsharded state MB", "max dloss (3 steps)"],
        [[str(r["mesh"]), f"{r['parameters']:,}", fmt(t["shardfn"]), fmt(t["torch"]), fmt(r["ratio_vs_torch"]),
          f"{mb(sb['shardfn'])} / {mb(sb['torch'])}", mb(r["unsharded_state_bytes"]), fmt(r["max_loss_diff"], ".1e")]])


def memory_scaling_table(report: dict) -> str:
    body = [[str(r["world"]), f"{r['state_bytes'] / 2**20:.2f}", f"{r['formula_bytes'] / 2**20:.2f}",
             fmt(r["state_over_formula"]), f"{r['peak_gathered'] / 2**20:.2f}", f"{r['peak_gathered_units']:.2f}"]
            for r in report["results"]]
    return run_line(report) + "\n\n" + table(
        ["N", "state MB", "16·Ψ/N MB", "ratio", "peak gathered MB", "in hidden-layer units"], body)


def optim_table(report: dict) -> str:
    body = []
    for res in report["results"]:
        for row in res["rows"]:
            body.append([res["model"], f"{res['shard_numel']:,}", str(res["num_leaves"]), row["mode"],
                         fmt(row["median_ms"], ".2f"), fmt(row["ratio_vs_torch_foreach"], ".2f"),
                         fmt(row["ratio_vs_torch_fused"], ".2f")])
    return run_line(report) + "\n\n" + table(
        ["model", "shard params", "leaves", "mode", "median ms", "/ torch foreach", "/ torch fused"], body,
        "|---|---:|---:|---|---:|---:|---:|")


def muon_table(report: dict) -> str:
    """benchmarks/muon_vs_adamw.py: time per step of the two recipes and the owner rule's bytes."""
    cfg, med, times = report["config"], report["median_ms"], report["times_ms"]
    how = "threads (simulated mesh)" if cfg["simulated"] else "processes (gloo)"
    rows = [[name, fmt(med[key], ".1f"), fmt(min(times[key]), ".1f"), fmt(med[key] / med["adamw"], ".2f")]
            for key, name in (("adamw", "AdamW"), ("muon", "Muon + AdamW"))]
    owners = [[str(rank), f"{g:,}", f"{s_:,}", str(n)] for rank, g, s_, n in report["owner_bytes"]]
    return (run_line(report) + f"\n\nGPT {cfg['n_layer']}L d{cfg['n_embd']} (T = {cfg['block_size']}, batch "
            f"{cfg['batch']} per rank), {cfg['ranks']} {how}, `sf.train_step`, median of {cfg['reps']} "
            f"interleaved steps on rank 0:\n\n"
            + table(["optimizer", "median ms / step", "min ms", "/ AdamW"], rows)
            + "\n\nThe owner rule per step (bf16 on the wire), from `update.stats()`:\n\n"
            + table(["rank", "gather bytes", "scatter bytes", "matrices owned"], owners))


def gloo_wait_table(report: dict) -> str:
    cfg = report["config"]
    body = []
    for r in report["results"]:
        for m, d in r["per_iteration"].items():
            body.append([str(r["load_processes"]), m, f"{d['wall_s'] * 1e3:.2f}", f"{d['main_cpu_s'] * 1e3:.2f}",
                         f"{d['main_blocked_s'] * 1e3:.2f}", f"{d['main_runqueue_s'] * 1e3:.2f}",
                         f"{d['main_sleeps']:.1f}", fmt(d.get("timed_out_slices"), ".1f", ""),
                         fmt(r["polled_over_plain"]) if m == "polled" else ""])
    return (run_line(report) + f"\n\nPer iteration (one async all-gather of {cfg['numel'] * 4 / 2**20:.0f} MB per rank, "
            f"{cfg['matmuls']} matmuls, then the wait; poll slice {cfg['poll_ms']:g} ms), median of {cfg['reps']} "
            f"repetitions of {cfg['iters']} iterations, mean over the 2 ranks:\n\n" + table(
                ["busy-loop processes", "wait", "wall ms", "main CPU ms", "blocked ms", "waiting for a core ms",
                 "sleeps", "timed-out slices", "polled / plain"], body, "|---:|---|---:|---:|---:|---:|---:|---:|---:|"))


def context_parallel_section(report: dict) -> str:
    from benchmarks.context_parallel import markdown_table

    shape = report["results"][0]["shape"] if report["results"] else {}
    return (run_line(report) + f"\n\nOne causal attention layer, forward + backward, fp32, B = {shape.get('batch')}, "
            f"H = {shape.get('heads')}, D = {shape.get('head_dim')}, zig-zag layout; median of "
            f"{report['config']['reps']} interleaved repetitions of the slowest rank's step:\n\n"
            + markdown_table(report["results"]))


def simulated_line(report: dict) -> str:
    return (run_line(report) + f"\n\nN = {report['world']}: simulated mesh {report['simulated_s']:.3f} s/step, "
            f"{report['world']} processes {report['multiprocess_s']:.3f} s/step: the threads-in-one-process mesh costs "
            f"{report['ratio']:.2f}x.")


# -- the page -------------------------------------------------------------------------------


def sections(results: str = RESULTS) -> dict[str, str]:
    """Every generated section of the page, by name, from the JSON in `results`."""
    out = {}
    main = load("fsdp_vs_ddp", results)
    if main is not None:
        out["step-time"] = step_time_table(main)
        out["ratios"] = ratio_table(main)
        out["targets"] = targets_table(main)
        out["scaling"] = scaling_table(main)
        out["cpu"] = cpu_table(main)
        out["profile"] = profile_table(main)
        out["memory"] = memory_table(main)
        out["communication"] = comm_table(main)
        if "thread_census" in main:
            out["threads"] = census_table(main["thread_census"])
        loaded = [rep for rep in (load(name, results) for name in LOADED) if rep is not None]
        if loaded:
            out["load"] = load_table(main, loaded)
            out["load-cpu"] = load_cpu_table(loaded)
    compiled = load("fsdp_vs_ddp_compile", results)
    if compiled is not None:
        out["compile"] = step_time_table(compiled) + "\n\n" + ratio_table(compiled)
    compressed = load("fsdp_vs_ddp_compressed", results)
    if compressed is not None:
        out["compressed"] = (step_time_table(compressed) + "\n\n" + ratio_table(compressed) + "\n\n"
                             + wire_bytes_table(compressed))
    traced = load("fsdp_vs_ddp_traced", results)
    if traced is not None:
        out["traced"] = step_time_table(traced) + "\n\n" + ratio_table(traced)
    loops = load("fsdp_vs_ddp_loops", results)
    if loops is not None:
        out["loops"] = (step_time_table(loops) + "\n\n" + ratio_table(loops) + "\n\n"
                        + "\n\n".join(cpu_table(loops, world) for world in (2, 4)))
    exchange = load("fsdp_vs_ddp_exchange", results)
    if exchange is not None:
        out["exchange"] = step_time_table(exchange) + "\n\n" + ratio_table(exchange) + "\n\n" + cpu_table(exchange, 2)
    traced_nr = load("fsdp_vs_ddp_traced_noreshard", results)
    if traced_nr is not None:
        out["traced-noreshard"] = (step_time_table(traced_nr) + "\n\n" + ratio_table(traced_nr) + "\n\n"
                                   + cpu_table(traced_nr, 2))
    piped = load("pipeline", results)
    if piped is not None:
        from benchmarks.pipeline import render

        out["pipeline"] = run_line(piped) + "\n\n" + render(piped)
    for name, fn in (("gloo_wait", gloo_wait_table), ("fsdp_tp_vs_torch", fsdp_tp_table), ("memory_scaling", memory_scaling_table),
                     ("optim_update", optim_table), ("muon_vs_adamw", muon_table), ("simulated_overhead", simulated_line),
                     ("context_parallel", context_parallel_section)):
        report = load(name, results)
        if report is not None:
            out[name] = fn(report)
    return out


def page_sections(path: str = PAGE) -> dict[str, str]:
    """The generated sections the page holds now, by name."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    pattern = re.escape(BEGIN.format("@")).replace("@", r"(?P<name>[\w-]+)") + r"\n(?P<body>.*?)\n" + \
        re.escape(END.format("@")).replace("@", r"(?P=name)")
    return {m.group("name"): m.group("body") for m in re.finditer(pattern, text, re.S)}


def write(path: str = PAGE, results: str = RESULTS) -> list[str]:
    """Rewrite the page's generated sections; return the names of sections the page has
    no markers for (they are printed, not placed)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    missing = []
    for name, body in sections(results).items():
        begin, end = BEGIN.format(name), END.format(name)
        if begin not in text:
            missing.append(name)
            continue
        start = text.index(begin) + len(begin)
        text = text[:start] + "\n" + body + "\n" + text[text.index(end, start):]
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return missing


def plot(report: dict, path: str) -> bool:
    """Step time of every method relative to FSDP2 foreach, per model and N (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in report["results"] if r["world"] > 1]
    methods = [m for m in _methods(rows) if any(m in r["step_s"] for r in rows)]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / len(methods)
    for j, m in enumerate(methods):
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(rows))]
        ax.bar(xs, [r["step_s"][m] / r["step_s"]["fsdp2-foreach"] if m in r["step_s"] else 0 for r in rows],
               width, label=NAMES[m])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)), [f"{r['label']}\nN={r['world']}" for r in rows], fontsize=8)
    ax.set_ylabel("step time / FSDP2 foreach")
    ax.set_title(f"shardfn vs FSDP2 vs DDP (gloo, 1 thread per rank, {report['env']['date']})", fontsize=9)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help=f"rewrite {os.path.relpath(PAGE, ROOT)}'s tables")
    parser.add_argument("--check", action="store_true", help="exit 1 if the page differs from the JSON")
    args = parser.parse_args(argv)
    made = sections()
    if args.check:
        stale = [n for n, body in made.items() if page_sections().get(n) != body]
        print("stale sections: " + ", ".join(stale) if stale else "docs/benchmarks.md is up to date")
        return 1 if stale else 0
    if args.write:
        missing = write()
        if missing:
            print(f"no markers for {missing} on the page; add {BEGIN.format('NAME')} ... {END.format('NAME')}",
                  file=sys.stderr)
        main_report = load("fsdp_vs_ddp")
        if main_report is not None and plot(main_report, IMG):
            print(f"wrote {os.path.relpath(IMG, ROOT)}")
        print(f"wrote {os.path.relpath(PAGE, ROOT)}")
        return 0
    for name, body in made.items():
        print(f"## {name}\n\n{body}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
