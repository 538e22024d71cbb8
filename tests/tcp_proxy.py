"""A TCP proxy for tests, to cut a link and restore it: the leaf node dials the proxy, the proxy the
hub's leafnode port. `cut()` closes every proxied connection and refuses new ones (accepted and
closed at once, as a broken WAN path would reset them); `restore()` lets connections through again.
Runs its own asyncio loop in a thread, so sync and async tests can both drive it.
"""
from __future__ import annotations

import asyncio
import threading


class TcpProxy:
    def __init__(self, target_host: str, target_port: int, host: str = "127.0.0.1"):
        self.target = (target_host, target_port)
        self.host = host
        self.port: int | None = None
        self.down = False
        self.connections = 0  # accepted while up
        self.refused = 0  # accepted and closed while cut
        # bytes passed on, per direction: "up" from the dialer to the target, "down" from the target back
        # (for a leaf link through the proxy: "down" is what the hub sent to the datacenter)
        self.bytes = {"up": 0, "down": 0}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tcp-proxy", daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    def _call(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self) -> "TcpProxy":
        self._thread.start()
        self._server = self._call(asyncio.start_server(self._handle, self.host, 0))
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, direction: str) -> None:
        try:
            while not self.down:
                data = await r.read(1 << 16)
                if not data:
                    break
                self.bytes[direction] += len(data)
                w.write(data)
                await w.drain()
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass
        finally:
            w.close()

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        if self.down:
            self.refused += 1
            cw.close()
            return
        try:
            ur, uw = await asyncio.open_connection(*self.target)
        except OSError:
            cw.close()
            return
        self.connections += 1
        self._writers |= {cw, uw}
        try:
            await asyncio.gather(self._pipe(cr, uw, "up"), self._pipe(ur, cw, "down"))
        finally:
            self._writers -= {cw, uw}

    async def _cut(self) -> None:
        self.down = True
        for w in list(self._writers):
            w.transport.abort()  # RST, not a graceful FIN: the link is broken, not closed
        self._writers.clear()

    def cut(self) -> None:
        self._call(self._cut())

    def restore(self) -> None:
        self.down = False

    def stop(self) -> None:
        async def close():
            await self._cut()
            self._server.close()

        try:
            self._call(close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
