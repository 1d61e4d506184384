"""Fault injection for tests of the real daemon (``APPLIANCE_TEST_FAULT``); never set it in
production.

``APPLIANCE_TEST_FAULT=PHASE:ACTION:MAX_TOKENS`` acts on every request whose ``max_tokens``
is exactly MAX_TOKENS, when the engine reaches PHASE for it (``intake``, ``prefill``,
``decode``, ``batch``, ``token`` or ``finish``). ACTION is one of:

* ``raise``: an ordinary error (the engine must end only that request);
* ``die``: an error no handler in the engine catches (a ``BaseException``): the engine
  thread dies, as it would of a bug nobody foresaw, and the supervisor must notice;
* ``stall``: the engine thread blocks for good, as on a hung kernel or a deadlock.
"""

from __future__ import annotations

import threading

from appliance.engine.request import FaultHook, GenerationRequest

ENV = "APPLIANCE_TEST_FAULT"
PHASES = ("intake", "prefill", "decode", "batch", "token", "finish")
ACTIONS = ("raise", "die", "stall")


class InjectedFault(RuntimeError):
    pass


class InjectedDeath(BaseException):
    """Escapes every ``except Exception``: kills the engine thread."""


def fault_from_spec(spec: str | None) -> FaultHook | None:
    if not spec:
        return None
    try:
        phase, action, marker = spec.split(":")
        max_tokens = int(marker)
    except ValueError:
        raise ValueError(f"{ENV} must be PHASE:ACTION:MAX_TOKENS, got {spec!r}") from None
    if phase not in PHASES or action not in ACTIONS:
        raise ValueError(f"{ENV}: phase one of {PHASES}, action one of {ACTIONS}; got {spec!r}")
    never = threading.Event()

    def hook(request: GenerationRequest, at: str) -> None:
        if at != phase or request.max_tokens != max_tokens:
            return
        if action == "raise":
            raise InjectedFault(f"injected fault at {phase}")
        if action == "die":
            raise InjectedDeath(f"injected death at {phase}")
        never.wait()  # stall

    return hook
