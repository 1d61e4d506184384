"""The one transport-free service: how any caller reaches the engine.

- ``generation``: ``submit`` (context, store health, grammar and quota checks, then the
  engine's queue) and ``Generation``, the handle whose events arrive on the event loop
- ``checks``: sampling values, stop strings, context and quota checks
- ``errors``: domain errors (no HTTP status: each transport maps them to its wire)
- ``services``: ``Services``, what handlers share, and ``ModelInfo``
- ``chat_format``: chat templates in, tool calls and thinking out; ``structured``: JSON
  schemas as llguidance grammars
- ``identity``, ``latency``, ``throttle``, ``voice_memory``: who asks, latency histograms,
  login throttling, the voice hook's conversations

``api/`` (OpenAI, Ollama, hooks), ``web/`` (pages) and ``jobs/`` (schedules) call it; it
imports only the engine, the scheduler, the store and shared words, never a transport.
"""
