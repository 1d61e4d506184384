"""A small local web site for url jobs: an Atom feed, an HTML page, redirects and a webhook
receiver, on 127.0.0.1 (stopped with ``close``)."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ENTRY = """<entry><id>urn:item:{n}</id><title>Garden news {n}</title>
<updated>2026-11-{n:02d}T07:00:00Z</updated><link href="http://example.invalid/{n}"/>
<summary type="html">&lt;p&gt;Item {n}: the tomatoes in bed {n} need water.&lt;/p&gt;</summary>
</entry>"""

PAGE = """<!doctype html><html><head><title>Village notice</title></head><body>
<nav><a href="/">Home</a> <a href="/more">More</a></nav>
<article><h1>Bin collection moves to Thursday</h1>
<p>From next week the bins are collected on Thursday morning instead of Monday. Put them out
by seven. Garden waste goes in the green bin; glass in the blue box.</p></article>
<footer>© the village</footer></body></html>"""


@dataclass
class Site:
    server: ThreadingHTTPServer
    thread: threading.Thread
    items: list[int] = field(default_factory=lambda: [1, 2])
    hooks: list[dict[str, Any]] = field(default_factory=list)
    redirect_to: str = ""
    hook_failures: int = 0
    """The webhook answers 500 this many times before it accepts."""
    seen: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    """(path, headers) of every GET, in order."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def start_site() -> Site:
    site: Site

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_: Any) -> None:
            pass

        def _send(self, status: int, ctype: str, body: bytes,
                  headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802
            site.seen.append((self.path, dict(self.headers.items())))
            if self.path == "/feed.atom":
                entries = "".join(ENTRY.format(n=n) for n in site.items)
                body = ('<?xml version="1.0" encoding="utf-8"?>'
                        '<feed xmlns="http://www.w3.org/2005/Atom"><title>Garden club</title>'
                        f'<id>urn:feed</id><updated>2026-11-30T07:00:00Z</updated>{entries}'
                        '</feed>').encode()
                self._send(200, "application/atom+xml", body)
            elif self.path == "/page.html":
                self._send(200, "text/html; charset=utf-8", PAGE.encode())
            elif self.path == "/redirect":
                self._send(302, "text/plain", b"", {"Location": site.redirect_to})
            elif self.path == "/auth":
                ok = self.headers.get("Authorization") == "Bearer ha-token"
                self._send(200 if ok else 401, "application/json",
                           json.dumps([{"name": "Kitchen light", "state": "on"}]).encode())
            elif self.path == "/huge":
                self._send(200, "text/plain", b"x" * (2 << 20))
            else:
                self._send(404, "text/plain", b"not here")

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length") or 0)
            data = self.rfile.read(length)
            if site.hook_failures > 0:
                site.hook_failures -= 1
                self._send(500, "text/plain", b"try again")
                return
            site.hooks.append(json.loads(data))
            self._send(200, "application/json", b"{}")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    site = Site(server, thread)
    thread.start()
    return site
