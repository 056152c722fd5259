"""The chaos run: faults at random (seeded, printed), then the history checker's verdict.

`make test` runs a bounded run (CHAOS_SECONDS, default 25 s of faults, longer
until every fault kind has fired) of every
usage pattern at once (see tests/chaos/member.py); `make chaos` a longer one.
The counts, per pattern too, are printed (see them with -s).
"""

from __future__ import annotations

import os

import pytest

from tests.chaos.checker import check
from tests.chaos.harness import KINDS, RECORDED_AS, describe, run_chaos

# The bounded run's faults go on past SECONDS until every kind has fired once (`every_kind`).
SECONDS = float(os.environ.get("CHAOS_SECONDS", "25"))

pytestmark = [pytest.mark.slow, pytest.mark.alone]


@pytest.mark.timeout(SECONDS + 240)
async def test_under_random_faults_no_acknowledged_message_is_lost_and_every_invariant_holds() -> None:
    outcome = await run_chaos(SECONDS, every_kind=True)
    report = check(outcome.history)
    text = describe(outcome, report)
    print(text)
    fired = {f.kind for f in outcome.history.faults}
    assert {RECORDED_AS.get(k, k) for k in KINDS} <= fired, text
    assert report.messages > 0 and report.patterns, text
    assert all(pc.acked > 0 and pc.delivered > 0 for pc in report.patterns.values()), text
    assert report.losses == 0, text
    assert report.ok, text
    assert not outcome.problems, text


HA_SECONDS = float(os.environ.get("CHAOS_HA_SECONDS", "15"))
PG15 = os.path.join(os.environ.get("PG15_BIN", "/usr/lib/postgresql/15/bin"), "postgres")


@pytest.mark.skipif(not os.path.exists(PG15), reason="needs PostgreSQL 15 (scripts/ensure-pg15.sh)")
@pytest.mark.timeout(HA_SECONDS + 240)
async def test_through_a_failover_no_acknowledged_message_is_lost() -> None:
    """The same run against a primary and a synchronous standby: the standby is promoted first."""
    outcome = await run_chaos(HA_SECONDS, ha=True)
    report = check(outcome.history)
    text = describe(outcome, report)
    print(text)
    assert any(f.kind == "failover" for f in outcome.history.faults), text
    assert report.messages > 0 and report.patterns, text
    assert report.losses == 0, text
    assert report.ok, text
    assert not outcome.problems, text


POOLER_SECONDS = float(os.environ.get("CHAOS_POOLER_SECONDS", "20"))


@pytest.mark.skipif(
    not os.path.exists("/usr/sbin/pgbouncer") and not os.environ.get("CI"),
    reason="needs pgbouncer (scripts/ensure-pgbouncer.sh)",
)
@pytest.mark.timeout(POOLER_SECONDS + 240)
async def test_through_a_transaction_pooler_the_transactional_pattern_loses_nothing() -> None:
    """`c.transaction()` (effectively-once into the user's table) with every process behind PgBouncer."""
    outcome = await run_chaos(POOLER_SECONDS, pooler="tx")
    report = check(outcome.history)
    text = describe(outcome, report)
    print(text)
    assert set(report.patterns) == {"g-tx"}, text
    assert all(pc.acked > 0 and pc.delivered > 0 for pc in report.patterns.values()), text
    assert report.losses == 0, text
    assert report.ok, text
    assert not outcome.problems, text


LIMITED_SECONDS = float(os.environ.get("CHAOS_LIMITED_SECONDS", "14"))


@pytest.mark.timeout(LIMITED_SECONDS + 120)
async def test_a_limited_delayed_prioritized_scheduled_queue_keeps_its_limits_under_faults() -> None:
    """The limited queue alone: nothing lost, no limit exceeded, no early job, no tick twice."""
    outcome = await run_chaos(LIMITED_SECONDS, patterns=frozenset({"lqueue"}))
    report = check(outcome.history)
    text = describe(outcome, report)
    print(text)
    h = outcome.history
    assert set(report.patterns) == {"q-limited"}, text
    assert all(pc.acked > 0 and pc.delivered > 0 for pc in report.patterns.values()), text
    # The checks had something to check: keyed, delayed jobs taken, and ticks published.
    assert sum(1 for j in h.job_takes if j.acked_from is not None and j.key) > 50, text
    assert sum(1 for j in h.job_takes if j.msg_id in h.not_before) > 10, text
    assert len(h.ticks) >= LIMITED_SECONDS / 2, text
    assert report.losses == 0, text
    assert report.ok, text
    assert not outcome.problems, text
