"""Implementation of `sf.hf` (the public face is `shardfn/hf.py`).

Data flows one way: `_safetensors` (the file format: headers, byte-range reads counted
per rank, streamed writes) -> `_load` (`load_shards`: a checkpoint into this rank's
shards) and `_save` (`save_pretrained`: shards out as a transformers directory).
Neither imports transformers or safetensors: the format is read and written here, and
`model.config.save_pretrained` is the model's own method.
"""
