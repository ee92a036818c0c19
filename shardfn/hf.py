"""Hugging Face transformers checkpoints in and out of shards.

`load_shards(step, path, like)` reads a directory written by `save_pretrained`
(`model.safetensors`, or a sharded `model.safetensors.index.json`) straight into this
rank's shards: each rank reads only the bytes of its own rows (with tensor parallelism,
the rows of its block, from which it takes its columns), on any mesh `sf.shard` lays
out (FSDP, HSDP, FSDP x TP). `save_pretrained(path, step, shards, model)` writes the
shards back as a directory `transformers.AutoModelForCausalLM.from_pretrained` loads,
gathering one unit at a time. `empty_model(config)` builds the model with its
parameters on the meta device (no memory) and its computed buffers real, for both.
See docs/howto/transformers.md.

Context parallelism and pipelines for transformers models: `register_attention()` makes
`attn_implementation="shardfn_ring"` / `"shardfn_ulysses"` (sf.nn's ring and Ulysses
attention over a sequence axis) known to transformers, `shard_sequence` splits a batch
over that axis (global positions, labels shifted before the split) and `causal_lm_loss`
is the matching loss (docs/howto/context-parallel.md); `pipeline_stages(model, ...)`
turns a `*ForCausalLM` into `sf.pipeline`'s pre / layers / post (docs/howto/pipeline.md).

`import shardfn` does not import this module (`sf.hf` imports it on first access), and
this module imports neither transformers nor safetensors (it registers the attention
names at import only when transformers is already imported): the format is read and
written by shardfn itself (shardfn/_hf/_safetensors.py), so the bytes each rank reads
are counted (`return_stats=True`).
"""

import sys as _sys

from ._hf._load import checkpoint_index as checkpoint_index
from ._hf.attention import causal_lm_loss as causal_lm_loss
from ._hf.attention import register_attention as register_attention
from ._hf.attention import shard_sequence as shard_sequence
from ._hf.pipeline import PipelineStages as PipelineStages
from ._hf.pipeline import pipeline_stages as pipeline_stages
from ._hf._model import empty_model as empty_model
from ._hf._load import load_shards as load_shards
from ._hf._safetensors import ReadStats as ReadStats
from ._hf._save import SaveStats as SaveStats
from ._hf._save import save_pretrained as save_pretrained

__all__ = ["empty_model", "load_shards", "save_pretrained", "checkpoint_index", "ReadStats", "SaveStats",
           "register_attention", "shard_sequence", "causal_lm_loss", "pipeline_stages", "PipelineStages"]

if "transformers" in _sys.modules:  # cheap then: a model may name the attention at once
    register_attention()
