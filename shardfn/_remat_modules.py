"""Remat for `nn.Module` models with state: what `sf.functional(model, remat=...)` does
about transformers' KV cache and Hugging Face's own gradient checkpointing.

[Note: transformers under remat] A transformers model at its default config runs with
`use_cache=True`: each decoder layer appends its keys and values to a cache object in its
forward, so a recompute would append them again and attend over duplicated keys (the
same outputs, other gradients; sf.remat detects it: [Note: a recompute must be its
forward]). Hugging Face's gradient checkpointing turns the cache off while it checkpoints
("`use_cache=True` is incompatible with gradient checkpointing. Setting
`use_cache=False`"); `sf.functional(model, remat=...)` does the same: when the model's
forward takes `use_cache` and grad mode is on, it is called with `use_cache=False`, and an
explicit `use_cache=True` is an error. Under `torch.no_grad()` (evaluation, generation)
nothing is recomputed and the cache is left as asked.

`model.gradient_checkpointing_enable()` makes HF's layers call `torch.utils.checkpoint`,
which does not run under `torch.func` nor on the per-thread copies of `sf.functional`
(their parameters are meta tensors); `sf.functional` turns it off on its copies and runs
the blocks under `sf.remat` instead (`remat=True` unless a policy is given).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ._errors import SpecError

__all__ = ["checkpointing", "turn_off_checkpointing", "takes_use_cache", "without_cache"]


def checkpointing(module: nn.Module) -> list[str]:
    """The modules of `module` on which HF's gradient checkpointing is on."""
    return [name for name, m in module.named_modules() if getattr(m, "gradient_checkpointing", False) is True]


def turn_off_checkpointing(module: nn.Module) -> None:
    """HF's gradient checkpointing off on `module` (a per-thread copy): sf.remat does it.
    Also drops the hook HF adds with it that sets `requires_grad_()` on the embeddings'
    output (for reentrant checkpointing; refused under `torch.func`, useless to sf.remat).
    The copy's hook handles point at the original's hook dicts: they are not called."""
    if not checkpointing(module):
        return
    for m in module.modules():
        if getattr(m, "gradient_checkpointing", False) is True:
            m.gradient_checkpointing = False
        for key, hook in list(m._forward_hooks.items()):
            if getattr(hook, "__qualname__", "").endswith("enable_input_require_grads.<locals>.make_inputs_require_grads"):
                del m._forward_hooks[key]
        if "_require_grads_hooks" in vars(m):
            m._require_grads_hooks = []


def takes_use_cache(module: nn.Module) -> bool:
    """`module` is a transformers-style model: a `config.use_cache` and a forward taking `use_cache`."""
    if getattr(getattr(module, "config", None), "use_cache", None) is None:
        return False
    try:
        return "use_cache" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def without_cache(kwargs: dict, model: nn.Module) -> dict:
    """`kwargs` with `use_cache=False` when the blocks will be recomputed (grad mode on).
    [Note: transformers under remat]"""
    if not torch.is_grad_enabled():
        return kwargs
    if kwargs.get("use_cache"):
        raise SpecError(
            f"sf.functional({type(model).__name__}, remat=...): use_cache=True with remat: each block would "
            f"append its keys and values to the cache in the forward and again in the recompute, so the "
            f"gradients would be wrong. Hugging Face's gradient checkpointing sets use_cache=False for the same "
            f"reason.\nFix: train with use_cache=False (the default under remat), or call the model under "
            f"torch.no_grad() to use the cache (generation), or build sf.functional without remat=."
        )
    return dict(kwargs, use_cache=False)


def checkpoint_error(error: BaseException, where: str) -> SpecError | None:
    """A SpecError naming sf.remat for an error that `torch.utils.checkpoint` raised inside
    `where` (it cannot run under `torch.func`: saved-tensor hooks; its reentrant variant:
    no `torch.autograd.grad`), or None for any other error."""
    tb = error.__traceback__
    while tb is not None and not tb.tb_frame.f_code.co_filename.endswith(("utils/checkpoint.py", "utils\\checkpoint.py")):
        tb = tb.tb_next
    if tb is None:
        return None
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return SpecError(
        f"{where}: torch.utils.checkpoint failed inside it ({type(error).__name__}: {first[:200]}). "
        f"torch.utils.checkpoint relies on saved-tensor hooks, which torch.func refuses, and its "
        f"use_reentrant=True variant on .backward() only.\nFix: recompute with sf.remat(block)(block_params, h) "
        f"instead, or build the model with sf.functional(model, remat=True) (for a transformers model instead "
        f"of model.gradient_checkpointing_enable(); sf.functional maps that to remat=True itself); both work "
        f"under torch.func, step.grad_and_value and .backward(), and inside sf.shard."
    )
