"""Summaries of documents longer than the model's context: map, then reduce.

The document is cut into token-sized chunks (cut on token boundaries, decoded back to
text); each chunk is summarised on its own (map), then the partial summaries are combined
(reduce), in groups when even they do not fit, until one answer is left. A document that
fits in one prompt is one request. Every stage is one model request made by ``ask``
(the runner's: the owner's ``background`` request through the service path), and
``progress(done, total)`` is called after each one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio

Ask = Callable[[str, int], Awaitable[str]]
Progress = Callable[[int, int], Awaitable[None]]

TEMPLATE_OVERHEAD = 64
"""Tokens of chat template and framing text around a stage's content (generous)."""
MAX_AUTO_CHUNK = 4096
MIN_CHUNK = 64
MAP_OUTPUT_TOKENS = 200

MAP = ("{instructions}\n\nThis is part {i} of {n} of a longer document. Note what in this part "
       "matters for the task above, briefly.\n\n---\n{text}")
REDUCE = ("{instructions}\n\nBelow are notes on consecutive parts of one document. Combine "
          "them into one answer.\n\n---\n{text}")
SINGLE = "{instructions}\n\n---\n{text}"


@dataclass(frozen=True, slots=True)
class Plan:
    chunk_tokens: int
    map_tokens: int
    single: bool
    chunks: list[str]


def _count(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text))


def plan(tokenizer: Any, instructions: str, document: str, ctx_limit: int, out_tokens: int,
         chunk_setting: int = 0) -> Plan:
    """How a document is cut for a model with ``ctx_limit`` tokens (blocking: tokenizes)."""
    instr = _count(tokenizer, instructions) + TEMPLATE_OVERHEAD
    ids = tokenizer.encode(document)
    if instr + len(ids) + out_tokens < ctx_limit:
        return Plan(len(ids), out_tokens, True, [document])
    map_tokens = min(MAP_OUTPUT_TOKENS, out_tokens)
    room = ctx_limit - instr - max(out_tokens, map_tokens)
    chunk = chunk_setting or min(MAX_AUTO_CHUNK, room // 2)
    chunk = min(chunk, room)
    if chunk < MIN_CHUNK:
        raise ValueError(f"the instructions and the output limit leave no room for the "
                         f"document in the model's {ctx_limit}-token context")
    chunks = [tokenizer.decode(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return Plan(chunk, map_tokens, False, chunks)


async def summarise(tokenizer: Any, instructions: str, document: str, ctx_limit: int,
                    out_tokens: int, ask: Ask, progress: Progress,
                    chunk_setting: int = 0) -> str:
    p = await anyio.to_thread.run_sync(plan, tokenizer, instructions, document, ctx_limit,
                                       out_tokens, chunk_setting)
    if p.single:
        await progress(0, 1)
        answer = await ask(SINGLE.format(instructions=instructions, text=document), out_tokens)
        await progress(1, 1)
        return answer
    n = len(p.chunks)
    total = n + 1
    done = 0
    await progress(done, total)
    notes: list[str] = []
    for i, chunk in enumerate(p.chunks, 1):
        notes.append(await ask(MAP.format(instructions=instructions, i=i, n=n, text=chunk),
                               p.map_tokens))
        done += 1
        await progress(done, total)
    budget = ctx_limit - _count(tokenizer, instructions) - TEMPLATE_OVERHEAD - out_tokens
    while True:
        joined = "\n\n".join(f"Part {i}: {note.strip()}" for i, note in enumerate(notes, 1))
        if await anyio.to_thread.run_sync(_count, tokenizer, joined) < budget or len(notes) == 1:
            break
        groups = await anyio.to_thread.run_sync(_group, tokenizer, notes, p.chunk_tokens)
        total += len(groups)
        merged = []
        for group in groups:
            merged.append(await ask(REDUCE.format(instructions=instructions,
                                                  text="\n\n".join(group)), p.map_tokens))
            done += 1
            await progress(done, total)
        notes = merged
    answer = await ask(REDUCE.format(instructions=instructions, text=joined), out_tokens)
    await progress(total, total)
    return answer


def _group(tokenizer: Any, notes: list[str], budget: int) -> list[list[str]]:
    """Consecutive notes packed into groups of at most ``budget`` tokens (two at least)."""
    groups: list[list[str]] = [[]]
    size = 0
    for note in notes:
        n = _count(tokenizer, note) + 2
        if groups[-1] and size + n > budget and len(groups[-1]) >= 2:
            groups.append([])
            size = 0
        groups[-1].append(note)
        size += n
    return groups
