"""A shaped link: an HTTP/1.1 proxy on 127.0.0.1 in front of a local S3 server (moto) that
adds per-request latency, caps bandwidth per connection and in total, and counts requests.

A test tool (tests and ``deltastore bench --link``), not a general proxy: it forwards plain
HTTP/1.1 requests with ``Content-Length`` or chunked bodies, one upstream connection per client
connection, and answers ``Expect: 100-continue`` itself. Every request waits ``latency_s``
before it is forwarded (one round trip of the modelled link); then its body and the response's
are streamed, each direction paced by a token bucket per connection (``conn_bits_per_s``) and
one shared by all connections (``total_bits_per_s``; a link is full duplex, so uploads and
downloads each have their own).

Requests are counted where the server sees them (method, path and query, start and end
times); :meth:`ShapedLink.critical_path` gives the longest chain of requests each of which
started after the previous one ended: the sequential round trips an operation paid.

Runs its event loop on a daemon thread; the methods are thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

from deltastore.store.counting import critical_path


@dataclass(frozen=True)
class LinkProfile:
    """Latency per request (seconds) and bandwidth caps (bits per second)."""

    name: str
    latency_s: float
    conn_bits_per_s: float
    total_bits_per_s: float


#: The presets of ``deltastore bench --link``.
LINKS: dict[str, LinkProfile] = {
    "lan": LinkProfile("lan", 0.001, 10e9, 10e9),
    "region": LinkProfile("region", 0.020, 2e9, 2e9),
    "cross-region": LinkProfile("cross-region", 0.060, 1e9, 1e9),
}


@dataclass(frozen=True)
class Request:
    """One request as the server side of the link saw it (times: ``time.monotonic()``)."""

    method: str
    target: str
    start: float
    end: float


class _Bucket:
    """A token bucket in bytes per second: pacing, with a burst of 10 ms of bytes (at least
    64 KiB) so that a sleep that overshoots by a timer tick is made up, not lost."""

    def __init__(self, bits_per_s: float) -> None:
        self.rate = bits_per_s / 8.0
        self.burst = max(65536.0, self.rate * 0.010) / self.rate  # seconds of credit
        self.next = time.monotonic()

    def delay(self, nbytes: int) -> float:
        """Seconds to wait before the next ``nbytes`` leave (0: send now)."""
        now = time.monotonic()
        self.next = max(self.next, now - self.burst) + nbytes / self.rate
        return max(0.0, self.next - now)


@dataclass
class ShapedLink:
    """``with ShapedLink(upstream_port, LINKS["cross-region"]) as link:`` serves
    ``link.endpoint`` (``http://127.0.0.1:<port>``)."""

    upstream_port: int
    profile: LinkProfile
    upstream_host: str = "127.0.0.1"
    requests: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shaped-link", daemon=True)
        self._down = _Bucket(self.profile.total_bits_per_s)  # every connection's responses
        self._up = _Bucket(self.profile.total_bits_per_s)  # every connection's request bodies
        self.port = 0

    # --- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> ShapedLink:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the shaped link did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = int(server.sockets[0].getsockname()[1])
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()
            with contextlib.suppress(Exception):
                self._loop.run_until_complete(server.wait_closed())
            self._loop.close()

    # --- counting -----------------------------------------------------------------------

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()

    def snapshot(self) -> list[Request]:
        with self._lock:
            return list(self.requests)

    @contextlib.contextmanager
    def counting(self) -> Iterator[list[Request]]:
        """Collect the requests made inside the block (the list fills in on exit): those the
        link received after the block began."""
        t0 = time.monotonic()
        out: list[Request] = []
        try:
            yield out
        finally:
            time.sleep(0.01)  # the last response's bookkeeping
            out.extend(r for r in self.snapshot() if r.start >= t0)

    @staticmethod
    def critical_path(requests: list[Request]) -> int:
        """The longest chain of requests each starting after the previous one ended
        (:func:`deltastore.store.counting.critical_path`)."""
        return critical_path(requests)

    # --- forwarding ---------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r: asyncio.StreamReader | None = None
        up_w: asyncio.StreamWriter | None = None
        down = _Bucket(self.profile.conn_bits_per_s)
        up = _Bucket(self.profile.conn_bits_per_s)
        try:
            while True:
                head = await _read_head(reader)
                if head is None:
                    return
                start = time.monotonic()
                lines = head.split(b"\r\n")
                method, target, _ = lines[0].decode("latin-1").split(" ", 2)
                headers = _headers(lines[1:])
                if headers.get("expect", "").lower() == "100-continue":
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    await writer.drain()
                    lines = [ln for ln in lines if not ln.lower().startswith(b"expect:")]
                    head = b"\r\n".join(lines)
                await asyncio.sleep(self.profile.latency_s)
                if up_w is None:
                    up_r, up_w = await asyncio.open_connection(
                        self.upstream_host, self.upstream_port
                    )
                if up_r is None:  # pragma: no cover - set together with up_w
                    return
                up_w.write(head + b"\r\n\r\n")
                if "content-length" in headers or "chunked" in headers.get(
                    "transfer-encoding", ""
                ):  # a body only with one of these (RFC 9112, 6.3)
                    await self._relay(_body_chunks(reader, headers), up_w, up, self._up)
                await up_w.drain()
                resp_head = await _read_head(up_r)
                if resp_head is None:
                    return
                rlines = resp_head.split(b"\r\n")
                status = int(rlines[0].split(b" ", 2)[1])
                rheaders = _headers(rlines[1:])
                writer.write(resp_head + b"\r\n\r\n")
                no_body = method == "HEAD" or status in (204, 304) or 100 <= status < 200
                until_close = not no_body and (
                    "content-length" not in rheaders
                    and "chunked" not in rheaders.get("transfer-encoding", "")
                )
                if not no_body:
                    await self._relay(_body_chunks(up_r, rheaders), writer, down, self._down)
                await writer.drain()
                with self._lock:
                    self.requests.append(Request(method, target, start, time.monotonic()))
                if until_close or rheaders.get("connection", "").lower() == "close":
                    return
        except (ConnectionError, asyncio.IncompleteReadError, ValueError, IndexError):
            return
        finally:
            for w in (writer, up_w):
                if w is not None:
                    with contextlib.suppress(Exception):
                        w.close()

    @staticmethod
    async def _relay(
        chunks: AsyncIterator[bytes], out: asyncio.StreamWriter, conn: _Bucket, total: _Bucket
    ) -> None:
        """Write ``chunks`` to ``out``, paced by the connection's and the link's bucket."""
        async for chunk in chunks:
            out.write(chunk)
            await asyncio.sleep(max(conn.delay(len(chunk)), total.delay(len(chunk))))
            await out.drain()


async def _read_head(reader: asyncio.StreamReader) -> bytes | None:
    try:
        data = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    return data[:-4]


def _headers(lines: list[bytes]) -> dict[str, str]:
    out: dict[str, str] = {}
    for ln in lines:
        name, _, value = ln.decode("latin-1").partition(":")
        out[name.strip().lower()] = value.strip()
    return out


async def _body_chunks(
    reader: asyncio.StreamReader, headers: dict[str, str]
) -> AsyncIterator[bytes]:
    """The raw bytes of a message body (chunked framing kept), in pieces of <= 64 KiB."""
    if "chunked" in headers.get("transfer-encoding", ""):
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            yield size_line
            data = await reader.readexactly(size + 2)
            yield data
            if size == 0:
                return
    elif "content-length" in headers:
        left = int(headers["content-length"])
        while left:
            data = await reader.readexactly(min(left, 65536))
            left -= len(data)
            yield data
    else:  # until the connection closes
        while True:
            data = await reader.read(65536)
            if not data:
                return
            yield data


__all__ = ["LINKS", "LinkProfile", "Request", "ShapedLink"]
