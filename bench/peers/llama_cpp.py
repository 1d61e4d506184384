"""llama.cpp's own server as a peer: where its binary is, and its command line.

The binary comes from ``bench/peers/build-llama-server.sh`` (llama.cpp as vendored by the
llama-cpp-python sdist; parallel slots, which the Python package's server lacks). It serves
a GGUF file with ``-np`` slots sharing one context of ``-c`` tokens, split evenly: each slot
needs the longest prompt plus the longest answer.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

BINARY_ENV = "LLAMA_SERVER"
DIR_ENV = "LLAMA_SERVER_DIR"
BUILD_SCRIPT = Path(__file__).resolve().parent / "build-llama-server.sh"


def default_binary() -> Path:
    """$LLAMA_SERVER, else the build script's cache (``$LLAMA_SERVER_DIR/bin/llama-server``)."""
    if os.environ.get(BINARY_ENV):
        return Path(os.environ[BINARY_ENV])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    base = Path(os.environ[DIR_ENV]) if os.environ.get(DIR_ENV) else (
        cache / "appliance-bench" / "llama-server")
    return base / "bin" / "llama-server"


def slot_context(prompt_words: int, max_tokens: int) -> int:
    """Tokens one slot needs: the chat template and a ~40-token question, the filler words
    (about 1.5 tokens each), the answer; rounded up to 256 and at least 1,024."""
    need = 256 + 2 * prompt_words + max_tokens
    return max(1024, -(-need // 256) * 256)


def argv(cmd: Sequence[str], gguf: Path, host: str, port: int, slots: int, threads: int,
         prompt_words: int, max_tokens: int) -> list[str]:
    """llama-server (`cmd`) on `gguf` with `slots` parallel slots and `threads` threads."""
    return [*cmd, "-m", str(gguf), "--host", host, "--port", str(port),
            "-np", str(slots), "-t", str(threads),
            "-c", str(slots * slot_context(prompt_words, max_tokens))]


def missing_binary_message(binary: Path) -> str:
    return (f"llama-server not found at {binary}: build it with {BUILD_SCRIPT} (about 10 "
            f"minutes), or pass --llama-cmd / set ${BINARY_ENV}")
