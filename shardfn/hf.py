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

`import shardfn` does not import this module (`sf.hf` imports it on first access), and
this module imports neither transformers nor safetensors: the format is read and
written by shardfn itself (shardfn/_hf/_safetensors.py), so the bytes each rank reads
are counted (`return_stats=True`).
"""

from ._hf._load import checkpoint_index as checkpoint_index
from ._hf._model import empty_model as empty_model
from ._hf._load import load_shards as load_shards
from ._hf._safetensors import ReadStats as ReadStats
from ._hf._save import SaveStats as SaveStats
from ._hf._save import save_pretrained as save_pretrained

__all__ = ["empty_model", "load_shards", "save_pretrained", "checkpoint_index", "ReadStats", "SaveStats"]
