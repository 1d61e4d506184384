"""Benchmarks that run beside `mlx_lm.server` on the same model and report ratios.

`appliance.bench.serve` is the serving benchmark (`appliance bench serve`; its statistics and
report in `serve_stats`). Shared parts: `chat_load` (the closed-loop chat clients, the
request body, the warm-up), `client` (one streamed request, timed), `process` (servers under test as child processes),
`provision` (a throwaway data dir with the benchmark's users and keys) and `report` (model
facts, ratios, where the report is kept); percentiles are `appliance.percentiles`.
"""
