"""The appliance: a fair household LLM server on MLX."""

__version__ = "0.1.0"
