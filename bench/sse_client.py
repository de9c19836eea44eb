"""A lean HTTP/1.1 client for the benchmarks' streamed POSTs (plain http, keep-alive pool).

httpx costs the benchmark process ~100 µs per server-sent event (httpcore and h11 handle every
chunk in Python): ~11 ms of client CPU for one 128-token stream on the dev VM, so 32 concurrent
streams keep the client busy enough that a burst of requests leaves it late and TTFT includes
the client. This client reads the chunked body straight off an asyncio stream and splits the
events itself. It speaks just what the benchmarks need: POST with a JSON body, a 200 response
with a chunked (or Content-Length, or read-to-close) body, keep-alive, and one retry on a fresh
connection when a pooled one turns out to have been closed by the server while idle.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import msgspec

CONNECT_TIMEOUT_S = 30.0
_decode = msgspec.json.Decoder().decode


class HTTPStatusError(RuntimeError):
    """A non-200 reply; the message holds the status and the start of the body."""


class SSEClient:
    def __init__(self, headers: dict[str, str] | None = None) -> None:
        self._headers = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._idle: dict[tuple[str, int], list[tuple]] = {}

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for _, writer in conns:
                writer.close()
        self._idle.clear()

    async def events(self, url: str, body: bytes) -> AsyncIterator[dict]:
        """POST `body` (JSON) to `url`; yields the decoded JSON of each `data:` event, up to a
        `data: [DONE]` or the end of the body. Raises HTTPStatusError on a non-200 reply, and
        OSError / asyncio.IncompleteReadError / msgspec.DecodeError on a broken stream."""
        parts = urlsplit(url)
        if parts.scheme != "http":
            raise ValueError(f"SSEClient speaks plain http only, not {url!r}")
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        request = (
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n{self._headers}\r\n"
        ).encode() + body
        key = (host, port)
        reader, writer, status, headers = await self._send(key, request)
        # the connection can serve the next request if the server keeps it and the body has an end
        reusable = headers.get("connection", "").lower() != "close" and (
            "content-length" in headers or headers.get("transfer-encoding", "").lower() == "chunked"
        )
        finished = False
        try:
            chunks = _body(reader, headers)
            if status != 200:
                text = b"".join([c async for c in chunks]).decode(errors="replace")
                finished = True
                raise HTTPStatusError(f"HTTP {status}: {text[:500]}")
            done, buf = False, b""
            async for chunk in chunks:
                if done:
                    continue  # drain the rest of the body so the connection can be reused
                buf += chunk
                if b"\r" in buf:
                    buf = buf.replace(b"\r\n", b"\n")
                *blocks, buf = buf.split(b"\n\n")
                for block in blocks:
                    for line in block.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            done = True
                            break
                        yield _decode(data)
                    if done:
                        break
            finished = True
        finally:
            if finished and reusable:
                self._idle.setdefault(key, []).append((reader, writer))
            else:
                writer.close()

    async def _send(self, key: tuple[str, int], request: bytes):
        """Send on a pooled connection (retrying once on a fresh one if the pooled one was
        closed while idle) and read the status line and headers."""
        idle = self._idle.get(key)
        pooled = idle.pop() if idle else None
        while True:
            if pooled is None:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(*key), CONNECT_TIMEOUT_S
                )
            else:
                reader, writer = pooled
            try:
                writer.write(request)
                await writer.drain()
                status_line = await reader.readline()
                if not status_line:
                    raise ConnectionResetError("the server closed the connection")
            except (OSError, asyncio.IncompleteReadError):
                writer.close()
                if pooled is None:
                    raise
                pooled = None  # a stale keep-alive connection: once more on a fresh one
                continue
            break
        fields = status_line.split(None, 2)
        if len(fields) < 2 or not fields[0].startswith(b"HTTP/1."):
            writer.close()
            raise ConnectionError(f"not an HTTP/1.x reply: {status_line[:80]!r}")
        headers: dict[str, str] = {}
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return reader, writer, int(fields[1]), headers


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The response body in the pieces it arrives in."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return
            data = await reader.readexactly(size + 2)  # the chunk and its CRLF
            yield data[:-2]
    elif "content-length" in headers:
        left = int(headers["content-length"])
        while left > 0:
            data = await reader.read(min(left, 1 << 16))
            if not data:
                raise asyncio.IncompleteReadError(b"", left)
            left -= len(data)
            yield data
    else:
        while data := await reader.read(1 << 16):
            yield data
