"""The failed attempts of the message a transactional handler is retrying (table `handler_attempts`).

Every statement runs on the caller's transaction, beside its fenced offset commit:
the count moves with the offsets, so a retry survives a crash and a dead-letter
publish happens once.
"""

from __future__ import annotations

from typing import Any

import msgspec

from storage.db import Conn

SELECT_ATTEMPTS = """
SELECT "offset", attempts, errors::text AS errors
FROM handler_attempts WHERE group_name = $1 AND partition_id = $2
"""

# $5: the new error entry (json object); `at` is the server's time.
RECORD_ATTEMPT = """
INSERT INTO handler_attempts (group_name, partition_id, "offset", attempts, errors)
VALUES ($1, $2, $3, $4, jsonb_build_array($5::jsonb || jsonb_build_object('at', clock_timestamp())))
ON CONFLICT (group_name, partition_id) DO UPDATE
   SET "offset" = EXCLUDED."offset", attempts = EXCLUDED.attempts, updated_at = clock_timestamp(),
       errors = CASE WHEN handler_attempts."offset" = EXCLUDED."offset"
                     THEN handler_attempts.errors || EXCLUDED.errors ELSE EXCLUDED.errors END
RETURNING errors::text AS errors
"""

CLEAR_ATTEMPTS = """
DELETE FROM handler_attempts WHERE group_name = $1 AND partition_id = $2 AND "offset" < $3
"""


class Attempts(msgspec.Struct, frozen=True):
    """The failed attempts recorded for one message: its offset, how many, and each error (attempt, error, at)."""

    offset: int
    attempts: int
    errors: list[dict[str, Any]]


async def load(conn: Conn, group: str, partition_id: int) -> Attempts | None:
    """The failed attempts recorded on this partition for the group (None: none)."""
    row = await conn.fetchrow(SELECT_ATTEMPTS, group, partition_id)
    if row is None:
        return None
    return Attempts(int(row["offset"]), int(row["attempts"]), msgspec.json.decode(row["errors"]))


async def record(
    conn: Conn, group: str, partition_id: int, offset: int, attempt: int, error: str
) -> list[dict[str, Any]]:
    """Count failed attempt `attempt` of the message at `offset`; its error history so far."""
    entry = msgspec.json.encode({"attempt": attempt, "error": error}).decode()
    errors = await conn.fetchval(RECORD_ATTEMPT, group, partition_id, offset, attempt, entry)
    result: list[dict[str, Any]] = msgspec.json.decode(errors)
    return result


async def clear(conn: Conn, group: str, partition_id: int, before: int) -> None:
    """Forget the attempts of a message the group has committed past (`offset < before`)."""
    await conn.execute(CLEAR_ATTEMPTS, group, partition_id, before)
