"""An aiohttp application served in this process on a free port, by an event
loop of its own in a thread: the in-process router of the router's tests, and
the fake backends beside it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

from aiohttp import web

from kvsm_testing.ports import free_port

__all__ = ["serve_app"]


@contextlib.contextmanager
def serve_app(app: web.Application, cancel: bool = True) -> Iterator[str]:
    """Serve ``app`` on 127.0.0.1 until the block ends; yields its base URL.

    ``cancel``: aiohttp's handler_cancellation, as the router's CLI sets it
    (without it, a handler notices a client gone only when its next write fails)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner = web.AppRunner(app, handler_cancellation=cancel, access_log=None)
    port = free_port()

    async def start() -> None:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()

    try:
        asyncio.run_coroutine_threadsafe(start(), loop).result(10)
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
