"""dmdask's benchmarks of record: `python -m benchmarks run --quick` (or `--full`).

Every scenario measures dmdask and the loaders users would pick side by side, in one
run on one machine, and reports ratios. Results go to `benchmarks/results/*.json` and
`docs/benchmarks.md` (tables and PNG plots) is regenerated from them.
"""
