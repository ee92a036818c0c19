"""Calling a module with its parameters bound to given tensors: `torch.func.functional_call`
with the search for the slots done once.

[Note: binding without functional_call]
`torch.func.functional_call(module, {name: tensor}, args)` swaps each named parameter for
the tensor, calls the module and swaps them back. Each call it also walks the whole module
tree to find tied parameters (`named_parameters(remove_duplicate=False)`, every submodule's
`named_modules`) and resolves every dotted name again, for a tree that never changes (a
shard step of the benchmarks' GPT 4L made 18.5k Python calls; 11.0k with `Binding` and
`ParamsView.find`, a main-thread saving of about 0.5 ms a step on this CPU).
`Binding` does that walk once per (module, names): for every name, every (submodule,
attribute) slot that holds the same Parameter object (ties included, as functional_call's
`tie_weights=True` binds them), then each call writes the tensors into those slots'
`_parameters` entries (what functional_call's accessor writes), calls the module and
restores the Parameters, also when the call raises. The module must not be re-parametrized
between calls (sf.functional's per-thread copies are not: [Note: a module copy per
thread] in _functional.py). Like functional_call, it is not thread-safe on one module.
"""

from __future__ import annotations

from typing import Sequence

from torch import nn

__all__ = ["Binding"]


class Binding:
    """`call(values, args, kwargs)`: `module(*args, **kwargs)` with the parameter named
    `names[i]` (and every parameter tied to it) bound to `values[i]` for the call."""

    __slots__ = ("module", "slots")

    def __init__(self, module: nn.Module, names: Sequence[str]):
        where: dict[int, list[tuple[nn.Module, str]]] = {}
        for dotted, p in module.named_parameters(remove_duplicate=False):
            owner, _, attr = dotted.rpartition(".")
            where.setdefault(id(p), []).append((module.get_submodule(owner), attr))
        self.module = module
        self.slots = [tuple(where[id(module.get_parameter(name))]) for name in names]

    def call(self, values: Sequence, args: tuple, kwargs: dict):
        saved = []
        try:
            for slots, value in zip(self.slots, values):
                for owner, attr in slots:
                    params = owner._parameters
                    saved.append((params, attr, params[attr]))
                    params[attr] = value
            return self.module(*args, **kwargs)
        finally:
            for params, attr, old in reversed(saved):
                params[attr] = old
