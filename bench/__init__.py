"""wfdash benchmarks: `python -m bench [--quick] [--only NAME,...]` (see docs/bench.md)."""
