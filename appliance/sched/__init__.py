"""Who goes next: the scheduler, pure policy over explicit inputs (no clock, no I/O, no MLX).

Where things are: ``scheduler.py`` (the step and its rule), ``fair.py`` (counters, aging,
the ``fair`` order), ``budget.py`` and ``cost.py`` (how long a tick may last and what it
costs), ``memory.py`` (KV), ``quota.py``, ``states.py``, ``types.py`` (the messages).
The runs that chose the constants are in docs/decisions/ (one record each).

Glossary (the words the code and its comments use):

* **tick**: one turn of the engine loop: one decode step for every decoding row plus
  the prefill chunks the plan grants.
* **view** (``SeqView``): what the scheduler sees of one request; **plan** (``Plan``):
  what it decides for one tick.
* **counter** (VTC): a user's weighted tokens served; the lowest goes next within a class.
* **backlogged**: with a request queued or running. **lift**: a user who becomes
  backlogged starts at the backlog's lowest counter, so idle time banks no credit.
* **effective class**, **aging**: a waiting request rises one class per ``aging_seconds``.
* **owed**: the weighted prompt still to read of a user's requests (prefilling, or picked
  earlier in the same order), added to their counter when ordering: VTC charges a prompt
  on admission, the engine as it reads it.
* **heads**: each user's queued requests in class-then-arrival order while
  ``admit_order`` picks, one user's first request at a time.
* **reserve**: slots kept for background work while it is backlogged.
* **yield**: a running request gives its slot back (KV kept): to a higher class, or,
  under ``fair``, because its user holds more than their weighted share of the rows.
* **turn** and **document**: a prompt with at most twice ``arrival_tokens`` left to read
  (a chat turn or voice command) and one with more.
* **present**: someone other than the prompts' owners had voice or interactive work live
  in the last ``presence_s``; their next arrival must not wait out a long tick.
* **patient**: work that can wait: background prompts, documents, and the rest of any
  prompt read in pieces. While someone is present it gets the patient share of a tick.
* **in pieces**: a prompt given a chunk that did not finish it.
* **overdue**: a turn has waited half the TTFT objective unread (or several wait with
  nothing decoding); the tick may then last the whole objective to read the burst together.
* **ride**: a prompt chunk read inside the decode step's forward instead of a prefill
  forward of its own (no forward's fixed cost, a small one per chunk).
* **even chunk**: a riding prompt split into equal pieces rather than full ones and a stub.
* **stub**: the short last piece a greedy split would leave.
* **crumb**: a later chunk under ``min_chunk`` tokens that would leave its prompt
  unfinished; it is not read.
* **whole**: a fresh prompt read in one chunk although it overruns the time left a little.
* **step** (cost model): the extra cost of a forward whose matrix products pass a row
  count where the device changes kernels (a profile's ``step_rows``).
* **efficient chunk**: the chunk size with the lowest predicted time per token.
* **floor**: the least prefill time a tick gets, so a slow machine still reads prompts.
* **parked**: a prefill of a lower class than something decoding; it waits, but a
  **grant** gives it a chunk at least every ``prefill_grant_interval`` decode ticks
  (**due**: its grant has come).
* **cold**: prompt-cache entries no running request uses, reclaimed first.
"""
