"""How fast: `serving` (the workload replay behind `quantkit bench`) and `plots` are library;
`decode` and `decode_phases` are benchmarks run with `python -m` (batch-1/batch-8 decode, the
per-phase breakdown of the C step)."""
