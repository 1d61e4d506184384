"""Words every layer shares (the store, the scheduler, the API): pure constants, no imports
from the rest of the appliance, so any layer may use them."""

from __future__ import annotations

WEIGHT_MIN = 0.01
WEIGHT_MAX = 100.0
"""A user's weight lies in [WEIGHT_MIN, WEIGHT_MAX]: the store refuses others, and the
counters clamp whatever reaches them, so a charge is at most ``100 * (w_in + w_out)`` per
token and a counter stays finite."""
