"""`sf.hf.empty_model`: a transformers model whose parameters take no memory.

[Note: parameters on meta, buffers real] `load_shards` needs only the parameters'
shapes (`like`), and `apply_fn` takes the parameters from the tree, but the forward
uses the module's buffers as they are: the rotary `inv_freq`, computed in `__init__`.
Built under `torch.device("meta")`, those are meta tensors with no values, and the
forward fails ("Cannot copy out of meta tensor"). So the model is built on the CPU
with `nn.Module.register_parameter` patched to move each new parameter to the meta
device as it is registered (accelerate's `init_empty_weights(include_buffers=False)`):
buffers are computed by the model's own code, each parameter exists for one moment
(one tensor's memory, never the model's), and the random init then runs on meta, a no-op.
The patch is process-wide while it lasts: build models in one thread (before `mesh.run`).
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch
from torch import nn

__all__ = ["empty_model", "parameters_on_meta"]

_PATCH = threading.Lock()  # one patch at a time: two threads' patches must not interleave


@contextlib.contextmanager
def parameters_on_meta():
    """Within: every parameter a module registers is moved to the meta device; buffers stay."""
    with _PATCH:
        register = nn.Module.register_parameter

        def on_meta(module, name, param):
            register(module, name, param)
            if param is not None and param.device.type != "meta":
                module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

        nn.Module.register_parameter = on_meta
        try:
            yield
        finally:
            nn.Module.register_parameter = register


def empty_model(config, model_class=None, *, dtype: torch.dtype | None = None):
    """A transformers model with its parameters on the meta device and its buffers computed.

    The model for `sf.hf.load_shards` and `sf.functional`: its parameter tree gives
    `like` (shapes and dtypes, no memory), and its buffers (rotary tables) are real, so
    `apply_fn` runs with the shards' parameters ([Note: parameters on meta, buffers real]).

    Args:
      config: a transformers config, or a directory / hub name `AutoConfig.from_pretrained` reads.
      model_class: a model class (`LlamaForCausalLM`) or an auto class (default:
        `transformers.AutoModelForCausalLM`).
      dtype: the parameters' dtype (default: float32, as `from_config` gives).

    Returns:
      The model, in training mode as `from_config` builds it (dropout on: `.eval()` for
      inference or exact comparisons).

    Example:
      >>> import shardfn as sf
      >>> from transformers import LlamaConfig
      >>> model = sf.hf.empty_model(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
      ...                                       num_hidden_layers=2, num_attention_heads=2))
      >>> model.lm_head.weight.device.type, model.model.rotary_emb.inv_freq.device.type
      ('meta', 'cpu')
    """
    import transformers

    if isinstance(config, (str, os.PathLike)):
        config = transformers.AutoConfig.from_pretrained(os.fspath(config))
    model_class = model_class or transformers.AutoModelForCausalLM
    kwargs = {} if dtype is None else {"dtype": dtype}
    with parameters_on_meta():
        if isinstance(model_class, type) and issubclass(model_class, nn.Module):
            return model_class._from_config(config, **kwargs)  # a PreTrainedModel class
        return model_class.from_config(config, **kwargs)  # an auto class
