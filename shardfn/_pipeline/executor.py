"""One executor for every schedule: runs a rank's F / B / W actions in its schedule's
order, with the activations and their gradients moving in lock-step exchange rounds.

[Note: the executor] The whole step (forward and backward of every microbatch) runs when
the loss is computed, because 1F1B and zero-bubble schedules interleave forwards and
backwards; `transform.py` keeps the gradients and hands them out, scaled, when autograd
asks (the loss is a scalar, so its vector-Jacobian product is linear in the cotangent).
Each layer's forward runs on detached leaves under `enable_grad`, so every layer keeps
its own small autograd graph: B is `autograd.grad(out, inp)` through it (and, for
unsplit schedules, the weights too), W is `autograd.grad(out, weights)` later, from the
graph B kept. That is the zero-bubble dI / dW split, on stock autograd, without graph
surgery: the engine computes only the gradients asked for.

[Note: exchange rounds] Messages ride `ops.exchange_async` (one all-to-all per round,
[Note: one all-to-all per round]); a round carries every message produced by actions that
end in the same slot of the schedule's timeline, so every rank issues the same rounds in
the same order. A rank walks the timeline: at slot t it first issues the round of the
messages made by actions ending at t, then runs its action starting at t, waiting only
for the messages that action consumes. A round is issued as soon as its data exists and
waited for only when used, so the transfer overlaps the compute in between.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from .. import _tree
from .._backend import ops
from .schedule import Action, Schedule

__all__ = ["Stage", "execute"]


class Stage:
    """What one rank computes: its chunks' layers and, on the first / last chunk, pre / post."""

    def __init__(self, layer_fn: Callable, layer_treedef, chunks: list[list[list[torch.Tensor]]],
                 pre: Callable | None, pre_treedef, pre_leaves: list, post: Callable, post_treedef,
                 post_leaves: list):
        self.layer_fn, self.layer_treedef, self.chunks = layer_fn, layer_treedef, chunks
        self.pre, self.pre_treedef, self.pre_leaves = pre, pre_treedef, pre_leaves
        self.post, self.post_treedef, self.post_leaves = post, post_treedef, post_leaves


def _leaves_for_grad(leaves: list) -> list:
    return [x.detach().requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
            for x in leaves]


def _grads(out, inputs: list, g, retain: bool) -> list:
    want = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.requires_grad]
    got = torch.autograd.grad(out, [inputs[i] for i in want], g, retain_graph=retain, allow_unused=True) if want else ()
    out_list: list = [None] * len(inputs)
    for i, gi in zip(want, got):
        out_list[i] = gi
    return out_list


class _Records:
    """The per-layer graphs of one (microbatch, chunk): (input leaf, output, weight leaves, slot)."""

    def __init__(self):
        self.layers: list[tuple] = []
        self.deferred: list[tuple] = []  # (output, weights, cotangent, slot) awaiting W


def execute(schedule: Schedule, rank: int, group, stage: Stage, microbatches: list, first_input: Callable,
            act_shape: tuple, act_dtype: torch.dtype, train: bool, trace: list | None = None):
    """Run this rank's part of `schedule`.

    Returns:
      (loss sum over the microbatches whose post ran here, layer grads [v][layer][leaf],
      pre grads, post grads); the grads are None when `train` is False.
    """
    p, C, M = schedule.stages, schedule.chunks, schedule.microbatches
    split = schedule.split_backward
    numel = 1
    for d in act_shape:
        numel *= int(d)
    scale = 1.0 / M
    slots = schedule.timeline()
    # messages: (time, src, dst, key); key = (kind, mb, receiving chunk)
    messages = []
    for r, row in enumerate(slots):
        for s in row:
            a = s.action
            if a.kind == "F" and a.chunk < C - 1:
                messages.append((s.end, r, schedule.rank_of(a.chunk + 1), ("act", a.microbatch, a.chunk + 1)))
            elif train and a.kind == "B" and a.chunk > 0:
                messages.append((s.end, r, schedule.rank_of(a.chunk - 1), ("grad", a.microbatch, a.chunk - 1)))
    rounds: dict[int, list] = {}
    for m in messages:
        rounds.setdefault(m[0], []).append(m)
    mine = [s for s in slots[rank] if train or s.action.kind == "F"]
    events = sorted([(t, 0, None) for t in rounds] + [(s.start, 1, s) for s in mine], key=lambda e: (e[0], e[1]))

    outbox: dict[tuple, torch.Tensor] = {}
    inbox: dict[tuple, tuple] = {}  # key -> (pending, index) or ("ready", tensor)
    records: dict[tuple[int, int], _Records] = {}
    loss_sum = None
    grads_layers = [[[None] * len(layer) for layer in chunk] for chunk in stage.chunks] if train else None
    grads_pre = [None] * len(stage.pre_leaves)
    grads_post = [None] * len(stage.post_leaves)

    def add(into: list, i: int, g):
        if g is not None:
            into[i] = g if into[i] is None else into[i] + g

    def received(key) -> torch.Tensor:
        pending, index = inbox.pop(key)
        if pending is None:  # a message to this rank itself (virtual stages on one rank)
            return index
        if pending[1] is None:  # [pending, its results once waited]
            pending[1] = pending[0].wait()
        return pending[1][index].view(act_shape)

    def forward(a: Action) -> None:
        nonlocal loss_sum
        rec = records[(a.microbatch, a.chunk)] = _Records()
        mb = microbatches[a.microbatch]
        v = a.chunk // p
        with torch.enable_grad():
            if a.chunk == 0:
                if stage.pre is not None:
                    w = _leaves_for_grad(stage.pre_leaves) if train else stage.pre_leaves
                    h = stage.pre(_tree.unflatten(stage.pre_treedef, w), mb)
                    rec.layers.append((None, h, w, ("pre",)))
                else:
                    h = first_input(mb)
            else:
                h = received(("act", a.microbatch, a.chunk))
            for i, layer in enumerate(stage.chunks[v]):
                inp = h.detach().requires_grad_(train and (a.chunk > 0 or i > 0 or stage.pre is not None))
                w = _leaves_for_grad(layer) if train else layer
                h = stage.layer_fn(_tree.unflatten(stage.layer_treedef, w), inp)
                rec.layers.append((inp if inp.requires_grad else None, h, w, ("layer", v, i)))
            if a.chunk == C - 1:
                inp = h.detach().requires_grad_(train)
                w = _leaves_for_grad(stage.post_leaves) if train else stage.post_leaves
                loss = stage.post(_tree.unflatten(stage.post_treedef, w), inp, mb)
                rec.layers.append((inp, loss, w, ("post",)))
                loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
            else:
                outbox[("act", a.microbatch, a.chunk + 1)] = h.detach()
        if not train:
            records.pop((a.microbatch, a.chunk))

    def accumulate(slot, weight_grads: list) -> None:
        if slot[0] == "pre":
            for i, g in enumerate(weight_grads):
                add(grads_pre, i, g)
        elif slot[0] == "post":
            for i, g in enumerate(weight_grads):
                add(grads_post, i, g)
        else:
            _, v, layer = slot
            for i, g in enumerate(weight_grads):
                add(grads_layers[v][layer], i, g)

    def backward(a: Action) -> None:
        rec = records[(a.microbatch, a.chunk)]
        if a.chunk == C - 1:
            g = torch.full_like(rec.layers[-1][1], scale)
        else:
            g = received(("grad", a.microbatch, a.chunk))
        for inp, out, w, slot in reversed(rec.layers):
            if split:
                gi = _grads(out, [inp], g, retain=True)[0] if inp is not None else None
                rec.deferred.append((out, w, g, slot))
            else:
                got = _grads(out, [inp] + list(w), g, retain=False)
                gi = got[0]
                accumulate(slot, got[1:])
            g = gi
        rec.layers = []
        if a.chunk > 0:
            outbox[("grad", a.microbatch, a.chunk - 1)] = g
        if not split:
            records.pop((a.microbatch, a.chunk))

    def weights(a: Action) -> None:
        rec = records.pop((a.microbatch, a.chunk))
        for out, w, g, slot in rec.deferred:
            accumulate(slot, _grads(out, list(w), g, retain=False))

    run = {"F": forward, "B": backward, "W": weights}
    for t, kind, slot in events:
        if kind == 0:  # an exchange round
            for _, src, dst, key in rounds[t]:
                if src == dst == rank:
                    inbox[key] = (None, outbox.pop(key))
            sends = [(dst, outbox.pop(key)) for _, src, dst, key in rounds[t] if src == rank != dst]
            recvs = [(src, key) for _, src, dst, key in rounds[t] if dst == rank != src]
            if group.size > 1:
                pending = ops.exchange_async(group, sends, [(src, numel) for src, _ in recvs], act_dtype,
                                             f"slot {t}")
                holder = [pending, None]
                for i, (_, key) in enumerate(recvs):
                    inbox[key] = (holder, i)
            continue
        start = time.perf_counter()
        run[slot.action.kind](slot.action)
        if trace is not None:
            trace.append((slot.action, start, time.perf_counter()))
    return loss_sum, grads_layers, grads_pre, grads_post
