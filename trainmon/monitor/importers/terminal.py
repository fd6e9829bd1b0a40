"""Text as a terminal showed it: decoding captured stdout, and finding a text log's lines anywhere in it.

Trainer stdout is often captured from a terminal (``script``, ``tee`` under a TTY, a notebook, a
SLURM job with ``--pty``) and carries what the terminal interpreted rather than printed: colour and
cursor escapes (CSI ``ESC [ ... m`` / ``ESC [ 1A`` / ``ESC [ 2K``, keystrokes such as ``ESC [ B``),
hyperlinks and titles (OSC ``ESC ] ... BEL`` or ``ESC ] ... ESC \\``), progress bars redrawn in place
with carriage returns, backspaces, and keystrokes the terminal echoed in caret notation in front of
a line (``^[[B`` for the down arrow, ``^C``: printed text, not escapes). Every text importer judges
and parses a line after :func:`clean_line`: the escapes and echoed keystrokes removed, each backspace
applied, and a line redrawn with ``\\r`` split
into the states it showed (a trainer that prints ``\\rstep N loss X`` keeps every step; a progress
bar's states are lines no parser reads).

A file is *binary* only on binary evidence (:func:`binary_evidence`): NUL bytes scattered through it,
or many bytes that are neither UTF-8 nor text controls once the escapes are gone. Megabytes of
progress bars and escape codes at the start of a log are text, and so is a log with a *hole*: a run
of NULs a block long or more (a node that crashed while the file grew, a preallocated or truncated
file written again) is a gap in the text, not binary content. A terminal ignores NUL, and so does
:func:`clean_text`.

:func:`text_chunks` gives a file's text in bounded pieces so a format can be recognised by its lines
wherever they are (a Megatron job's first ``iteration`` line after 900 KB of shell trace, a nanochat
run's first ``step`` after 1 MB of ``uv`` progress bars): the first 64 KiB, then 1 MiB pieces up to
:data:`SCAN_CONTIGUOUS`, then a few pieces spread evenly over the rest of the file and its last
piece (training lines, once they start, recur to the end of a log). The cost is bounded whatever the
file's size.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "CONTROL_SEQUENCE",
    "SCAN_CONTIGUOUS",
    "binary_evidence",
    "clean_line",
    "clean_text",
    "drop_echoed",
    "terminal_lines",
    "text_chunks",
]

CONTROL_SEQUENCE = re.compile(
    r"\x1b(?:"
    r"\[[0-?]*[ -/]*[@-~]"  # CSI: colours, cursor moves, erase line, keystrokes (ESC [ B)
    r"|\][^\x07\x1b]*(?:\x07|\x1b\\)?"  # OSC: hyperlinks, window titles (ended by BEL or ST)
    r"|[PX^_][^\x1b]*(?:\x1b\\)?"  # DCS, SOS, PM, APC strings
    r"|O[@-~]"  # SS3: keypad and arrow keys in application mode
    r"|[()*+][ -~]"  # character set selection
    r"|[ -/]*[0-~]"  # any other two-character escape (ESC 7, ESC =, ESC c)
    r")?"  # a lone ESC at the end of a line
)
"""An ANSI/VT escape sequence (ECMA-48), matched whole so no parameter bytes are left behind."""

# Keystrokes a terminal echoed in caret notation (ESC shown as ``^[``): cursor keys ``^[[B``, ``^[OA``,
# ``^[c``, and control characters such as ``^C``. Only removed in front of a line.
_ECHOED = re.compile(r"^(?:\^\[(?:\[[0-?]*[ -/]*[@-~]|O[@-~]|[@-~])|\^[@-Z\\\]^_?])+")
_BACKSPACED = re.compile(r"[^\x08\n]\x08")
# What no text holds once escapes are gone: C0 controls other than tab, line breaks, form feed and
# backspace, DEL, and the replacement character of undecodable bytes.
_NOT_TEXT = re.compile(r"[\x00-\x07\x0e-\x1f\x7f\ufffd]")
# A hole: NULs a disk block long or more, or at a piece's edges (a hole cut by the piece boundary).
_HOLE = re.compile(rb"\x00{512,}|^\x00+|\x00+$")

HEAD = 64 * 1024
"""The first piece: what every reader judged before scanning further (a file recognised in it is
read exactly as before)."""
CHUNK = 1024 * 1024
SCAN_CONTIGUOUS = 8 * 1024 * 1024
"""Read from the start of the file up to here (9x the longest preamble seen, 924 KB)."""
SCAN_PROBES = 8
"""Then this many pieces spread over the rest of the file, the last piece included."""


def clean_text(text: str) -> str:
    """``text`` without escape sequences and NULs, with backspaces applied (line breaks kept)."""
    if "\x00" in text:
        text = text.replace("\x00", "")
    if "\x1b" in text:
        text = CONTROL_SEQUENCE.sub("", text)
    if "\x08" in text:
        while True:
            shorter = _BACKSPACED.sub("", text)
            if shorter == text:
                break
            text = shorter
        text = text.replace("\x08", "")
    return text


def clean_line(raw: str) -> list[str]:
    """What the terminal showed for one physical line: its non-blank states, each stripped.

    Usually one string; a line redrawn with carriage returns gives each state it showed, in order.
    """
    raw = raw.rstrip("\r\n")
    if "\x1b" in raw or "\x08" in raw or "\x00" in raw:
        raw = clean_text(raw)
    states = [raw] if "\r" not in raw else raw.split("\r")
    return [s for s in map(drop_echoed, states) if s]


def drop_echoed(line: str) -> str:
    """``line`` stripped, without the keystrokes a terminal echoed in caret notation in front of it."""
    line = line.strip()
    return _ECHOED.sub("", line).strip() if line.startswith("^") else line


def terminal_lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of every non-blank line state of a text file, cleaned (:func:`clean_line`).

    Lines are split at ``\\n`` only (a ``\\r`` is a redraw inside a line, not a new physical line, so
    line numbers match an editor's); undecodable bytes become U+FFFD.
    """
    with open(path, encoding="utf-8", errors="replace", newline="\n") as f:
        for n, raw in enumerate(f, 1):
            for line in clean_line(raw):
                yield n, line


def binary_evidence(raw: bytes) -> bool:
    """Bytes that no text log holds: NULs outside a hole, nothing but NULs, or over 10 % of the
    characters undecodable as UTF-8 or control characters once escape sequences are removed (a
    Latin-1 log has a few percent at most)."""
    if _scattered_nuls(raw) or (raw and not raw.strip(b"\0")):
        return True
    return _mostly_not_text(clean_text(raw.decode("utf-8", errors="replace")))


def _scattered_nuls(raw: bytes) -> bool:
    return b"\0" in raw and b"\0" in _HOLE.sub(b"", raw)


def _mostly_not_text(text: str) -> bool:
    return bool(text) and len(_NOT_TEXT.findall(text)) > 0.1 * len(text)


def _whole_lines(data: bytes, *, cut_start: bool, cut_end: bool) -> bytes:
    """``data`` without the partial line at its start (a piece read from the middle) or its end."""
    if cut_start:
        nl = data.find(b"\n")
        data = data[nl + 1 :] if nl >= 0 else b""
    if cut_end:
        nl = data.rfind(b"\n")
        data = data[: nl + 1] if nl >= 0 else b""
    return data


def text_chunks(path: Path) -> Iterator[str]:
    """The file's text in bounded pieces of whole lines, cleaned (:func:`clean_text`), in file order.

    Stops at the first piece with binary evidence. Lines are cut at piece boundaries only where a
    piece is read from the middle of the file; a line longer than a piece is not seen whole.
    """
    try:
        size = os.stat(path).st_size
    except OSError:
        return
    with open(path, "rb") as f:
        pos = 0
        carry = b""
        while pos < min(size, SCAN_CONTIGUOUS):
            data = f.read(HEAD if pos == 0 else CHUNK)
            if not data:
                return
            pos += len(data)
            if not data.strip(b"\0"):
                continue  # a hole: the text goes on after it
            if _scattered_nuls(data):
                return
            data = carry + data
            piece = data if pos >= size else _whole_lines(data, cut_start=False, cut_end=True)
            carry = data[len(piece) :][-CHUNK:]
            text = clean_text(piece.decode("utf-8", errors="replace"))
            if _mostly_not_text(text):
                return
            yield text
        rest = size - pos
        if rest <= 0:
            return
        probes = min(SCAN_PROBES, max(1, rest // CHUNK))
        for k in range(1, probes + 1):
            start = pos + (rest - CHUNK) * k // probes if rest > CHUNK else pos
            f.seek(max(pos, start))
            data = f.read(CHUNK)
            if not data:
                return
            if not data.strip(b"\0"):
                continue
            if _scattered_nuls(data):
                return
            piece = _whole_lines(data, cut_start=True, cut_end=f.tell() < size)
            text = clean_text(piece.decode("utf-8", errors="replace"))
            if _mostly_not_text(text):
                return
            yield text
