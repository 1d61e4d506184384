"""The benchmark lab: harnesses that run the appliance beside other servers and report ratios.

Not packaged (the product's own `appliance bench` is a thin client in appliance/bench);
run from the repository root, e.g. ``python -m bench.serve``. `bench.serve` is the serving
benchmark (its statistics and report in `serve_stats`; llama.cpp's server in `bench.peers`).
Shared parts: `chat_load` (the closed-loop chat clients, the request body, the warm-up),
`client` (one streamed request, timed), `process` (servers under test as child processes),
`provision` (a throwaway data dir with the benchmark's users and keys) and `report` (model
facts, ratios, where the report is kept); percentiles are `appliance.percentiles`.
Results and figures: docs/PERFORMANCE.md and bench/results/.
"""
