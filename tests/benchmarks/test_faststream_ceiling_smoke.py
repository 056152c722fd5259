"""The FastStream bench's ceiling rows measure real deliveries: each pipeline, started with no broker
under it, hands every message to its handler, and the bench fails when one is missing.

Numbers are not checked here (speed targets belong to `bus bench faststream`).
"""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks import faststream


async def test_each_ceiling_pipeline_handles_every_message_without_a_broker() -> None:
    core, stock, ours = await faststream._ceiling(20)
    assert stock is not None  # FastStream's RedisBroker is importable (the bench and test extras)
    for rate, cpu_us in (core, stock, ours):  # msg/s and processor time per message
        assert rate > 0 and cpu_us > 0


async def test_a_subscriber_that_skips_messages_fails_the_ceiling(monkeypatch: pytest.MonkeyPatch) -> None:
    started = faststream._offline

    async def not_running(broker: Any) -> Any:
        sub = await started(broker)
        sub.running = False  # FastStream's `consume` skips what a stopped subscriber gets
        return sub

    monkeypatch.setattr(faststream, "_offline", not_running)
    with pytest.raises(RuntimeError, match="handled 0 of 5"):
        await faststream._ceiling(5)
