"""`appliance bench`: this machine's figures, measured against the running daemon.

A thin client, like vLLM's ``vllm bench serve``: streamed chat completions through the
OpenAI API at a few concurrencies, then throughput, TTFT and inter-token latency per level
as a small table (and JSON with ``--json``). It starts nothing and imports no MLX. The lab
that compares the appliance with other servers lives in the repository's ``bench/``
(docs/PERFORMANCE.md), not in the installed package.
"""
