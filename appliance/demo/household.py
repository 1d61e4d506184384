"""The household lessons of the demo model: Home Assistant's intent tools and replies.

Home Assistant's conversation agents (its Ollama and llama.cpp integrations) send every
command with the same shape: a long system prompt (HA's instructions and a YAML overview of
the exposed devices), the intent tools as JSON schemas, and the user's words. A model answers
with a tool call; HA runs the intent and sends the result back as a ``tool`` message; the model
answers that with a short sentence. This module writes such conversations synthetically
(deterministic for a seed) for :mod:`appliance.demo.build` to train on, and holds the
tool schemas and the system prompt as HA 2026 writes them, so that tests can replay a
realistic request.

Sources: the tool names, descriptions and slot schemas follow Home Assistant's intent
handlers (``homeassistant/helpers/intent.py``, ``homeassistant/components/light/intent.py``)
as converted for LLMs by ``homeassistant/helpers/llm.py``; the prompt follows that module's
Assist API prompt. They are restated here from their documented behaviour, not copied.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from tokenizers import Tokenizer

from appliance.demo.template import IM_END, IM_START, SPECIAL_TOKENS, render_turns

DOMAINS = ("light", "switch", "fan", "cover", "lock", "media_player", "climate")
DEVICE_CLASSES = (
    "awning", "blind", "curtain", "damper", "door", "garage", "gate", "shade", "shutter",
    "window", "water", "gas", "outlet", "switch", "tv", "speaker", "receiver",
)


def _tool(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": []}}}


def _target(domains: tuple[str, ...] = DOMAINS) -> dict[str, Any]:
    return {
        "name": {"type": "string"},
        "area": {"type": "string"},
        "floor": {"type": "string"},
        "domain": {"type": "array", "items": {"type": "string", "enum": list(domains)}},
        "device_class": {"type": "array",
                         "items": {"type": "string", "enum": list(DEVICE_CLASSES)}},
    }


HASS_TURN_ON = _tool(
    "HassTurnOn",
    "Turns on/opens/presses a device or entity. For locks, this performs a 'lock' action. "
    "Use for requests like 'turn on', 'activate', 'enable', or 'lock'.", _target())
HASS_TURN_OFF = _tool(
    "HassTurnOff",
    "Turns off/closes a device or entity. For locks, this performs an 'unlock' action. "
    "Use for requests like 'turn off', 'deactivate', 'disable', or 'unlock'.", _target())
HASS_LIGHT_SET = _tool(
    "HassLightSet", "Sets the brightness percentage or color of a light",
    {"name": {"type": "string"}, "area": {"type": "string"}, "floor": {"type": "string"},
     "domain": {"type": "array", "items": {"type": "string", "enum": ["light"]}},
     "color": {"type": "string"},
     "temperature": {"type": "integer", "minimum": 0},
     "brightness": {"type": "integer", "minimum": 0, "maximum": 100,
                    "description": "The brightness percentage of the light between 0 and "
                                   "100, where 0 is off and 100 is fully lit"}})
GET_LIVE_CONTEXT = {"type": "function", "function": {
    "name": "GetLiveContext",
    "description": "Provides real-time information about the CURRENT state, value, or mode "
                   "of devices, sensors, entities, or areas. Use this tool for: 1. Answering "
                   "questions about current conditions (e.g., \"Is the light on?\"). 2. As the "
                   "first step in conditional actions (e.g., \"If the weather is rainy, turn "
                   "off sprinklers\" requires checking the weather first).",
    "parameters": {"type": "object", "properties": {}, "required": []}}}

HA_TOOLS: list[dict[str, Any]] = [HASS_TURN_ON, HASS_TURN_OFF, HASS_LIGHT_SET, GET_LIVE_CONTEXT]
"""The four intent tools the demo model is trained on."""

HA_EXTRA_TOOLS: list[dict[str, Any]] = [
    _tool("HassCancelAllTimers", "Cancels all timers", {"area": {"type": "string"}}),
    _tool("HassClimateSetTemperature", "Sets the target temperature of a climate device or "
          "entity", {"name": {"type": "string"}, "area": {"type": "string"},
                     "floor": {"type": "string"}, "temperature": {"type": "number"}}),
    _tool("HassMediaPause", "Pauses a media player", _target(("media_player",))),
    _tool("HassMediaUnpause", "Resumes a media player", _target(("media_player",))),
    _tool("HassMediaNext", "Skips a media player to the next item", _target(("media_player",))),
    _tool("HassMediaPrevious", "Replays the previous item for a media player",
          _target(("media_player",))),
    _tool("HassSetVolume", "Sets the volume percentage of a media player",
          {**_target(("media_player",)), "volume_level": {
              "type": "integer", "minimum": 0, "maximum": 100,
              "description": "The volume percentage of the media player"}}),
    _tool("HassListAddItem", "Add item to a todo list",
          {"item": {"type": "string"}, "name": {"type": "string"}}),
    _tool("GetDateTime", "Provides the current date and time.", {}),
]
"""Further tools a typical HA install exposes: they make a realistic request long."""

HA_INSTRUCTIONS = (
    "You are a voice assistant for Home Assistant.\n"
    "Answer questions about the world truthfully.\n"
    "Answer in plain text. Keep it simple and to the point.\n"
)
HA_API_PROMPT = (
    "When controlling Home Assistant always call the intent tools. Use HassTurnOn to lock "
    "and HassTurnOff to unlock a lock. When controlling a device, prefer passing just name "
    "and domain. When controlling an area, prefer passing just area name and domain.\n"
    "When a user asks to turn on all devices of a specific type, ask user to specify an area, "
    "unless there is only one device of that type.\n"
    "This device is not able to start timers.\n"
    "You ARE equipped to answer questions about the current state of\n"
    "the home using the `GetLiveContext` tool. This is a primary function. Do not state you "
    "lack the\nfunctionality if the question requires live data.\n"
    "If the user asks about device existence/type (e.g., \"Do I have lights in the "
    "bedroom?\"): Answer\nfrom the static context below.\n"
    "If the user asks about the CURRENT state, value, or mode (e.g., \"Is the lock "
    "locked?\",\n\"Is the fan on?\", \"What mode is the thermostat in?\", \"What is the "
    "temperature outside?\"):\n"
    "    1.  Recognize this requires live data.\n"
    "    2.  You MUST call `GetLiveContext`. This tool will provide the needed real-time "
    "information (like temperature from the local weather, lock status, etc.).\n"
    "    3.  Use the tool's response** to answer the user accurately (e.g., \"The "
    "temperature outside is [value from tool].\").\n"
    "For general knowledge questions not about the home: Answer truthfully from internal "
    "knowledge.\n\n"
    "Static Context: An overview of the areas and the devices in this smart home:\n"
)
"""HA's Assist API prompt as HA 2026.11 sends it (``tests/fixtures``' recorded requests)."""


@dataclass(frozen=True)
class Entity:
    name: str
    domain: str
    area: str

    @property
    def entity_id(self) -> str:
        return f"{self.domain}.{self.name.lower().replace(' ', '_')}"


AREAS = ("Kitchen", "Living Room", "Bedroom", "Bathroom", "Office", "Hallway", "Garage",
         "Dining Room", "Kids Room", "Guest Room", "Porch", "Basement", "Attic", "Study",
         "Laundry Room", "Garden", "Nursery", "Patio", "Den", "Pantry")
KINDS: tuple[tuple[str, str], ...] = (
    ("Light", "light"), ("Lamp", "light"), ("Ceiling Light", "light"), ("Lights", "light"),
    ("Spotlight", "light"), ("Fan", "fan"), ("Heater", "switch"), ("Coffee Maker", "switch"),
    ("Outlet", "switch"), ("TV", "media_player"), ("Speaker", "media_player"),
    ("Blinds", "cover"), ("Door Lock", "lock"),
)


OTHER_DEVICES: tuple[tuple[str, str, str], ...] = (
    ("Front Door Lock", "lock", "Hallway"), ("Garage Door", "cover", "Garage"),
    ("Christmas Tree", "switch", "Living Room"), ("Aquarium", "light", "Den"),
    ("Desk Lamp", "light", "Office"), ("Reading Light", "light", "Bedroom"),
    ("Dishwasher", "switch", "Kitchen"), ("Printer", "switch", "Office"),
    ("Floor Lamp", "light", "Living Room"), ("Night Light", "light", "Nursery"),
    ("Water Heater", "switch", "Basement"), ("Air Purifier", "fan", "Bedroom"),
    ("Back Door Lock", "lock", "Kitchen"), ("Sprinkler", "switch", "Garden"),
    ("String Lights", "light", "Patio"), ("Ceiling Fan", "fan", "Living Room"),
)
"""Devices not named '<Area> <Kind>': the model must copy names, not recall pairs."""


RANDOM_NAME_SHARE = 0.6
"""With name words, the share of devices named by one to three random words."""


def name_words(paragraphs: Sequence[str]) -> list[str]:
    """Words for unmemorisable device names ("Purple Window Spoon"): every plain 3-9 letter
    word of the corpus, sorted (deterministic)."""
    return sorted({w for p in paragraphs for w in re.findall(r"\b[a-z]{3,9}\b", p)})


def make_home(rng: random.Random, n: int | None = None,
              words: Sequence[str] = ()) -> list[Entity]:
    """A random home: ``n`` devices, most named '<Area> <Kind>' like HA's defaults. With
    ``words``, RANDOM_NAME_SHARE of them get names of random words instead: such a name can
    only be copied from the user's words, never recalled, which is what teaches copying."""
    n = n or rng.randint(4, 14)
    seen: set[str] = set()
    home: list[Entity] = []
    while len(home) < n:
        area = rng.choice(AREAS)
        kind, domain = rng.choice(KINDS)
        name = f"{area} {kind}"
        if rng.random() < 0.2:
            name, domain, area = rng.choice(OTHER_DEVICES)
        if words and rng.random() < RANDOM_NAME_SHARE:
            name = " ".join(rng.choice(words).title() for _ in range(rng.randint(1, 3)))
        if name not in seen:
            seen.add(name)
            home.append(Entity(name, domain, area))
    return home


def system_prompt(home: list[Entity], clock: str = "18:04:51", date: str = "2026-11-30",
                  time_last: bool = True) -> str:
    """HA's Assist system prompt for this home: instructions, API prompt, static context and
    the time (last since HA 2025.x; right after the instructions before that)."""
    devices = "\n".join(f"- names: {e.name}\n  domain: {e.domain}\n  areas: {e.area}"
                        for e in home)
    when = f"Current time is {clock}. Today's date is {date}."
    if time_last:
        return f"{HA_INSTRUCTIONS}{HA_API_PROMPT}{devices}\n\n{when}"
    return f"{HA_INSTRUCTIONS}{when}\n{HA_API_PROMPT}{devices}\n"


def ha_request(text: str, home: list[Entity] | None = None,
               extra_tools: bool = True) -> dict[str, Any]:
    """A chat request as HA's Ollama integration sends it (OpenAI-shaped turns)."""
    home = home if home is not None else KITCHEN_HOME
    tools = HA_TOOLS + (HA_EXTRA_TOOLS if extra_tools else [])
    return {"messages": [{"role": "system", "content": system_prompt(home)},
                         {"role": "user", "content": text}], "tools": tools}


KITCHEN_HOME = [Entity("Kitchen Light", "light", "Kitchen"),
                Entity("Living Room Lamp", "light", "Living Room"),
                Entity("Bedroom Fan", "fan", "Bedroom"),
                Entity("Office Heater", "switch", "Office"),
                Entity("Front Door Lock", "lock", "Hallway"),
                Entity("Living Room TV", "media_player", "Living Room"),
                Entity("Garage Door", "cover", "Garage")]
"""The home of the tests and of the documentation's examples."""


# --------------------------------------------------------------------------------------
# Conversations

ON_PHRASES = ("turn on the {n}", "Turn on the {n}", "switch on the {n}", "please turn on the {n}",
              "can you turn on the {n}?", "turn the {n} on", "{n} on", "activate the {n}",
              "Turn on the {n}.", "hey, turn on the {n} please")
OFF_PHRASES = ("turn off the {n}", "Turn off the {n}", "switch off the {n}",
               "please turn off the {n}", "can you turn off the {n}?", "turn the {n} off",
               "{n} off", "Turn off the {n}.", "shut off the {n}")
SET_PHRASES = ("set the {n} to {b}%", "set the {n} to {b} percent", "dim the {n} to {b}%",
               "Set {n} brightness to {b}%", "make the {n} {b}%")
AREA_ON = ("turn on the lights in the {a}", "turn on the {a} lights", "lights on in the {a}")
AREA_OFF = ("turn off the lights in the {a}", "turn off the {a} lights",
            "lights off in the {a}")
ASK_PHRASES = ("is the {n} on?", "Is the {n} on?", "is the {n} off?", "what is the {n} doing?")
CHAT = (("hello", "Hello! How can I help?"), ("hi", "Hi! What can I do for you?"),
        ("thank you", "You're welcome."), ("thanks", "You're welcome."),
        ("who are you?", "I am a small demo voice assistant."),
        ("good night", "Good night!"))


def _call(name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": name, "arguments": args}}]}


def tool_result(ok: list[Entity], error_key: bool = False) -> dict[str, Any]:
    """HA's answer to a successful intent call: the intent response as JSON (HA 2026.11
    wraps it: ``{"data": {...}, "error": null}``)."""
    success = [{"name": e.name, "type": "entity", "id": e.entity_id} for e in ok]
    data: dict[str, Any] = {"speech": {}, "response_type": "action_done", "speech_slots": {},
                            "data": {"targets": [], "success": success, "failed": []}}
    if error_key:
        data = {"data": {"success": success, "failed": [], "speech": {}, "speech_slots": {},
                         "response_type": "action_done"}, "error": None}
    return {"role": "tool", "tool_call_id": "call_1", "content": json.dumps(data)}


def _live(home: list[Entity], states: dict[str, str]) -> dict[str, Any]:
    lines = ["Live Context: An overview of the areas and the devices in this smart home:"]
    for e in home:
        lines.append(f"- names: {e.name}\n  domain: {e.domain}\n  state: '{states[e.name]}'"
                     f"\n  areas: {e.area}")
    return {"role": "tool", "tool_call_id": "call_1",
            "content": json.dumps({"success": True, "result": "\n".join(lines)})}


def conversation(rng: random.Random, home: list[Entity]) -> list[dict[str, Any]]:
    """One exchange about ``home``: the user turn and the assistant's answer, and sometimes
    the tool round after it. The last assistant turn is what the model learns."""
    kind = rng.random()
    e = rng.choice(home)
    said = e.name.lower() if rng.random() < 0.8 else e.name
    if kind < 0.30:
        user = rng.choice(ON_PHRASES).format(n=said)
        call = _call("HassTurnOn", {"name": said})
        reply = rng.choice(("Turned on the {n}.", "The {n} is now on.", "Done, the {n} is on."))
    elif kind < 0.55:
        user = rng.choice(OFF_PHRASES).format(n=said)
        call = _call("HassTurnOff", {"name": said})
        reply = rng.choice(("Turned off the {n}.", "The {n} is now off.",
                            "Done, the {n} is off."))
    elif kind < 0.68:
        lights = [x for x in home if x.domain == "light"] or [e]
        e = rng.choice(lights)
        said = e.name.lower()
        b = rng.choice((10, 20, 25, 30, 40, 50, 60, 70, 75, 80, 90, 100))
        user = rng.choice(SET_PHRASES).format(n=said, b=b)
        call = _call("HassLightSet", {"name": said, "brightness": b})
        reply = f"Set the {{n}} to {b}%."
    elif kind < 0.78:
        on = rng.random() < 0.5
        area = e.area
        user = rng.choice(AREA_ON if on else AREA_OFF).format(a=area.lower())
        call = _call("HassTurnOn" if on else "HassTurnOff",
                     {"area": area.lower(), "domain": ["light"]})
        reply = "Turned {} the lights in the {}.".format("on" if on else "off", area.lower())
        e = Entity(f"{area} lights", "light", area)
    elif kind < 0.92:
        user = rng.choice(ASK_PHRASES).format(n=said)
        states = {x.name: rng.choice(("on", "off")) for x in home}
        turns = [{"role": "user", "content": user}, _call("GetLiveContext", {})]
        if rng.random() < 0.5:
            return turns
        return [*turns, _live(home, states),
                {"role": "assistant", "content": f"The {e.name} is {states[e.name]}."}]
    else:
        user, answer = rng.choice(CHAT)
        return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    turns = [{"role": "user", "content": user}, call]
    if rng.random() < 0.5:
        return turns
    return [*turns, tool_result([e], rng.random() < 0.5), {"role": "assistant", "content": reply.format(n=said)}]


def training_prefix(rng: random.Random, words: Sequence[str] = ()
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[Entity]]:
    """The start of a training conversation: a random home, HA's system prompt for it (whole,
    with some instruction lines left out, or only the first lines) and the tools."""
    home = make_home(rng, words=words)
    clock = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}"
    date = f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    system = system_prompt(home, clock, date, time_last=rng.random() < 0.7)
    r = rng.random()
    if r < 0.3:  # some of HA's instruction lines left out (the device list stays)
        lines = system.split("\n")
        keep = [line for line in lines
                if line.startswith(("- names:", "  ", "Static")) or rng.random() < 0.5]
        system = "\n".join(keep)
    elif r < 0.4:
        system = HA_INSTRUCTIONS
    tools = HA_TOOLS + (HA_EXTRA_TOOLS if rng.random() < 0.5 else [])
    return [{"role": "system", "content": system}], tools, home


def tokenizer_texts(seed: int, n: int = 400) -> list[str]:
    """Household text for the tokenizer's training (so HA's words are single tokens)."""
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        prefix, tools, home = training_prefix(rng)
        texts.append(prefix[0]["content"])
        texts.append(json.dumps(tools[rng.randrange(len(tools))]))
        for turn in conversation(rng, home):
            texts.append(turn.get("content") or json.dumps(turn.get("tool_calls")))
    return texts


# --------------------------------------------------------------------------------------
# Training rows


COPY_WEIGHT = 3.0
"""Loss weight of learnt word tokens that also occur in the exchange's user turn: the device
names a call or a reply copies. They are a few tokens among many easy ones (the call's
fixed JSON), and copying them is the skill that is slowest to learn."""


def _encode(tok: Tokenizer, pieces: Sequence[tuple[str, bool]]) -> tuple[list[int], list[float]]:
    """Token ids and loss weights of rendered pieces: 0 where the model does not learn, 1
    where it does, COPY_WEIGHT for learnt word tokens found in an earlier user turn."""
    ids: list[int] = []
    mask: list[float] = []
    said: set[int] = set()
    for enc, (text, learn) in zip(tok.encode_batch([p for p, _ in pieces],
                                                   add_special_tokens=False), pieces, strict=True):
        if text.startswith(f"{IM_START}user"):
            said.update(i for i in enc.ids if _is_word(tok, i))
        ids.extend(enc.ids)
        mask.extend(0.0 if not learn else COPY_WEIGHT if i in said else 1.0 for i in enc.ids)
    return ids, mask


def _is_word(tok: Tokenizer, i: int) -> bool:
    piece = tok.id_to_token(i) or ""
    return piece.isascii() and piece.isalpha()  # letters only: no tags, spaces are apart


def training_rows(tok: Tokenizer, rng: random.Random, n: int, length: int,
                  full_prompt: float, words: Sequence[str] = (),
                  head: bool = True) -> tuple[mx.array, mx.array]:
    """``n`` rows of ``length + 1`` tokens and their loss weights: each a system prompt and
    the tools, then as many exchanges about that home as fit (padding after). ``full_prompt``
    is the share of rows with HA's whole prompt; the others start with its instructions only.
    Without ``head`` a row is exchanges only: the many short copies a curriculum starts with.
    ``words``: names devices by random words too (:func:`make_home`)."""
    pad = SPECIAL_TOKENS.index(IM_END)
    rows: list[list[int]] = []
    masks: list[list[float]] = []
    while len(rows) < n:
        prefix, tools, home = training_prefix(rng, words)
        if rng.random() >= full_prompt:
            prefix = [{"role": "system", "content": HA_INSTRUCTIONS}]
        ids, mask = _encode(tok, render_turns(prefix, tools)) if head else ([], [])
        if len(ids) > length - 100:  # room for at least one exchange
            continue
        while True:
            more, more_mask = _encode(tok, render_turns(conversation(rng, home), None))
            if len(ids) + len(more) > length + 1:
                break
            ids += more
            mask += more_mask
        if not any(mask):
            continue
        rows.append(ids + [pad] * (length + 1 - len(ids)))
        masks.append(mask + [0.0] * (length + 1 - len(mask)))
    return mx.array(rows, dtype=mx.int32), mx.array(masks, dtype=mx.float32)
