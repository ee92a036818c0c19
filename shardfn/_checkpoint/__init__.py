"""Implementation of `sf.checkpoint` (the public face is `shardfn/checkpoint.py`).

Data flows one way: `_keys` (tree -> named leaves) -> `_layout` (blocks, global shapes,
agreement across ranks) -> `_dcp` (DCP plans, writer, reader) -> `_files` (temp dirs,
completion marker, `latest`) -> `_api` (save, load, export_full).
"""
