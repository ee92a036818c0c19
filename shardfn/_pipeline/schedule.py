"""Pipeline schedules as data: per-rank lists of F / B / W actions, their timeline, bubble
and an ASCII drawing.

[Note: schedules as data] A schedule is, for every rank of the pipeline axis, the order in
which it runs its actions: `F(mb, c)` (forward of microbatch `mb` through chunk `c`),
`B(mb, c)` (backward: the input gradient, and with it the weight gradient unless the
schedule splits them) and `W(mb, c)` (the deferred weight gradient of a split backward,
zero-bubble style). Chunk `c` (of `stages * virtual_stages`) lives on rank `c % stages`
(Megatron's interleaving). Sends and receives are implied: `F(mb, c)` sends its output to
the rank of chunk `c + 1`, `B(mb, c)` sends the input gradient to the rank of chunk
`c - 1`. Time is counted in slots: F, W and a split B take one, an unsplit B two (the
usual "backward costs twice the forward"). `timeline()` starts every action as soon as
its rank is free and its inputs have arrived; idle slots over the step's slots is the
bubble the executor's lock-step run reproduces exactly.

The four built-in schedules come from one greedy list scheduler that differs only in its
policy (which ready action a free rank picks, and how many microbatches it may hold):
GPipe (all forwards first), 1F1B (at most `stages - rank` microbatches in flight, a ready
backward first), interleaved 1F1B (Megatron's warm-up depth and priorities over virtual
stages; when `M` is a multiple of `p`, Megatron-LM's exact order instead, whose bubble is
the textbook (p-1)/(M*V+p-1)) and ZB-H1 (1F1B's memory bound, backward split into B and W, W deferred into the
slots where the rank would otherwise wait).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from .._errors import ShardingError

__all__ = ["Action", "Schedule", "make_schedule", "SCHEDULES"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


class Action(NamedTuple):
    """One step of a rank's schedule."""

    kind: str  # "F" forward, "B" backward (input grad; + weight grad unless split), "W" weight grad
    microbatch: int
    chunk: int  # global chunk index, 0 .. stages * virtual_stages - 1

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


class Slot(NamedTuple):
    start: int
    end: int
    action: Action


class Schedule:
    """The per-rank action lists of a pipeline step.

    Args:
      name: a label ("1f1b", or your own).
      stages: ranks on the pipeline axis, `p`.
      microbatches: `M`.
      actions: per rank, the ordered actions it runs.
      virtual_stages: chunks per rank, `V` (chunk `c` on rank `c % p`).
      split_backward: B computes the input gradient only and W the weight gradient.

    Raises:
      ShardingError: the lists miss or repeat an action, put one on the wrong rank, or
        deadlock (a rank waits for an action ordered after its own wait).
    """

    def __init__(self, name: str, stages: int, microbatches: int, actions: Sequence[Sequence[Action]],
                 virtual_stages: int = 1, split_backward: bool = False):
        self.name, self.stages, self.microbatches = name, stages, microbatches
        self.virtual_stages, self.split_backward = virtual_stages, split_backward
        self.actions = tuple(tuple(Action(*a) for a in rank) for rank in actions)
        self._validate()
        self._slots = _timeline(self)

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual_stages

    def rank_of(self, chunk: int) -> int:
        return chunk % self.stages

    def duration(self, action: Action) -> int:
        return 2 if action.kind == "B" and not self.split_backward else 1

    def _validate(self) -> None:
        p, M, C = self.stages, self.microbatches, self.chunks
        if len(self.actions) != p:
            raise ShardingError(f"Schedule {self.name!r}: {len(self.actions)} action lists for {p} stages.\n"
                                f"Fix: give one list per rank of the pipeline axis.")
        kinds = ("F", "B", "W") if self.split_backward else ("F", "B")
        want = {Action(k, mb, c) for k in kinds for mb in range(M) for c in range(C)}
        seen: set = set()
        for r, acts in enumerate(self.actions):
            for a in acts:
                if a not in want or a in seen or self.rank_of(a.chunk) != r:
                    why = ("repeated" if a in seen else "not an action of this schedule" if a not in want
                           else f"chunk {a.chunk} lives on rank {self.rank_of(a.chunk)}")
                    raise ShardingError(f"Schedule {self.name!r}: rank {r} lists {a!r}: {why}.\nFix: each of "
                                        f"F/B{'/W' if self.split_backward else ''}(mb, chunk) exactly once, "
                                        f"on rank chunk % {p}.")
                seen.add(a)
        missing = sorted(want - seen)
        if missing:
            raise ShardingError(f"Schedule {self.name!r}: no rank runs {missing[:4]}"
                                f"{' ...' if len(missing) > 4 else ''}.\nFix: list every action once.")

    def deps(self, a: Action) -> list[Action]:
        """The actions whose results `a` needs (on this or another rank)."""
        last = self.chunks - 1
        if a.kind == "F":
            return [Action("F", a.microbatch, a.chunk - 1)] if a.chunk > 0 else []
        if a.kind == "B":
            out = [Action("F", a.microbatch, a.chunk)]
            return out + ([Action("B", a.microbatch, a.chunk + 1)] if a.chunk < last else [])
        return [Action("B", a.microbatch, a.chunk)]

    def timeline(self) -> list[list[Slot]]:
        """Per rank, its actions with start and end slots (as soon as possible in list order)."""
        return self._slots

    @property
    def total_slots(self) -> int:
        return max(s.end for rank in self._slots for s in rank)

    def bubble(self) -> list[float]:
        """Per rank: idle slots / the step's slots."""
        total = self.total_slots
        return [1 - sum(s.end - s.start for s in rank) / total for rank in self._slots]

    def theory_bubble(self) -> float:
        """The textbook bubble fraction for this kind of schedule (F = W = 1, B = 2 slots)."""
        p, M, V = self.stages, self.microbatches, self.virtual_stages
        if self.split_backward:
            return (p - 1) / (3 * M * V + p - 1)
        return (p - 1) / (M * V + p - 1)

    def peak_in_flight(self) -> list[int]:
        """Per rank: the most microbatch-chunks whose activations are held at once (an F
        holds them until its B, or its W when the backward is split)."""
        out = []
        for rank in self.actions:
            held = peak = 0
            for a in rank:
                held += 1 if a.kind == "F" else -1 if a.kind == ("W" if self.split_backward else "B") else 0
                peak = max(peak, held)
            out.append(peak)
        return out

    def transfers(self) -> list[tuple[str, int, int, int, int]]:
        """Every activation ("act") and activation-gradient ("grad") transfer:
        (kind, microbatch, from chunk, from rank, to rank)."""
        out = []
        for rank in self.actions:
            for a in rank:
                if a.kind == "F" and a.chunk < self.chunks - 1:
                    out.append(("act", a.microbatch, a.chunk, self.rank_of(a.chunk), self.rank_of(a.chunk + 1)))
                elif a.kind == "B" and a.chunk > 0:
                    out.append(("grad", a.microbatch, a.chunk, self.rank_of(a.chunk), self.rank_of(a.chunk - 1)))
        return out

    def draw(self, width: int = 3) -> str:
        """An ASCII chart: one row per rank, one column per slot, `.` for idle.

        Example (1F1B, 2 stages, 3 microbatches)::

            rank 0 |F0 F1 .  B0 B0 F2 B1 B1 .  B2 B2|
            rank 1 |.  F0 B0 B0 F1 B1 B1 F2 B2 B2 . |
        """
        total = self.total_slots
        rows = [f"{self.name}: {self.stages} stages x {self.virtual_stages} virtual, {self.microbatches} "
                f"microbatches, bubble {max(self.bubble()):.3f} (theory {self.theory_bubble():.3f})"]
        for r, rank in enumerate(self._slots):
            cells = ["."] * total
            for s in rank:
                label = f"{s.action.kind}{s.action.microbatch}"
                if self.virtual_stages > 1:
                    label += "abcdefgh"[s.action.chunk // self.stages]
                for t in range(s.start, s.end):
                    cells[t] = label
            rows.append(f"rank {r} |" + " ".join(c.ljust(width - 1) for c in cells) + "|")
        return "\n".join(rows)

    def __repr__(self) -> str:
        lines = [f"Schedule({self.name!r}, stages={self.stages}, microbatches={self.microbatches}, "
                 f"virtual_stages={self.virtual_stages}, split_backward={self.split_backward})"]
        lines += [f"  rank {r}: " + " ".join(map(repr, acts)) for r, acts in enumerate(self.actions)]
        return "\n".join(lines)


def _timeline(s: Schedule) -> list[list[Slot]]:
    """Run every rank's list in order, each action as soon as its inputs are there."""
    end: dict[Action, int] = {}
    pos = [0] * s.stages
    free = [0] * s.stages
    out: list[list[Slot]] = [[] for _ in range(s.stages)]
    remaining = sum(len(a) for a in s.actions)
    while remaining:
        progressed = False
        for r, acts in enumerate(s.actions):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                deps = s.deps(a)
                if any(d not in end for d in deps):
                    break
                start = max([free[r]] + [end[d] for d in deps])
                end[a] = free[r] = start + s.duration(a)
                out[r].append(Slot(start, end[a], a))
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: s.actions[r][pos[r]] for r in range(s.stages) if pos[r] < len(s.actions[r])}
            raise ShardingError(f"Schedule {s.name!r} deadlocks: each rank waits for an action that runs "
                                f"later ({stuck}).\nFix: order every rank's list so that an action's inputs "
                                f"come from actions listed before the waits they need.")
    return out


# -- the built-in schedules: one greedy list scheduler, four policies -----------------------


def _megatron_interleaved(p: int, M: int, V: int, r: int) -> list[Action]:
    """Rank `r`'s order in Megatron-LM's interleaved 1F1B (`forward_backward_pipelining_with_
    interleaving`, microbatch group size = p): the k-th forward runs entry k of the table
    (microbatches in groups of p, each group through chunk 0, then 1, ...), the k-th backward
    the same entry with the chunks reversed; (p - r - 1) * 2 + (V - 1) * p warm-up forwards,
    then one forward and one backward in turn, then the remaining backwards."""
    table = [(mb, v) for g in range(0, M, p) for v in range(V) for mb in range(g, min(g + p, M))]
    total = M * V
    warmup = min((p - r - 1) * 2 + (V - 1) * p, total)

    def f(k: int) -> Action:
        return Action("F", table[k][0], table[k][1] * p + r)

    def b(k: int) -> Action:
        return Action("B", table[k][0], (V - 1 - table[k][1]) * p + r)

    order = [f(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [f(warmup + k), b(k)]
    return order + [b(k) for k in range(total - warmup, total)]


def make_schedule(name: str, stages: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """A built-in schedule: "gpipe", "1f1b", "interleaved" (needs virtual_stages >= 2
    to differ from 1F1B) or "zb-h1".

    Raises:
      ShardingError: an unknown name, stages or microbatches < 1, or virtual stages with a
        schedule other than "interleaved".
    """
    key = name.lower().replace("_", "-")
    if key not in SCHEDULES:
        raise ShardingError(f"sf.pipeline: unknown schedule {name!r}.\nFix: one of {list(SCHEDULES)}, or a "
                            f"sf.pipeline.Schedule you built.")
    for what, v in (("stages", stages), ("microbatches", microbatches), ("virtual_stages", virtual_stages)):
        if not isinstance(v, int) or v < 1:
            raise ShardingError(f"sf.pipeline: {what} must be a positive int, got {v!r}.\nFix: e.g. "
                                f"{what}={max(1, stages if what != 'stages' else 2)}.")
    if virtual_stages > 1 and key != "interleaved":
        raise ShardingError(f"sf.pipeline: virtual_stages={virtual_stages} needs schedule='interleaved' "
                            f"(got {name!r}).\nFix: schedule='interleaved', or virtual_stages=1.")
    split = key == "zb-h1"
    p, M, V = stages, microbatches, virtual_stages
    C = p * V
    if key == "interleaved" and V > 1 and M % p == 0:
        return Schedule(key, p, M, [_megatron_interleaved(p, M, V, r) for r in range(p)], virtual_stages=V)

    def limit(r: int) -> int:  # microbatch-chunks a rank may hold
        if key == "gpipe":
            return M * V
        if key == "interleaved":
            return min(M * V, (p - r - 1) * 2 + (V - 1) * p + 1)
        return p - r

    def f_key(a: Action):
        v = a.chunk // p
        return (a.microbatch // p, v, a.microbatch % p) if key == "interleaved" else (a.microbatch, a.chunk)

    def b_key(a: Action):
        v = a.chunk // p
        return (a.microbatch // p, V - 1 - v, a.microbatch % p) if key == "interleaved" else (a.microbatch, -a.chunk)

    todo = [[Action(k, mb, c) for c in range(r, C, p) for mb in range(M) for k in (("F", "B", "W") if split
                                                                                    else ("F", "B"))]
            for r in range(p)]
    end: dict[Action, int] = {}
    free, held, unfinished = [0] * p, [0] * p, [0] * p  # held: F - B; unfinished: F - W (split)
    order: list[list[Action]] = [[] for _ in range(p)]
    proto = Schedule.__new__(Schedule)
    proto.stages, proto.virtual_stages, proto.split_backward = p, V, split
    t = 0
    while any(todo):
        for r in range(p):
            if free[r] > t or not todo[r]:
                continue
            ready = [a for a in todo[r] if all(end.get(d, t + 1) <= t for d in proto.deps(a))]
            # a microbatch already started may always go on to its later chunks (no deadlock
            # when M is not a multiple of p); only starting one counts against the limit
            fs = sorted((a for a in ready if a.kind == "F" and (a.chunk >= p or (held[r] < limit(r) and (
                not split or unfinished[r] < p)))), key=f_key)
            bs = sorted((a for a in ready if a.kind == "B"), key=b_key)
            ws = sorted((a for a in ready if a.kind == "W"), key=b_key)
            if key == "gpipe":
                pick = fs[0] if fs else bs[0] if bs else None
            else:
                can_f = bool(fs)
                # ZB-H1 and interleaved: a forward first while the limit allows (the deeper
                # warm-up fills the pipeline), then B, then the deferred W; 1F1B: B first
                forward_first = split or key == "interleaved"
                pick = (fs[0] if can_f else bs[0] if bs else ws[0] if ws else None) if forward_first else (
                    bs[0] if bs else fs[0] if can_f else None)
            if pick is None:
                continue
            todo[r].remove(pick)
            order[r].append(pick)
            end[pick] = free[r] = t + (2 if pick.kind == "B" and not split else 1)
            held[r] += 1 if pick.kind == "F" else -1 if pick.kind == "B" else 0
            unfinished[r] += 1 if pick.kind == "F" else -1 if pick.kind == ("W" if split else "B") else 0
        t += 1
        if t > 4 * C * M * 3 + 8:  # every action fits long before: the policy is stuck
            raise ShardingError(f"make_schedule({name!r}): the policy made no progress (stages={p}, "
                                f"microbatches={M}, virtual_stages={V}); a bug in shardfn, please report it.")
    return Schedule(key, p, M, order, virtual_stages=V, split_backward=split)
