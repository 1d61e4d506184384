"""Benchmarks that run beside `mlx_lm.server` on the same model and report ratios.

`appliance.bench.serve` is the serving benchmark (`appliance bench serve`); shared helpers
(server subprocesses, the streaming client, percentiles) live in `appliance.bench.common`.
"""
