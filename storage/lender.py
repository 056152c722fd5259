"""The Lender: pool connections kept out for the bus's own short statements on its hot paths."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from storage.errors import StorageUnavailableError
from storage.logs import get_logger

log = get_logger(__name__)


# Set on every connection the Lender borrows (the pool's reset undoes it when it goes back).
# The hot paths' statements are keyed lookups whose best plan does not depend on the values,
# and planning them again on every execution (what PostgreSQL does for a prepared statement
# whose generic plan it estimates costlier) is a large part of a queue take's time, with
# its CTEs and window functions. A generic plan also keeps a worker's fetch an index scan when
# the statistics of a freshly loaded partition are stale.
GENERIC_PLANS = "SELECT set_config('plan_cache_mode', 'force_generic_plan', false)"


class Lender:
    """Pool connections kept out between the bus's own statements on its hot paths.

    asyncpg's pool spends about as much Python on an acquire and a release
    (a proxy, an inactivity timer, a shielded release task, and a reset query
    unless skipped) as a short statement's round trip takes. The bus's own
    statements leave no session state behind (but GENERIC_PLANS), so up to `size` connections,
    borrowed from the pool once, stay out and are lent to them one statement
    (or one short block, `lend`) at a time. A connection that broke, was left
    inside a transaction, or whose block raised anything goes back to the
    pool (which waits out a cancelled query, closes or resets it), and a
    fresh one is borrowed when needed. The pool's
    `max_size` still bounds every connection of the Bus; the service's own
    `b.pool.acquire()` gets the rest and is reset on release as asyncpg always does.
    """

    def __init__(self, pool: asyncpg.Pool, size: int, *, generic_plans: bool = True) -> None:
        self._pool = pool
        # Through a transaction pooler no session setting stays with a connection: PostgreSQL's own plan choice.
        self._generic_plans = generic_plans
        self._size = size  # 0: nothing kept out, every use acquires from the pool (a pool of 1)
        self._idle: list[PoolConnectionProxy] = []
        self._borrowed = 0  # out of the pool: idle here, or lent
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._returning: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def borrowed(self) -> int:
        """Connections out of the pool now (idle here or lent)."""
        return self._borrowed

    @asynccontextmanager
    async def lend(self) -> AsyncIterator[PoolConnectionProxy]:
        """One connection for a short block of the bus's own statements (no session state left behind)."""
        if self._size == 0:
            async with self._pool.acquire() as acquired:
                yield acquired
            return
        conn = await self._take()
        try:
            yield conn
        except BaseException:
            # Even after a plain server error the protocol may still be reading up to the server's
            # ReadyForQuery: lent again at once, the next statement would meet "another operation
            # is in progress". The pool waits it out and resets (or closes) it; errors are rare here.
            self._give(conn, reusable=False)
            raise
        else:
            self._give(conn, reusable=True)

    async def fetch(self, query: str, *args: Any) -> list[asyncpg.Record]:
        """`Connection.fetch` on a lent connection."""
        result: list[asyncpg.Record] = await self._statement("fetch", query, args)
        return result

    async def fetchrow(self, query: str, *args: Any) -> asyncpg.Record | None:
        """`Connection.fetchrow` on a lent connection."""
        result: asyncpg.Record | None = await self._statement("fetchrow", query, args)
        return result

    async def fetchval(self, query: str, *args: Any) -> Any:
        """`Connection.fetchval` on a lent connection."""
        return await self._statement("fetchval", query, args)

    async def execute(self, query: str, *args: Any) -> str:
        """`Connection.execute` on a lent connection."""
        result: str = await self._statement("execute", query, args)
        return result

    async def _statement(self, method: str, query: str, args: tuple[Any, ...]) -> Any:
        """One statement on a lent connection: `lend()` without its context manager (the hot path).

        A connection whose statement raised goes back to the pool, as in `lend()`.
        """
        if self._size == 0:
            async with self._pool.acquire() as acquired:
                return await getattr(acquired, method)(query, *args)
        conn = await self._take()
        try:
            result = await getattr(conn, method)(query, *args)
        except BaseException:
            self._give(conn, reusable=False)  # as in lend(): the pool waits out and resets it
            raise
        self._give(conn, reusable=True)
        return result

    async def close(self) -> None:
        """Give every idle connection back to the pool; lent ones go back when their block ends."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            self._borrowed -= 1
            await self._pool.release(conn)
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        if self._returning:
            await asyncio.gather(*self._returning, return_exceptions=True)

    async def _take(self) -> PoolConnectionProxy:
        while True:
            if self._closed:
                raise StorageUnavailableError("the Bus is closed; its connections are gone")
            while self._idle:
                conn = self._idle.pop()
                if _usable(conn):
                    return conn
                self._return(conn)
            if self._borrowed < self._size:
                self._borrowed += 1
                try:
                    conn = await self._pool.acquire()
                except BaseException:
                    self._borrowed -= 1
                    self._wake()
                    raise
                try:
                    if self._generic_plans:
                        await conn.execute(GENERIC_PLANS)
                except BaseException:
                    self._return(conn)
                    self._wake()
                    raise
                return conn
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                elif not waiter.cancelled():
                    self._wake()  # the wake-up it got goes to the next one
                raise

    def _give(self, conn: PoolConnectionProxy, *, reusable: bool) -> None:
        if reusable and not self._closed and _usable(conn):
            self._idle.append(conn)
        else:
            self._return(conn)
        self._wake()

    def _return(self, conn: PoolConnectionProxy) -> None:
        """Back to the pool, which resets it, or closes it if it broke (in a task: `_give` is synchronous).

        A connection that closed is back in the pool already (asyncpg detaches its proxy); releasing
        it again does nothing.
        """
        self._borrowed -= 1
        task = asyncio.get_running_loop().create_task(self._release(conn))
        self._returning.add(task)
        task.add_done_callback(self._returning.discard)

    async def _release(self, conn: PoolConnectionProxy) -> None:
        try:
            await self._pool.release(conn)
        except Exception:  # the pool terminates what it cannot reset; nothing else to do here
            log.debug("lender_release_failed", exc_info=True)

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


def _usable(conn: PoolConnectionProxy) -> bool:
    """Open, outside any transaction, and still ours (not detached by the pool when it closed)."""
    try:
        return not conn.is_closed() and not conn.is_in_transaction()
    except asyncpg.InterfaceError:  # the pool took it back: its connection closed
        return False
