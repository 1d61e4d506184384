"""Each person's preferences (default system prompt, theme) and the household's defaults.

Functions take a ``Session`` and never commit: the caller owns the transaction.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from appliance.store.errors import Invalid
from appliance.store.models import THEMES, HouseholdSetting, UserPreferences

SYSTEM_PROMPT_MAX = 4000
"""Characters in a system prompt, the household's or a person's."""
HOUSEHOLD_PROMPT = "system_prompt"


@dataclass(frozen=True, slots=True)
class Preferences:
    system_prompt: str = ""
    theme: str = "system"


def _prompt(text: str) -> str:
    text = text.replace("\r\n", "\n").strip()
    if len(text) > SYSTEM_PROMPT_MAX:
        raise Invalid(f"A system prompt can be at most {SYSTEM_PROMPT_MAX:,} characters "
                         f"long; this one is {len(text):,}.")
    return text


def get_preferences(session: Session, user_id: int) -> Preferences:
    row = session.get(UserPreferences, user_id)
    return Preferences() if row is None else Preferences(row.system_prompt, row.theme)


def set_preferences(session: Session, user_id: int, *, system_prompt: str | None = None,
                    theme: str | None = None) -> Preferences:
    if theme is not None and theme not in THEMES:
        raise Invalid(f"Theme must be one of: {', '.join(THEMES)}.")
    row = session.get(UserPreferences, user_id)
    if row is None:
        row = UserPreferences(user_id=user_id, system_prompt="", theme="system")
        session.add(row)
    if system_prompt is not None:
        row.system_prompt = _prompt(system_prompt)
    if theme is not None:
        row.theme = theme
    session.flush()
    return Preferences(row.system_prompt, row.theme)


def household_prompt(session: Session) -> str:
    row = session.get(HouseholdSetting, HOUSEHOLD_PROMPT)
    return "" if row is None else row.value


def set_household_prompt(session: Session, text: str) -> str:
    row = session.get(HouseholdSetting, HOUSEHOLD_PROMPT)
    if row is None:
        row = HouseholdSetting(key=HOUSEHOLD_PROMPT, value="")
        session.add(row)
    row.value = _prompt(text)
    session.flush()
    return row.value


def system_prompt_for(session: Session, user_id: int) -> str:
    """The system prompt a person's chats start with: their own, else the household's."""
    return get_preferences(session, user_id).system_prompt or household_prompt(session)
