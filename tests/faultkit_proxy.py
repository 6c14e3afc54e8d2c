"""TCP proxies in front of a private redis-server, for faults a real Redis only shows now
and then.

``ResetProxy``, when armed, resets every client connection about to carry a chosen
command: a connection blip aimed at one call, so what a random ``CLIENT KILL`` does now and
then happens every time. ``drop="request"`` resets before the command reaches Redis (it
never runs); ``drop="reply"`` forwards it and resets before the answer (it ran, the client
cannot know).

``OutageProxy`` plays a network outage: Redis unreachable for a while, its data kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Self

from ops.localredis import free_port

# Longest the reply mode waits for Redis to answer the marked command before resetting.
REPLY_WAIT_S = 5.0


class _Proxy:
    """A TCP proxy on a free port in front of 127.0.0.1:``target_port``, served by an event
    loop of its own thread; subclasses handle each client connection (``_handle``)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name=f"faultkit-{type(self).__name__}")
        self._server: asyncio.Server | None = None

    def start(self) -> str:
        self._thread.start()
        start = asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self._server = asyncio.run_coroutine_threadsafe(start, self._loop).result(10)
        return self.url

    def stop(self) -> None:
        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError


class ResetProxy(_Proxy):
    def __init__(self, target_port: int, marker: bytes, drop: str = "request") -> None:
        super().__init__(target_port)
        self.marker = marker
        self.drop = drop
        self.armed = threading.Event()
        self.resets = 0

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        hit = asyncio.Event()  # the marked command came: nothing more reaches the client
        sent = asyncio.Event()  # drop="reply": the marked command went on to Redis
        answered = asyncio.Event()  # and Redis answered it: it has run
        try:
            await asyncio.gather(self._upstream(reader, up_writer, hit, sent, answered),
                                 self._downstream(up_reader, writer, hit, sent, answered),
                                 return_exceptions=True)
        finally:
            for w in (writer, up_writer):
                w.transport.abort()

    async def _upstream(self, reader: asyncio.StreamReader, up: asyncio.StreamWriter,
                        hit: asyncio.Event, sent: asyncio.Event, answered: asyncio.Event) -> None:
        while data := await reader.read(65536):
            if self.armed.is_set() and self.marker in data:
                self.resets += 1
                if self.drop == "reply":
                    sent.set()
                    up.write(data)
                    with contextlib.suppress(ConnectionError):
                        await up.drain()
                    # Reset only once Redis has answered: a fixed pause let a starved Redis
                    # run the command after the client's next call on a new connection.
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(answered.wait(), REPLY_WAIT_S)
                hit.set()
                return
            up.write(data)
            await up.drain()

    async def _downstream(self, up_reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                          hit: asyncio.Event, sent: asyncio.Event,
                          answered: asyncio.Event) -> None:
        while not hit.is_set():
            read = asyncio.ensure_future(up_reader.read(65536))
            stop = asyncio.ensure_future(hit.wait())
            try:
                done, _ = await asyncio.wait({read, stop}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for pending in (read, stop):
                    if not pending.done():
                        pending.cancel()
            if stop in done or not read.result():
                return
            if sent.is_set():
                # The client waits for each answer before its next command, so what comes
                # now answers the marked one: dropped.
                answered.set()
                return
            writer.write(read.result())
            await writer.drain()


class OutageProxy(_Proxy):
    """Plays a network outage: ``down()`` resets every connection, and each new one at once
    until ``up()``, while Redis itself keeps its data (a crash of a server without
    persistence would lose it)."""

    def __init__(self, target_port: int) -> None:
        super().__init__(target_port)
        self._down = threading.Event()
        # Each open client connection, with its connection to Redis.
        self._open: dict[asyncio.StreamWriter, asyncio.StreamWriter] = {}

    def down(self) -> int:
        """Cut every connection, and each new one until ``up()``; returns how many client
        connections were cut."""
        self._down.set()
        return asyncio.run_coroutine_threadsafe(self._cut(), self._loop).result(10)

    def up(self) -> None:
        self._down.clear()

    def stop(self) -> None:
        # Connections ended first, so their handlers return rather than being cancelled
        # mid-read (asyncio logs a cancelled connection handler as an error).
        if self._thread.is_alive():
            self.down()
        super().stop()

    async def _cut(self) -> int:
        pairs = list(self._open.items())
        for client, upstream in pairs:
            client.transport.abort()
            upstream.transport.abort()
        return len(pairs)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._down.is_set():
            writer.transport.abort()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._open[writer] = up_writer
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer),
                                 return_exceptions=True)
        finally:
            self._open.pop(writer, None)
            writer.transport.abort()
            up_writer.transport.abort()

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.transport.abort()  # one side closed: so does the other
