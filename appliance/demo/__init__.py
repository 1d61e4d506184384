"""The demo model's builder (corpus, tokenizer, training): a build tool, not part of the
running engine. ``appliance model demo`` and ``python -m appliance.demo.build`` call it."""
