"""Persistence: one SQLite file (WAL), SQLAlchemy rows, Alembic migrations, one writer thread.

- ``db``: engine and sessions (``open_store``), WAL, foreign keys, ``BEGIN IMMEDIATE``
- ``models``: the rows; every timestamp is float unix seconds
- ``migrate``: ``upgrade`` / ``downgrade`` / ``check`` without an alembic.ini
- ``auth``: argon2 passwords, ``apl_<prefix>_<secret>`` API keys (sha256)
- ``users``, ``keys``, ``limits`` (quotas, counters), ``ledger``, ``conversations``:
  plain functions over a ``Session``; they never commit, the caller owns the transaction
- ``writer``: ``StoreWriter``, the background thread for ledger rows and counters
"""
