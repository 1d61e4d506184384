"""PDF files for the attachment tests, written by hand (no PDF tool needed to make them).

``text_pdf`` makes a real PDF whose pages carry a text layer (Helvetica, one line per
``Tj``); ``scanned_pdf`` one whose pages have no text at all, as a scanner's pictures do.
"""

from __future__ import annotations

import io


def _escape(line: str) -> str:
    return line.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")


def _pdf(streams: list[bytes]) -> bytes:
    n = len(streams)
    # objects: 1 catalog, 2 pages, 3 font, then per page: the page and its content stream
    kids = " ".join(f"{4 + 2 * i} 0 R" for i in range(n))
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>",
               f"<< /Type /Pages /Kids [{kids}] /Count {n} >>".encode(),
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    for i, stream in enumerate(streams):
        objects.append(f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
                       f"/Resources << /Font << /F1 3 0 R >> >> /Contents {5 + 2 * i} 0 R >>"
                       .encode())
        objects.append(f"<< /Length {len(stream)} >>\nstream\n".encode() + stream
                       + b"\nendstream")
    return _write(objects)


def text_pdf(pages: list[list[str]]) -> bytes:
    """A PDF with one page per item, each line of it set as text."""
    streams = []
    for lines in pages:
        ops = ["BT", "/F1 11 Tf", "14 TL", "50 750 Td"]
        for line in lines:
            ops.append(f"({_escape(line)}) Tj T*")
        ops.append("ET")
        streams.append("\n".join(ops).encode("latin-1"))
    return _pdf(streams)


def scanned_pdf(pages: int = 2) -> bytes:
    """Pages with only drawing on them (no text layer), like a scan's."""
    return _pdf([b"0.5 g 50 50 500 700 re f" for _ in range(pages)])


def locked_pdf(lines: list[str], password: str = "secret") -> bytes:
    """A text PDF that opens only with ``password`` (RC4, which pypdf reads without extras)."""
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(text_pdf([lines]))))
    writer.encrypt(user_password=password, owner_password="owner", algorithm="RC4-128")
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def stalling_pdf(pages: int = 300, operators: int = 200_000) -> bytes:
    """A small file that is slow to read: every page shares one compressed content stream
    of ``operators`` text operators (the attack of issue 52's D13: 55 KB, hours of pypdf)."""
    import zlib

    stream = zlib.compress(b"BT /F1 11 Tf " + b"(a) Tj 1 0 Td " * operators + b"ET", 9)
    kids = " ".join(f"{5 + i} 0 R" for i in range(pages))
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>",
               f"<< /Type /Pages /Kids [{kids}] /Count {pages} >>".encode(),
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
               f"<< /Length {len(stream)} /Filter /FlateDecode >>\nstream\n".encode() + stream
               + b"\nendstream"]
    objects += [b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
                b"/Resources << /Font << /F1 3 0 R >> >> /Contents 4 0 R >>"] * pages
    return _write(objects)


def _write(objects: list[bytes]) -> bytes:
    """The file: the numbered objects (the first the catalog), their cross-reference table
    and the trailer."""
    out = io.BytesIO()
    out.write(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(out.tell())
        out.write(f"{number} 0 obj\n".encode() + body + b"\nendobj\n")
    xref = out.tell()
    out.write(f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode())
    for offset in offsets:
        out.write(f"{offset:010d} 00000 n \n".encode())
    out.write(f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n"
              .encode())
    return out.getvalue()
