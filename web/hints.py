"""One line beside each scheduler field on the admin pages, in a household's words (the
scheduler's own terms are explained in docs/architecture.md)."""

from __future__ import annotations

HINTS: dict[str, str] = {
    "role": "An admin manages people, keys and models.",
    "status": "Disabled: cannot log in, and their keys stop working.",
    "max_class": "The highest priority they may ask for: voice, then interactive (chat), "
                 "then background (files, jobs).",
    "key_max_class": "The highest priority this key may ask for; never above its person's.",
    "default_class": "The class of requests that ask for none. Home Assistant cannot ask: "
                     "its key needs voice.",
    "weight": "Weight 2 = twice the share when the house is busy; 1 is everyone's usual.",
    "tokens_per_day": "Words read and written in a rolling day (a token is about ¾ of a "
                      "word); blank: no limit.",
    "max_concurrent": "Answers they may have running at once; blank: no limit.",
    "max_prompt_tokens": "The longest question, with its history and files, in tokens.",
    "max_output_tokens": "The longest answer, in tokens.",
}
