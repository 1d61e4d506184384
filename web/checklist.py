"""The first hour's checklist (web/first_hour.py): read from what the household already has
(people besides the admin, a live key whose default class is voice, a model chosen or a real
one served); only "hidden" is a setting of its own."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select

from appliance.service import model_choice
from appliance.service.services import Services
from appliance.store.models import ApiKey, HouseholdSetting, User
from appliance.vocab import Klass

HIDDEN_KEY = "first_hour_hidden"
HA_USER = "home-assistant"
"""The user "Make a key for Home Assistant" makes (not one of the household's people)."""

_finished: set[str] = set()
"""Databases (by URL) whose checklist is done or hidden: no more reads on admin pages."""


@dataclass(frozen=True, slots=True)
class Checklist:
    household: bool
    ha_key: bool
    model: bool

    @property
    def done(self) -> int:
        return sum((self.household, self.ha_key, self.model))


def checklist(svc: Services) -> Checklist | None:
    """What is left of the first hour; None once all is done or the admin hid the list."""
    db = str(svc.store.engine.url)
    if db in _finished:
        return None
    with svc.store.read_sessions() as s:
        hidden = s.get(HouseholdSetting, HIDDEN_KEY)
        if hidden is not None and hidden.value == "1":
            _finished.add(db)
            return None
        people = s.scalar(select(func.count()).select_from(User).where(
            func.lower(User.name) != HA_USER)) or 0
        voice_keys = s.scalar(select(func.count()).select_from(ApiKey).where(
            ApiKey.default_class == Klass.VOICE.label, ApiKey.revoked_at.is_(None))) or 0
        chosen = model_choice.recorded(s) is not None
    state = Checklist(people >= 2, voice_keys > 0, chosen or not svc.model.is_demo)
    if state.done == 3:
        _finished.add(db)
        return None
    return state
