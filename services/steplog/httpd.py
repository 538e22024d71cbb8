"""A small asyncio HTTP/1.1 server for the exporter and the dashboard: GET routes, one response per
connection, and server-sent event streams. Runs in the same event loop as the NATS subscription, so
handlers read the Aggregator without locks. Not a general web server: no keep-alive, no bodies in.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Union
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger(__name__)

REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 500: "Internal Server Error"}
MAX_HEADER_LINES = 100


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Stream:
    """A streamed response (server-sent events): `chunks` yields bytes until the client goes away."""

    chunks: AsyncIterator[bytes]
    content_type: str = "text/event-stream; charset=utf-8"
    headers: dict[str, str] = field(default_factory=dict)


Handler = Callable[[dict[str, list[str]]], Union[Response, Stream, Awaitable[Union[Response, Stream]]]]


class HttpServer:
    def __init__(self, routes: dict[str, Handler], host: str = "127.0.0.1", port: int = 0):
        self.routes = routes
        self.host, self.port = host, port
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.Task] = set()
        self.requests = 0

    async def start(self) -> int:
        """Listen; returns the bound port (useful with port 0)."""
        self._server = await asyncio.start_server(self._on_conn, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._conns):
            t.cancel()
        if self._conns:
            await asyncio.gather(*self._conns, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _on_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._conns.add(task)
        try:
            await self._serve(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError, asyncio.LimitOverrunError):
            pass  # the client went away or sent garbage: nothing to answer
        except asyncio.CancelledError:
            pass
        finally:
            self._conns.discard(task)
            try:
                writer.close()
            except Exception:
                pass

    async def _serve(self, reader, writer) -> None:
        line = await asyncio.wait_for(reader.readline(), 10)
        parts = line.decode("latin-1").split()
        for _ in range(MAX_HEADER_LINES):
            h = await asyncio.wait_for(reader.readline(), 10)
            if h in (b"\r\n", b"\n", b""):
                break
        self.requests += 1
        if len(parts) != 3:
            return await self._write(writer, Response(400, b"bad request line\n"), head=False)
        method, target, _version = parts
        url = urlsplit(target)
        if method not in ("GET", "HEAD"):
            return await self._write(writer, Response(405, b"only GET\n", headers={"Allow": "GET, HEAD"}), head=False)
        handler = self.routes.get(url.path)
        if handler is None:
            return await self._write(writer, Response(404, f"no route {url.path}\n".encode()), head=method == "HEAD")
        try:
            result = handler(parse_qs(url.query))
            if asyncio.iscoroutine(result):
                result = await result
        except Exception as exc:  # a handler bug answers 500 and is logged; the server keeps serving
            log.exception("handler for %s failed", url.path)
            result = Response(500, f"{type(exc).__name__}: {exc}\n".encode())
        if isinstance(result, Stream):
            await self._stream(writer, result)
        else:
            await self._write(writer, result, head=method == "HEAD")

    @staticmethod
    def _head(status: int, content_type: str, headers: dict[str, str], length: int | None) -> bytes:
        lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'OK')}", f"Content-Type: {content_type}", "Connection: close"]
        if length is not None:
            lines.append(f"Content-Length: {length}")
        lines += [f"{k}: {v}" for k, v in headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def _write(self, writer, resp: Response, *, head: bool) -> None:
        writer.write(self._head(resp.status, resp.content_type, resp.headers, len(resp.body)))
        if not head:
            writer.write(resp.body)
        await writer.drain()

    async def _stream(self, writer, s: Stream) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **s.headers}
        writer.write(self._head(200, s.content_type, headers, None))
        await writer.drain()
        try:
            async for chunk in s.chunks:
                writer.write(chunk)
                await writer.drain()
        finally:
            aclose = getattr(s.chunks, "aclose", None)
            if aclose is not None:
                await aclose()


def sse(event: str, data: str) -> bytes:
    """One server-sent event (data may hold newlines: each line gets its own `data:` field)."""
    body = "".join(f"data: {line}\n" for line in data.split("\n"))
    return f"event: {event}\n{body}\n".encode("utf-8")
