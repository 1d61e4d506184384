"""Other servers the lab runs beside the appliance: llama.cpp's `llama-server` (built by
``build-llama-server.sh`` beside this file). `mlx_lm.server` needs no build: it comes with
mlx-lm."""
