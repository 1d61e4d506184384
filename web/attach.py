"""Attached files: a PDF's text, and a file too long for one message, read in parts.

A text, Markdown or HTML file is read in the browser (``app.js``); a PDF is sent here
(``POST /chat/attachments``) and only its text goes back (``web.pdftext``). A message whose
file is longer than one message holds is not refused: its question is stored at once, then
the file is summarised by the jobs' map-reduce (``appliance.jobs.mapreduce``), each part one
``background`` request of the person's (counted, charged and ordered like any other), while
the page shows "Reading part 2 of 5" (``GET /chat/readings/<rid>``, SSE). The summary then
takes the file's place in the stored question, which is answered like any other: streamed,
in the interactive class. Stop ends the reading and keeps the notes on the parts read. The
reading runs on the server, not in the tab, so a reload finds it again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from litestar import Request, Response, get, post
from litestar.datastructures import UploadFile
from litestar.params import FromPath

from appliance.api.common import ClientGone
from appliance.api.errors import ApiError, bad_request
from appliance.jobs import mapreduce
from appliance.service.chat_format import Turn, text_prompt
from appliance.service.checks import DEFAULTS
from appliance.service.errors import AtConcurrencyLimit, OverQuota, ServiceError, Unavailable
from appliance.service.generation import Generation, off_loop, submit
from appliance.service.identity import Principal
from appliance.service.services import Services
from appliance.store import conversations as convs
from appliance.store.errors import NotFound
from appliance.vocab import FinishReason, Klass
from web import filekind, pdftext, sse
from web.common import base_context, me, services, web_state
from web.plain import plain_refusal
from web.state import Reading

log = logging.getLogger(__name__)
T = TypeVar("T")

READ_ENDPOINT = "/chat/read"
"""The endpoint the reading's requests carry into the ledger."""
MAX_TEXT_CHARS = pdftext.MAX_TEXT_CHARS
SUMMARY_TOKENS = 512
"""The summary's length (at most a quarter of the context): what the answer is read from."""
QUESTION_CHARS = 1000
"""How much of the question the summarising instructions quote."""
BUSY_WAITS_S = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)
"""A part refused as busy (the queue, or the person's other answer) is asked again after
these waits; then the reading fails."""


class ReadingFailed(Exception):
    """The reading cannot go on; the message is said to the person as it is."""


SaveQuestion = Callable[[str], Awaitable[tuple[int, bool]]]
"""Stores the question (text given) and returns (conversation id, made now)."""
StartAnswer = Callable[[int], Awaitable[str]]
"""Starts the answer to the conversation's last question and returns its stream id."""


def needs_reading(fields: dict[str, str], max_chars: int) -> bool:
    """Whether a message and its attached file are too long to send as one message."""
    text, attached = fields.get("message", "").strip(), fields.get("attachment", "").strip()
    return bool(text and attached and len(text) + len(attached) > max_chars)


def check_text(fields: dict[str, str]) -> None:
    """Refuse (400 ``not_text``) an attached file that is not text: a picture or a Word file
    read as text only confuses the model (``web.filekind``)."""
    attached = fields.get("attachment", "")
    why = filekind.refusal(_name(fields), attached) if attached.strip() else None
    if why is not None:
        raise bad_request(why, code=filekind.NOT_TEXT, param="attachment")


def _name(fields: dict[str, str]) -> str:
    return " ".join(fields.get("attachment_name", "").split())[:120] or "file"


def _label(name: str, chars: int) -> str:
    return f"Attached file “{name}” ({chars:,} characters)"


def _instructions(question: str) -> str:
    asked = " ".join(question.split())[:QUESTION_CHARS]
    return (f"Someone will ask this about the document below: “{asked}”\n"
            "Write down what the document says that helps to answer it: its facts, names, "
            "dates and figures.")


async def start(request: Request[Any, Any, Any], question: str, fields: dict[str, str],
                save: SaveQuestion, answer: StartAnswer) -> tuple[str, Reading, int, bool]:
    """Store the question, start reading its file; returns (reading id, the reading, the
    conversation, made now)."""
    name, document = _name(fields), fields.get("attachment", "").strip()
    if len(document) > MAX_TEXT_CHARS:
        raise bad_request(f"The attached file “{name}” is too long: {len(document):,} "
                          f"characters, and the chat reads at most {MAX_TEXT_CHARS:,}.",
                          param="attachment")
    ws, who = web_state(request), me(request)
    if any(r.user_id == who.user_id and r.state == "reading" for r in ws.readings.values()):
        raise ApiError(429, "A file of yours is being read already. Wait for it to finish, "
                       "or stop it, before attaching another.", "rate_limit_error",
                       "max_concurrent")
    cid, created = await save(question)  # the conversation is named after the question
    reading = Reading(who.user_id, cid, name, len(document))
    await anyio.to_thread.run_sync(_store, services(request), reading, (
        f"{question}\n\n{_label(name, len(document))}: too long to read at once, so it is "
        "read in parts first."), False)
    rid = ws.add_reading(reading)
    reading.task = asyncio.get_running_loop().create_task(
        _run(services(request), who, reading, question, document, answer))
    return rid, reading, cid, created


async def _run(svc: Services, who: Principal, r: Reading, question: str, document: str,
               answer: StartAnswer) -> None:
    notes: list[str] = []
    label = _label(r.name, r.chars)

    async def ask(text: str, max_tokens: int) -> str:
        said = await _ask(svc, who, text, max_tokens, r)
        if len(notes) < r.parts:  # the map stages come first, one per part
            notes.append(said.strip())
        return said

    async def progress(done: int, total: int) -> None:
        if r.total == 0:
            r.parts = max(total - 1, 1)
        r.done, r.total, r.share = done, total, 0.0
        r.touch()

    def noted(why: str) -> str:
        read = "".join(f"\n\nPart {i}: {n or '(nothing noted)'}"
                       for i, n in enumerate(notes, 1))
        return (f"{question}\n\n{label}: {why} after {len(notes)} of {r.parts or '?'} "
                f"parts." + (f" Notes on the parts read:{read}" if read else ""))

    log.info("chat: reading a file of %d characters (user_id=%d, conversation %d)",
             r.chars, r.user_id, r.conversation_id)
    summarised = False  # then the question holds the summary, whatever happens next
    try:
        summary = await mapreduce.summarise(
            svc.model.tokenizer, _instructions(question), document, svc.model.ctx_limit,
            min(SUMMARY_TOKENS, svc.model.ctx_limit // 4), ask, progress)
        parts = f"read in {r.parts} parts" if r.parts > 1 else "read first"
        await anyio.to_thread.run_sync(_store, svc, r, f"{question}\n\n{label}, {parts}; "
                                       f"what it says, in short:\n\n{summary.strip() or '(nothing noted)'}", False)
        summarised = True
        r.sid, r.state = await answer(r.conversation_id), "answering"
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()  # Stop: the reading ends here, and what it did is kept
        r.state = "stopped"
        await _finish(svc, r, None if summarised else noted("reading stopped"), stopped=True)
    except (ReadingFailed, ApiError, ServiceError, ValueError) as exc:
        r.state = "failed"
        r.error = exc.message if isinstance(exc, ApiError | ServiceError) else str(exc)
        await _finish(svc, r, None if summarised else noted(f"reading failed ({r.error})"),
                      stopped=False)
    except Exception as exc:
        log.exception("chat: reading a file failed (user_id=%d)", r.user_id)
        r.state, r.error = "failed", f"internal error ({type(exc).__name__})"
        await _finish(svc, r, None if summarised else noted("reading failed"), stopped=False)
    finally:
        r.finished_at = time.monotonic()
        log.info("chat: reading %s after %d of %d stages (user_id=%d)", r.state, r.done,
                 r.total, r.user_id)
        r.touch()


async def _finish(svc: Services, r: Reading, content: str | None, stopped: bool) -> None:
    with anyio.CancelScope(shield=True):
        try:
            await anyio.to_thread.run_sync(_store, svc, r, content, stopped)
        except Exception:  # the daemon is stopping, or the database takes no writes
            log.warning("chat: a stopped reading's notes were not saved (user_id=%d)",
                        r.user_id)


def _store(svc: Services, r: Reading, content: str | None, stopped: bool) -> None:
    """The question with what was read in its file's place (``content``; None: as it is);
    after Stop, also an empty stopped answer (the page shows "Stopped." and Regenerate, as
    for any answer)."""
    try:
        with svc.store.sessions.begin() as s:
            messages = convs.list_messages(s, r.user_id, r.conversation_id)
            question = next((m for m in reversed(messages) if m.role == "user"), None)
            if question is None:
                return
            if content is not None:
                convs.set_content(s, r.user_id, r.conversation_id, question.id, content)
            if stopped:
                convs.add_message(s, r.user_id, r.conversation_id, "assistant", "",
                                  finish_reason=FinishReason.CANCELLED)
    except NotFound:  # the conversation was deleted meanwhile
        pass


async def _ask(svc: Services, who: Principal, text: str, max_tokens: int,
               r: Reading | None = None) -> str:
    """One stage of the reading: the person's ``background`` request."""
    prompt = await off_loop(svc, text_prompt, svc.model.tokenizer, [Turn("user", text)])
    gen: Generation | None = None
    for wait in (*BUSY_WAITS_S, None):
        try:
            gen = await submit(svc, prompt, DEFAULTS, max_tokens, who,
                               Klass.BACKGROUND, READ_ENDPOINT)
            break
        except (AtConcurrencyLimit, Unavailable) as exc:
            if wait is None:
                raise ReadingFailed(exc.message) from None
            await asyncio.sleep(wait)
        except OverQuota as exc:
            refusal = await plain_refusal(svc, who, exc, len(prompt))
            raise ReadingFailed(refusal.message) from None
        except ServiceError as exc:
            raise ReadingFailed(exc.message) from None
    assert gen is not None
    if r is not None:
        r.engine_rid = gen.handle.request.rid
    said, finish = await gen.text()
    if finish.reason is FinishReason.QUOTA:
        raise ReadingFailed("your daily allowance ran out")
    if not finish.reason.answered:
        raise ReadingFailed(f"the model failed ({finish.error or finish.reason})")
    return said


async def until_gone(receive: Any, work: Awaitable[T]) -> T:
    """``work``, cancelled if the client leaves first (``receive``: the ASGI receive of a
    request whose body was read, so its next message is ``http.disconnect``)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, gone):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnected(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


# ---- routes ----
@post("/chat/attachments", status_code=200,
      request_max_body_size=pdftext.MAX_PDF_BYTES + 64 * 1024)
async def attach_pdf(request: Request[Any, Any, Any]) -> Response[Any]:
    """A PDF's text (JSON: name, text, pages), or a 400 saying plainly why not."""
    form = await request.form()
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise bad_request("Choose a PDF file to attach.", param="file")
    name = " ".join((upload.filename or "file.pdf").split())[:120]
    data = await upload.read()
    if not filekind.is_pdf(name, data):  # a picture or a Word file: not text, said so
        why = filekind.refusal(name, data[:filekind.SAMPLE_CHARS].decode("latin-1"))
        raise bad_request(why or f"“{name}” is not a PDF. Attach a PDF here; a text file is "
                          "read by the page itself.", code=filekind.NOT_TEXT, param="file")
    svc = services(request)
    limits = pdftext.Limits(svc.pdf_read_seconds, svc.pdf_read_memory_mb)
    try:
        # in a process of its own, stopped at its limits or when the person leaves
        got = await until_gone(request.receive, pdftext.read(data, name, limits))
    except pdftext.Unreadable as exc:
        raise bad_request(str(exc), param="file") from None
    log.info("chat: a PDF of %d bytes, %d pages, %d characters read (user_id=%d)",
             len(data), got.pages, len(got.text), me(request).user_id)
    return Response({"name": name, "text": got.text, "pages": got.pages})


@get("/chat/readings/{rid:str}")
async def reading_events(request: Request[Any, Any, Any], rid: FromPath[str]) -> Response[Any]:
    """The reading's progress (``progress`` events), then ``done``: the answer's stream,
    or how the reading ended."""
    ws = web_state(request)
    r = ws.readings.get(rid)
    if r is None or r.user_id != me(request).user_id:
        return Response(b"", status_code=204)  # gone, or not yours: stop retrying
    ctx = {**base_context(request), "cid": r.conversation_id, "rid": rid, "r": r}
    return sse.stream(_events(services(request), r, request.app.template_engine, ctx))


PROGRESS_EVERY_S = 1.0
"""How often the page hears how far into a part the reading is, and the time spent."""


def _share(svc: Services, r: Reading) -> float:
    """How much of the part being read is read: its prompt's prefilled share, as the
    dashboard shows it (1 once its notes are being written)."""
    slot = next((s for s in svc.engine.snapshot.slots if s.rid == r.engine_rid), None)
    if slot is None:
        return r.share
    if slot.state == "prefilling" and slot.prompt_tokens:
        return min(slot.prefilled / slot.prompt_tokens, 0.99)
    return 1.0 if slot.state != "queued" else 0.0


async def _events(svc: Services, r: Reading, templates: Any, ctx: dict[str, Any]
                  ) -> AsyncIterator[bytes]:
    while True:
        changed = r.changed
        if r.state != "reading":
            yield sse.event("done", templates.get_template("_reading_end.html").render(
                **ctx, sid=r.sid, prefix=""))
            return
        r.share = _share(svc, r)
        yield sse.event("progress", templates.get_template("_reading_progress.html")
                        .render(**ctx))
        with anyio.move_on_after(PROGRESS_EVERY_S):
            await changed.wait()


@post("/chat/readings/{rid:str}/stop", status_code=204)
async def stop_reading(request: Request[Any, Any, Any], rid: FromPath[str]) -> None:
    """Stop a reading: the part being read is cancelled in the engine, and the notes on
    the parts read so far are kept with the question. Nothing happens to one that is gone
    (or not yours)."""
    r = web_state(request).readings.get(rid)
    if r is not None and r.user_id == me(request).user_id and r.state == "reading" and r.task:
        r.task.cancel()


ROUTES = [attach_pdf, reading_events, stop_reading]
