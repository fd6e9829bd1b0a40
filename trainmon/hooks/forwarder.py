"""One request per node, not per rank: the transports of a node hand their batches to one forwarder.

A collector pays a fixed cost per request (~400 us of CPU at 1 step/s per rank, against ~300 us per
step stored: ``bench/README.md``, "Rank sweep"), so a node of 8 ranks that posts once per flush costs
it about half as much as 8 ranks posting each. The transports of one node, one collector URL, token
and launch (``trainmon.hooks.launch``) meet on a Unix socket in Linux's abstract namespace (no file,
so nothing stale is left behind by a crash); the first to bind it forwards for the others from a
thread of its own, and sends its own batches through it too, like any other rank.

Each rank keeps its stream, sequence numbers, queue and spool: a client sends a frame holding its
batch's JSON lines and waits, on its sender thread (never the training thread), for the relayed
answer. The forwarder gathers the frames that arrive within ``linger`` seconds (or until every
connected client has sent one: their ticks are aligned, see ``NodeLink.phase``), posts them as one
request and answers each client with the collector's status and body, so each acts on it as if it had
posted itself: findings for ``on_critical`` (``hooks.policy``), ``stored_as``, a failure to spool and
retry. A rank drops nothing until the collector acknowledged it; a batch posted by a forwarder that died
before answering is posted again by its rank, and the collector's (stream, seq) deduplication stores it
once. When the forwarder is gone (its process crashed or ended first) the next send of each client
finds the socket unbound, posts directly, and one of them binds it and forwards from then on; a
forwarder that does not answer within a request's budget twice in a row (a stopped process) is left
alone for ``_SHUN_S`` seconds, the ranks posting directly meanwhile.

Standard library only: ``trainmon.hooks.transport`` imports this module and lends it its HTTP poster.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import logging
import os
import selectors
import socket
import struct
import sys
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from trainmon.wire import MAX_EVENTS_PER_BATCH, VERSION

__all__ = ["ForwarderGone", "NodeLink", "blames_the_batch", "forwarding", "node_address"]

log = logging.getLogger("trainmon.forwarder")

# (body, query, deadline on the monotonic clock) -> (HTTP status, body); raises OSError when undelivered.
Poster = Callable[[bytes, str, float], tuple[int, bytes]]

# Client -> forwarder: length of the rest, the request's budget in seconds, query length, line count;
# then the query (``hooks.policy``'s findings question) and the batch's JSON lines joined by commas.
_ASK = struct.Struct("!IdHI")
# Forwarder -> client: length of the body, HTTP status (0: the collector could not be reached, the body
# says why); then the collector's body.
_ANSWER = struct.Struct("!IH")
_MAX_FRAME = 64 << 20  # a client that announces more is broken: dropped
_MAX_BODY = 4 << 20  # bytes of events in one merged request (the collector's default limit is 8 MiB)
# A forwarder's request ends this long before its clients' budgets, so that its answer is in time: the
# watchdog ends a request up to 0.2 s late (``transport._Watchdog``), and the thread waits for the GIL.
_MARGIN_S = 0.5
_SHUN_S = 30.0  # a forwarder that let requests' budgets pass (_SHUN_AFTER in a row) is not asked for this long
_SHUN_AFTER = 2
LINGER_FRACTION = 0.2  # of the flush interval: how long a forwarder waits for the other ranks' frames


def forwarding(setting: bool | None, env: Mapping[str, str] | None = None) -> bool:
    """Whether a transport forwards through its node's forwarder.

    ``setting`` (the ``Transport``/``TrainMonitor`` argument) wins, then ``$TRAINMON_FORWARD`` (``1`` or
    ``0``); by default only where it pays: several ranks on this node (``$LOCAL_WORLD_SIZE`` > 1, set by
    torchrun) on Linux. Raises ``ValueError`` on a setting it cannot honour."""
    env = os.environ if env is None else env
    if setting is None:
        given = env.get("TRAINMON_FORWARD", "").strip()
        if given not in ("", "0", "1"):
            raise ValueError(f"TRAINMON_FORWARD: 1 (forward through the node's forwarder) or 0, got {given!r}")
        if given:
            setting = given == "1"
    linux = sys.platform.startswith("linux")
    if setting is None:
        local = env.get("LOCAL_WORLD_SIZE", "1")
        return linux and local.isdigit() and int(local) > 1
    if setting and not linux:
        raise ValueError("forwarding needs Linux (abstract Unix sockets); set TRAINMON_FORWARD=0 or forward=False")
    return setting


def node_address(url: str, token: str | None, launch: str | None) -> bytes:
    """The abstract socket where the transports of this node, collector, token and launch meet."""
    key = "\n".join((url, token or "", launch or "", str(os.getuid())))
    return b"\0trainmon-forward-" + hashlib.sha256(key.encode()).hexdigest()[:24].encode()


def blames_the_batch(status: int) -> bool:
    """Whether the collector refused a request for what it holds (too large, malformed), not for who sent it
    (401/403) or for being busy (408, 429): resending the same events can never succeed."""
    return 400 <= status < 500 and status not in (401, 403, 408, 429)


class ForwarderGone(OSError):
    """The forwarder closed the connection before answering: it is gone (or the request was aborted)."""


def _peer_uid(sock: socket.socket) -> int:
    """The user of the process at the other end (another user could bind the name first, or connect)."""
    _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return int(uid)


def _recv_exactly(sock: socket.socket, n: int, until: float) -> bytes:
    data = bytearray()
    while len(data) < n:
        left = until - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        sock.settimeout(left)
        chunk = sock.recv(min(n - len(data), 1 << 20))
        if not chunk:
            raise ForwarderGone("the node's forwarder closed the connection")
        data += chunk
    return bytes(data)


class NodeLink:
    """A transport's way to its node's forwarder, which it becomes when there is none.

    Used by one sender thread (``abort`` by any). ``poster`` makes the HTTP poster of a forwarder, called
    once this process takes the role on."""

    def __init__(self, address: bytes, poster: Callable[[], Poster], linger: float) -> None:
        self.address = address
        self._poster = poster
        self._linger = linger
        self._sock: socket.socket | None = None
        self._server: _Server | None = None
        self._shun_until = 0.0
        self._late = 0  # requests in a row that the forwarder did not answer in time

    @property
    def serving(self) -> bool:
        """This process forwards for its node."""
        return self._server is not None and self._server.alive

    @property
    def phase(self) -> float:
        """Where in each flush interval (a fraction) the node's transports tick: one instant for all of them,
        so their frames meet in one request; another for another node or job on the same host."""
        return int.from_bytes(hashlib.sha256(self.address).digest()[:4], "big") / 2**32

    def exchange(self, lines: list[str], query: str, until: float) -> tuple[int, bytes] | None:
        """The collector's (status, body) for ``lines``, through the forwarder; None: there is none to use now,
        post directly. Raises ``OSError`` when the forwarder could not deliver, did not answer by ``until``
        (monotonic), or went away mid-request (``ForwarderGone``: the caller posts directly if its budget
        allows, and the next call finds or becomes the next forwarder)."""
        if time.monotonic() < self._shun_until:
            return None
        sock = self._sock or self._connect()
        if sock is None:
            return None
        q, events = query.encode(), ",".join(lines).encode()
        ask = _ASK.pack(_ASK.size - 4 + len(q) + len(events), until - time.monotonic(), len(q), len(lines))
        try:
            sock.settimeout(max(1e-3, until - time.monotonic()))
            sock.sendall(ask + q + events)
            length, status = _ANSWER.unpack(_recv_exactly(sock, _ANSWER.size, until))
            body = _recv_exactly(sock, length, until)
        except TimeoutError as exc:
            self._drop()
            self._late += 1
            if self._late >= _SHUN_AFTER:
                self._late = 0
                self._shun_until = time.monotonic() + _SHUN_S
                log.warning("trainmon: the node's forwarder does not answer; posting directly for %.0fs", _SHUN_S)
            raise OSError(f"the node's forwarder did not answer in time: {exc}") from exc
        except OSError as exc:
            self._drop()
            raise ForwarderGone(f"the node's forwarder went away: {exc}") from exc
        self._late = 0
        if status == 0:
            raise OSError(body.decode("utf-8", "replace"))
        return status, body

    def abort(self) -> None:
        """Fail the exchange in flight (from any thread)."""
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Leave the node: the next transport to send binds the address and forwards from then on."""
        self._drop()
        if self._server is not None:
            self._server.stop()
            self._server = None

    def _drop(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def _connect(self) -> socket.socket | None:
        if self._server is not None and not self._server.alive:  # its thread failed: the role is open again
            self._server = None
        sock = self._dial()
        if sock is None and self._server is None and self._take_over():
            sock = self._dial()
        self._sock = sock
        return sock

    def _dial(self) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.address)
            if _peer_uid(sock) != os.getuid():
                raise PermissionError("the node's forwarder address is held by another user")
        except PermissionError as exc:
            sock.close()
            self._shun_until = time.monotonic() + _SHUN_S
            log.warning("trainmon: %s; posting directly", exc)
            return None
        except OSError:  # nobody listens (refused), or the backlog is full: post directly this time
            sock.close()
            return None
        return sock

    def _take_over(self) -> bool:
        """Bind the address and serve it (True), or find that another process just did (True: dial again)."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(self.address)
            listener.listen(128)
        except OSError as exc:
            listener.close()
            return exc.errno == errno.EADDRINUSE  # another rank is the forwarder now: dial it
        self._server = _Server(listener, self._poster(), self._linger)
        log.info("trainmon: forwarding this node's events to the collector (pid %d)", os.getpid())
        return True


@dataclass(slots=True)
class _Frame:
    """One client's batch waiting to be posted."""

    conn: socket.socket
    base: str  # its query without ``after``
    after: int | None  # the findings revision it asked from (None: it asked for none, or from now)
    lines: int
    events: bytes
    until: float


def _split_after(query: str) -> tuple[str, int | None]:
    """``query`` without its ``after=REV``, and REV: frames asking the same question from different revisions
    share a request asking from the earliest (a rank receives findings it already had; ``StopPolicy`` acts on
    each once)."""
    pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
    after = [v for k, v in pairs if k == "after"]
    if len(after) == 1 and after[0].isdigit():
        return urllib.parse.urlencode([(k, v) for k, v in pairs if k != "after"]), int(after[0])
    return query, None


def _group_key(frame: _Frame) -> tuple[str, bool]:
    return frame.base, frame.after is not None


def _forget_in_child(ref: weakref.ReferenceType[_Server]) -> None:
    server = ref()
    if server is not None:
        server.forget()


class _Server:
    """The forwarder: one thread serving the node's clients on the bound ``listener``."""

    def __init__(self, listener: socket.socket, post: Poster, linger: float) -> None:
        self._listener = listener
        self._post = post
        self._linger = linger
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(listener, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._clients: dict[socket.socket, bytearray] = {}
        self._pending: list[_Frame] = []
        self._first = 0.0  # when the oldest pending frame arrived
        self.alive = True
        # A forked child (a DataLoader worker) must not keep the address bound once this process is gone.
        os.register_at_fork(after_in_child=functools.partial(_forget_in_child, weakref.ref(self)))
        self._thread = threading.Thread(target=self._run, name="trainmon-forwarder", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 0.5) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(timeout)

    def forget(self) -> None:
        """In a forked child: close the inherited sockets (the serving thread is not there)."""
        self.alive = False
        for sock in (self._listener, self._wake_r, self._wake_w, *self._clients):
            sock.close()

    def _run(self) -> None:
        try:
            while True:
                timeout = None
                if self._pending:
                    timeout = max(0.0, self._first + self._linger - time.monotonic())
                for key, _ in self._sel.select(timeout):
                    if key.fileobj is self._wake_r:
                        return
                    if key.fileobj is self._listener:
                        self._accept()
                    else:
                        self._read(key.fileobj)  # type: ignore[arg-type]
                if self._pending and (
                    time.monotonic() >= self._first + self._linger
                    or len({f.conn for f in self._pending}) == len(self._clients)
                ):
                    self._flush()
        except Exception:  # the clients find the address unbound and post directly
            log.exception("trainmon forwarder failed; the node's ranks post directly")
        finally:
            self.alive = False
            self._listener.close()  # first: another rank can bind the address at once
            for conn in list(self._clients):
                conn.close()
            self._sel.close()
            self._wake_r.close()
            self._wake_w.close()

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        if _peer_uid(conn) != os.getuid():
            conn.close()
            return
        conn.settimeout(1.0)  # answers are small; a client that stopped reading is dropped
        self._clients[conn] = bytearray()
        self._sel.register(conn, selectors.EVENT_READ)

    def _drop(self, conn: socket.socket) -> None:
        self._sel.unregister(conn)
        del self._clients[conn]
        conn.close()
        self._pending = [f for f in self._pending if f.conn is not conn]

    def _read(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(1 << 20)
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        buf = self._clients[conn]
        buf += data
        while len(buf) >= 4:
            (length,) = struct.unpack_from("!I", buf)
            if length > _MAX_FRAME or length < _ASK.size - 4:
                self._drop(conn)
                return
            if len(buf) < 4 + length:
                return
            _, budget, qlen, lines = _ASK.unpack_from(buf)
            query = bytes(buf[_ASK.size : _ASK.size + qlen]).decode("utf-8", "replace")
            events = bytes(buf[_ASK.size + qlen : 4 + length])
            del buf[: 4 + length]
            now = time.monotonic()
            if not self._pending:
                self._first = now
            base, after = _split_after(query)
            self._pending.append(_Frame(conn, base, after, lines, events, now + budget))

    def _flush(self) -> None:
        frames, self._pending = self._pending, []
        groups: dict[tuple[str, bool], list[_Frame]] = {}
        for frame in frames:
            groups.setdefault(_group_key(frame), []).append(frame)
        for group in groups.values():
            chunk: list[_Frame] = []
            lines = size = 0
            for frame in group:
                if chunk and (lines + frame.lines > MAX_EVENTS_PER_BATCH or size + len(frame.events) > _MAX_BODY):
                    self._forward(chunk)
                    chunk, lines, size = [], 0, 0
                chunk.append(frame)
                lines += frame.lines
                size += len(frame.events)
            self._forward(chunk)

    def _forward(self, chunk: list[_Frame]) -> None:
        """Post ``chunk`` as one request and answer each of its clients; a refusal that blames the batch is
        retried by halves, so only the client whose events the collector refuses gets the refusal."""
        afters = [f.after for f in chunk if f.after is not None]
        query = chunk[0].base
        if afters:
            query += ("&" if query else "") + f"after={min(afters)}"
        body = b'{"version":%d,"events":[%b]}' % (VERSION, b",".join(f.events for f in chunk))
        deadline = min(f.until for f in chunk) - _MARGIN_S
        try:
            if deadline <= time.monotonic():  # behind another request of this round: its clients gave up
                raise OSError("the node's forwarder had no time left for this batch")
            status, text = self._post(body, query, deadline)
        except OSError as exc:
            status, text = 0, str(exc).encode()
        if len(chunk) > 1 and blames_the_batch(status):
            half = len(chunk) // 2
            self._forward(chunk[:half])
            self._forward(chunk[half:])
            return
        answer = _ANSWER.pack(len(text), status) + text
        for frame in chunk:
            if frame.conn not in self._clients:
                continue  # gone meanwhile: it posts again itself
            try:
                frame.conn.sendall(answer)
            except OSError:
                self._drop(frame.conn)
