"""Side-by-side benchmarks of shardfn against DDP, FSDP2 and torch.optim: a package, so
that one benchmark can reuse another's pieces. Run each from the repository root as a
module, e.g. `python -m benchmarks.fsdp_vs_ddp --tiny` (see docs/benchmarks.md)."""
