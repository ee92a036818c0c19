"""`sf.hf.empty_model`: a transformers model whose parameters take no memory.

[Note: parameters on meta, buffers real] `load_shards` needs only the parameters'
shapes (`like`), and `apply_fn` takes the parameters from the tree, but the forward
uses the module's buffers as they are: the rotary `inv_freq`, computed in `__init__`.
Built under `torch.device("meta")`, those are meta tensors with no values, and the
forward would fail ("Cannot copy out of meta tensor"). So the model is built on the
meta device (no parameter ever takes memory) and its buffers are then computed by the
model's own `_init_weights` rules (`sf.init.materialize_buffers`, [Note: computed
buffers]); a buffer those rules do not compute is a clear error naming it.
"""

from __future__ import annotations

import os

import torch

from .._init.buffers import materialize_buffers

__all__ = ["empty_model"]


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
    with torch.device("meta"):
        if isinstance(model_class, type) and issubclass(model_class, torch.nn.Module):
            model = model_class._from_config(config, **kwargs)  # a PreTrainedModel class
        else:
            model = model_class.from_config(config, **kwargs)  # an auto class
    return materialize_buffers(model)
