"""bench/sse_client.py against a scripted HTTP/1.1 server: chunked and sized bodies, [DONE],
keep-alive reuse, a pooled connection the server closed while idle, errors."""

from __future__ import annotations

import asyncio
import json

import pytest

from bench.sse_client import HTTPStatusError, SSEClient


def _chunked(events: list[bytes], split: int = 7) -> bytes:
    """SSE events as a chunked body, cut into small chunks that split lines and events."""
    body = b"".join(events)
    out = b""
    for i in range(0, len(body), split):
        piece = body[i : i + split]
        out += f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    return out + b"0\r\n\r\n"


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class Server:
    """Answers each request with the next scripted reply; records requests and connections."""

    def __init__(self, replies: list[bytes], close_after: set[int] = frozenset()):
        self.replies = list(replies)
        self.close_after = close_after  # reply indices after which the server hangs up
        self.requests: list[bytes] = []
        self.connections = 0

    async def handle(self, reader, writer):
        self.connections += 1
        while True:
            head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
            if not head:
                break
            length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
            self.requests.append(head + await reader.readexactly(length))
            index = len(self.requests) - 1
            writer.write(self.replies[index])
            await writer.drain()
            if index in self.close_after:
                break
        writer.close()

    async def __aenter__(self):
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/generate"
        return self

    async def __aexit__(self, *exc):
        self.server.close()


OK_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


async def _collect(client, url):
    return [e async for e in client.events(url, b'{"x": 1}')]


def test_chunked_events_done_and_keep_alive():
    async def main():
        events = [_sse({"i": 1}), b": comment\r\n\r\n", _sse({"i": 2}), b"data: [DONE]\n\n"]
        replies = [OK_HEAD + _chunked(events), OK_HEAD + _chunked([_sse({"i": 3})], split=3)]
        async with Server(replies) as srv:
            client = SSEClient({"Authorization": "Bearer k"})
            assert await _collect(client, srv.url) == [{"i": 1}, {"i": 2}]
            assert await _collect(client, srv.url) == [{"i": 3}]
            await client.aclose()
        assert srv.connections == 1  # the second request reused the connection
        first = srv.requests[0]
        assert first.startswith(b"POST /generate HTTP/1.1\r\n")
        assert b"Authorization: Bearer k\r\n" in first and first.endswith(b'{"x": 1}')

    asyncio.run(main())


def test_a_connection_closed_while_idle_is_replaced():
    async def main():
        replies = [OK_HEAD + _chunked([_sse({"a": 1})]), OK_HEAD + _chunked([_sse({"b": 2})])]
        async with Server(replies, close_after={0}) as srv:
            client = SSEClient()
            assert await _collect(client, srv.url) == [{"a": 1}]
            await asyncio.sleep(0.05)  # the server has hung up the pooled connection
            assert await _collect(client, srv.url) == [{"b": 2}]
            await client.aclose()
        assert srv.connections == 2

    asyncio.run(main())


def test_error_status_sized_body_and_close():
    async def main():
        error, ok = b'{"error": {"message": "bad"}}', _sse({"z": 26})
        replies = [
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n" % len(error) + error,
            b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(ok) + ok,
        ]
        async with Server(replies) as srv:
            client = SSEClient()
            with pytest.raises(HTTPStatusError, match='HTTP 400: {"error"'):
                await _collect(client, srv.url)
            assert await _collect(client, srv.url) == [{"z": 26}]
            assert not any(client._idle.values())  # "connection: close" is not pooled
            await client.aclose()
        assert srv.connections == 1  # the 400's sized body was read, so the connection was reused

    asyncio.run(main())


def test_rejects_https():
    async def main():
        with pytest.raises(ValueError, match="plain http"):
            await _collect(SSEClient(), "https://example.com/generate")

    asyncio.run(main())
