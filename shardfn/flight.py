"""The flight recorder: where did the ranks part ways? (`python -m shardfn.flight DIR`)

Every rank keeps its last collectives in a ring buffer ([Note: flight recorder] in
shardfn/_backend/flight.py). Point the dumps somewhere, before the run or at its start:

    SHARDFN_FLIGHT_DIR=/tmp/fr torchrun --nproc-per-node 4 train.py
    # or, on every rank: shardfn.flight.set_dump_dir("/tmp/fr")

and on a collective timeout, a desync, or `kill -USR1 <pid>`, each rank writes
`rank{R}.json` there. Then

    python -m shardfn.flight /tmp/fr

prints, for each group of ranks whose histories disagree, the first sequence number where
they differ, what each rank issued there (op, shapes, dtype, bytes, step, unit, times) and
which rank is behind.
"""

from __future__ import annotations

import dataclasses
import datetime
import glob
import json
import os
import sys

from ._backend.flight import dump, dump_dir, set_dump_dir, step

__all__ = ["set_dump_dir", "dump_dir", "dump", "step", "load", "analyze", "report", "Finding", "main"]


def load(path: str) -> dict[int, dict]:
    """The dumps in directory `path`: rank -> its document."""
    docs = {}
    for name in glob.glob(os.path.join(path, "rank*.json")):
        with open(name) as f:
            doc = json.load(f)
        docs[int(doc["rank"])] = doc
    return docs


@dataclasses.dataclass
class Finding:
    """One group whose ranks' histories differ."""

    axes: tuple[str, ...]
    ranks: tuple[int, ...]  # the group's members (global ranks)
    seq: int  # the first sequence number (on this group) where the ranks differ
    issued: dict[int, dict | None]  # rank -> its entry at `seq` (None: it issued nothing there)
    last: dict[int, int | None]  # rank -> its last sequence number on this group (None: no dump)
    behind: list[int]  # the ranks that are behind (did not issue, or skipped, a collective)
    why: str  # one line: how `behind` was worked out

    @property
    def kind(self) -> str:
        return "hang" if any(e is None for e in self.issued.values()) else "desync"


def _group_histories(docs: dict[int, dict]):
    """(mesh-ordered axes, sorted member ranks) -> rank -> {seq: entry}."""
    groups: dict = {}
    for rank, doc in docs.items():
        order = list(doc.get("mesh", {}))
        for e in doc["entries"]:
            if e["seq"] is None:
                continue
            axes = tuple(a for a in order if a in e["axes"]) or tuple(e["axes"])
            key = (axes, tuple(sorted(e["ranks"])))
            groups.setdefault(key, {}).setdefault(rank, {})[e["seq"]] = e
    return groups


def _same(a: dict, b: dict) -> bool:
    return a["what"] == b["what"]


def _skipped(mine: dict, others: list[dict], history: dict[int, dict], seq: int) -> bool:
    """Whether `mine` (issued as #seq) is what the others issue one collective later: the
    rank skipped one. Looked up in the others' previous step (same position in the step),
    since a desync stops the others at #seq."""
    ref = others[0]
    if ref.get("step") is None or mine.get("step") is None:
        return False
    prev = sorted((e for e in history.values() if e.get("step") == ref["step"] - 1), key=lambda e: e["seq"])
    now = sorted((e for e in history.values() if e.get("step") == ref["step"] and e["seq"] < seq),
                 key=lambda e: e["seq"])
    pos = len(now)  # ref's position in its step
    return pos + 1 < len(prev) and prev[pos]["what"] == ref["what"] and prev[pos + 1]["what"] == mine["what"]


def analyze(path_or_docs) -> list[Finding]:
    """The groups whose ranks' histories differ, each at its first difference."""
    docs = load(path_or_docs) if isinstance(path_or_docs, (str, os.PathLike)) else path_or_docs
    findings = []
    for (axes, ranks), by_rank in sorted(_group_histories(docs).items()):
        present = [r for r in ranks if r in docs]
        last = {r: (max(by_rank[r]) if by_rank.get(r) else (0 if r in docs else None)) for r in ranks}
        # compare only where every present rank's ring still holds the entries
        start = max((min(by_rank[r]) for r in present if by_rank.get(r)), default=1)
        end = max((last[r] for r in present if last[r]), default=0)
        for seq in range(start, end + 1):
            issued = {r: by_rank.get(r, {}).get(seq) for r in ranks}
            got = [issued[r] for r in present if issued[r] is not None]
            missing = [r for r in present if issued[r] is None]
            if not missing and all(_same(got[0], e) for e in got[1:]):
                continue
            if missing:
                behind = missing
                why = (f"{_ranks(missing)} issued {_count(min(last[r] for r in missing))} on this group, "
                       f"the others issued #{seq}")
            else:
                kinds: dict[str, list[int]] = {}
                for r in present:
                    kinds.setdefault(issued[r]["what"], []).append(r)
                skipped = [r for r in present if _skipped(issued[r], [issued[q] for q in present
                                                                      if issued[q]["what"] != issued[r]["what"]],
                                                          by_rank[r], seq)]
                if skipped:
                    behind = skipped
                    others = next(q for q in present if q not in skipped)
                    why = (f"{_ranks(skipped)} skipped {issued[others]['what']}: as #{seq} it issued the "
                           f"collective the others issued next in their previous step")
                elif len(kinds) > 1 and len(present) > 2 and len(min(kinds.values(), key=len)) < len(present) / 2:
                    behind = sorted(min(kinds.values(), key=len))
                    why = f"{_ranks(behind)} issued something else than the majority"
                else:
                    behind = []
                    why = "the ranks issued different collectives as the same number; none is ahead"
            findings.append(Finding(axes, ranks, seq, issued, last, behind, why))
            break
        else:
            dead = [r for r in ranks if r not in docs]
            if dead and present:  # where the present ranks wait: their first unfinished collective
                waiting = [s for s in range(start, end + 1)
                           if any(by_rank.get(r, {}).get(s, {}).get("t_end", 0) is None for r in present)]
                seq = waiting[0] if waiting else end + 1
                issued = {r: by_rank.get(r, {}).get(seq) for r in ranks}
                findings.append(Finding(axes, ranks, seq, issued, last, dead,
                                        f"{_ranks(dead)} left no dump (dead, dropped, on another host, or not "
                                        f"signalled)"))
    return findings


def _ranks(ranks) -> str:
    ranks = list(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _count(n: int) -> str:
    return f"{n} collective" + ("" if n == 1 else "s")


def _clock(t) -> str:
    return "-" if t is None else datetime.datetime.fromtimestamp(t).strftime("%H:%M:%S.%f")[:-3]


def _entry_line(rank: int, e: dict | None, last: int | None) -> str:
    if last is None:
        return f"  rank {rank}: no dump"
    if e is None:
        return f"  rank {rank}: nothing (its last collective on this group is #{last})"
    where = " ".join(f"{k} {e[k]}" for k in ("step", "unit") if e.get(k) is not None)
    state = f"done {_clock(e['t_end'])}" if e.get("t_end") else "NOT FINISHED"
    size = f" {e['nbytes']} B" if e.get("nbytes") is not None else ""
    return f"  rank {rank}: {e['what']}{size}  [{where or 'no step'}]  issued {_clock(e['t_issue'])}, {state}"


def report(path: str) -> str:
    """The one-screen text `python -m shardfn.flight DIR` prints."""
    docs = load(path)
    if not docs:
        return f"shardfn.flight: no rank*.json dumps in {path}"
    lines = [f"flight recorder dumps in {path}: ranks {sorted(docs)} "
             f"({', '.join(f'{r}: ' + d['reason'] for r, d in sorted(docs.items()))})"]
    findings = analyze(docs)
    if not findings:
        lines.append("every group's ranks issued the same collectives (within the recorded window)")
    for f in findings:
        lines.append(f"group over {f.axes} of ranks {list(f.ranks)}: {f.kind} at collective #{f.seq}")
        lines.extend(_entry_line(r, f.issued.get(r), f.last[r]) for r in f.ranks)
        who = f"{_ranks(f.behind)} {'is' if len(f.behind) == 1 else 'are'} behind" if f.behind else "no rank is behind"
        lines.append(f"  => {who}: {f.why}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m shardfn.flight DIR", file=sys.stderr)
        return 2
    print(report(argv[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
