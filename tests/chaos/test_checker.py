"""The chaos checker flags each kind of breach in a synthetic history, and passes a clean one.

One history per invariant and usage pattern (see the checker's docstring).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from tests.chaos.checker import (
    Ack,
    DeadLetter,
    Delivery,
    Fault,
    History,
    JobTake,
    QueueLimits,
    Row,
    Sample,
    StoreItem,
    Tally,
    UserAck,
    check,
)


def _acks(n: int, partition: str = "0") -> list[Ack]:
    return [Ack("t", partition, i, f"id-{partition}-{i}", float(i)) for i in range(n)]


def _deliver(
    offsets: list[int],
    *,
    t0: float = 100.0,
    pid: int = 1,
    member: str = "m1",
    gen: int = 1,
    group: str = "g",
    partition: str = "0",
) -> list[Delivery]:
    return [
        Delivery(group, "t", partition, o, f"id-{partition}-{o}", pid, member, gen, t0 + i * 0.01, seq=i)
        for i, o in enumerate(offsets)
    ]


def _samples(values: list[tuple[float, int]], owner: str | None = "m1", epoch: int = 1) -> list[Sample]:
    return [Sample(t, "g", "t", "0", c, owner, epoch) for t, c in values]


def _history(
    deliveries: list[Delivery],
    samples: list[Sample] | None = None,
    faults: list[Fault] | None = None,
    acks: list[Ack] | None = None,
) -> History:
    return History(["g"], acks if acks is not None else _acks(5), deliveries, samples or [], faults or [])


def test_clean_history_passes_with_counts() -> None:
    r = check(_history(_deliver([0, 1, 2, 3, 4]), _samples([(100.0, 0), (101.0, 5)])))
    assert r.ok, r.summary()
    assert (r.messages, r.deliveries, r.losses, r.duplicates) == (5, 5, 0, 0)
    assert r.commit_advances_checked == 1


def test_a_lost_acknowledged_message_is_flagged() -> None:
    r = check(_history(_deliver([0, 1, 3, 4])))
    assert r.losses == 1
    assert any(v.startswith("loss:") and "t/0@2" in v for v in r.violations)


def test_a_loss_in_one_group_is_flagged_even_when_another_group_got_it() -> None:
    h = _history(_deliver([0, 1, 2, 3, 4]) + _deliver([0, 1, 2, 3], group="h"))
    h.groups = ["g", "h"]
    r = check(h)
    assert r.losses == 1 and any("h never got t/0@4" in v for v in r.violations)


def test_a_reorder_within_one_member_run_is_flagged() -> None:
    r = check(_history(_deliver([0, 2, 1, 3, 4])))
    assert any(v.startswith("order:") and "0 -> 2" in v for v in r.violations)


def test_a_rewind_to_reread_is_not_an_order_violation_but_its_duplicates_need_a_fault() -> None:
    ds = _deliver([0, 1, 2, 1, 2, 3, 4])
    r = check(_history(ds))
    assert r.rewinds == 1 and not any(v.startswith("order:") for v in r.violations)
    assert r.duplicates == 2 and r.unexplained_duplicates == 2
    explained = check(_history(ds, faults=[Fault("terminate_backends", 100.025, 100.025)]))
    assert explained.ok, explained.summary()


def test_a_long_transaction_explains_no_duplicate_but_counts_as_an_injected_fault() -> None:
    ds = _deliver([0, 1, 2, 1, 2, 3, 4])
    r = check(_history(ds, faults=[Fault("long_transaction", 99.0, 110.0)]))
    assert r.unexplained_duplicates == 2 and not r.ok
    assert r.faults["long_transaction"] == 1 and "long_transaction=1" in r.summary()


def test_a_duplicate_is_explained_only_by_a_fault_touching_a_process_that_delivered_it() -> None:
    ds = _deliver([0, 1, 2], pid=1, member="m1") + _deliver([2, 3, 4], pid=2, member="m2", t0=105.0)
    other = check(_history(ds, faults=[Fault("kill", 103.0, 103.0, pid=99)]))
    assert other.unexplained_duplicates == 1
    owner = check(_history(ds, faults=[Fault("kill", 103.0, 103.0, pid=1)]))
    assert owner.ok, owner.summary()
    too_early = check(_history(ds, faults=[Fault("kill", 90.0, 90.0, pid=1)]))
    assert too_early.unexplained_duplicates == 1


def test_a_committed_offset_moving_backwards_is_flagged() -> None:
    r = check(_history(_deliver([0, 1, 2, 3, 4]), _samples([(100.0, 0), (101.0, 4), (101.1, 3), (102.0, 5)])))
    assert any(v.startswith("backwards:") and "committed 4" in v and "then 3" in v for v in r.violations)


def test_a_commit_only_the_old_primary_showed_is_not_a_step_backwards() -> None:
    old, new = 5432, 5433
    samples = [
        Sample(100.0, "g", "t", "0", 0, "m1", 1, old),
        Sample(101.0, "g", "t", "0", 4, "m1", 1, old),  # its wait for the standby cut by the failover
        Sample(101.1, "g", "t", "0", 3, "m1", 1, new),
        Sample(102.0, "g", "t", "0", 5, "m1", 1, new),
    ]
    r = check(_history(_deliver([0, 1, 2, 3, 4]), samples))
    assert not any(v.startswith("backwards:") for v in r.violations)
    again = [*samples[2:], Sample(102.5, "g", "t", "0", 4, "m1", 1, new)]  # on one server: flagged
    assert any(
        v.startswith("backwards:") for v in check(_history(_deliver([0, 1, 2, 3, 4]), again)).violations
    )


def test_a_commit_ahead_of_the_deliveries_is_flagged() -> None:
    r = check(_history(_deliver([0, 1, 2, 3, 4], t0=100.0), _samples([(99.0, 0), (100.015, 4)])))
    assert any(v.startswith("commit ahead of work:") and "offset 2" in v for v in r.violations)


def test_a_commit_under_a_lease_whose_holder_did_not_deliver_that_far_is_flagged_as_fenced() -> None:
    # m2 holds the lease (epoch 2) and has delivered 2..3; the cursor jumps to 5: m1 (the zombie) committed.
    ds = _deliver([0, 1, 2, 3, 4], pid=1, member="m1") + _deliver([2, 3], pid=2, member="m2", t0=102.0)
    samples = [Sample(102.5, "g", "t", "0", 2, "m2", 2), Sample(102.6, "g", "t", "0", 5, "m2", 2)]
    r = check(_history(ds, samples, faults=[Fault("zombie", 100.5, 101.5, pid=1)]))
    assert any(v.startswith("fencing:") for v in r.violations)


def test_a_zombie_holding_its_fenced_identity_again_after_waking_is_flagged() -> None:
    ds = _deliver([0, 1], pid=1, member="m1", t0=100.0) + _deliver([2, 3, 4], pid=2, member="m2", t0=103.0)
    samples = [
        Sample(100.5, "g", "t", "0", 2, "m1", 1),
        Sample(103.5, "g", "t", "0", 5, "m2", 2),
        Sample(106.0, "g", "t", "0", 5, "m1", 3),
    ]
    r = check(_history(ds, samples, faults=[Fault("zombie", 101.0, 105.0, pid=1)]))
    assert r.zombie_partitions_checked == 1
    assert any(v.startswith("zombie:") for v in r.violations)


def test_a_payload_that_differs_from_what_was_published_at_that_offset_is_flagged() -> None:
    ds = _deliver([0, 1, 2, 3, 4])
    ds[2] = Delivery("g", "t", "0", 2, "id-other", 1, "m1", 1, ds[2].t, seq=2)
    r = check(_history(ds))
    assert any(v.startswith("corrupt:") for v in r.violations)


def test_a_process_that_delivers_under_a_new_member_id_was_fenced_and_explains_its_re_reads() -> None:
    # Same process, same partition: member m1 read 0..4, was swept, came back as m2 and read 3..4 again.
    again = [replace(d, seq=d.seq + 5) for d in _deliver([3, 4], t0=101.0, member="m2")]
    ds = _deliver([0, 1, 2, 3, 4]) + again
    r = check(_history(ds))
    assert r.ok, r.summary()
    assert r.duplicates == 2 and r.faults["rejoin"] == 1 and r.explained_by["rejoin"] == 2


def test_an_observed_fault_explains_only_duplicates_on_the_process_it_hit() -> None:
    ds = _deliver([0, 1, 2, 3, 4], pid=1) + _deliver([3, 4], t0=101.0, pid=2, member="m2")
    lost_elsewhere = check(_history(ds, faults=[Fault("lease_lost", 100.5, 100.9, pid=3)]))
    assert lost_elsewhere.unexplained_duplicates == 2
    lost_here = check(_history(ds, faults=[Fault("lease_lost", 100.5, 100.9, pid=1)]))
    assert lost_here.ok and lost_here.explained_by["lease_lost"] == 2
    assert "faults observed: lease_lost=1" in lost_here.summary()


# -- the usage patterns ----------------------------------------------------------------


def _rows(offsets: list[int], group: str = "g") -> list[Row]:
    return [Row(group, "t", "0", o, f"id-0-{o}") for o in offsets]


def test_exactly_once_table_passes_with_one_row_per_acknowledged_message_and_counts_it() -> None:
    h = _history(_deliver([0, 1, 2, 3, 4]))
    h.patterns, h.rows = {"g": "tx"}, {"g": _rows([0, 1, 2, 3, 4])}
    r = check(h)
    assert r.ok, r.summary()
    pc = r.patterns["g"]
    assert (pc.pattern, pc.acked, pc.delivered, pc.rows, pc.row_duplicates, pc.row_losses) == (
        "tx",
        5,
        5,
        5,
        0,
        0,
    )
    assert "table rows=5 dup=0 lost=0" in r.summary()


def test_a_second_row_in_the_users_table_is_a_violation_whatever_the_faults() -> None:
    ds = _deliver([0, 1, 2]) + _deliver([2, 3, 4], pid=2, member="m2", t0=101.0)
    h = _history(ds, faults=[Fault("kill", 100.5, 100.5, pid=1)])
    h.patterns, h.rows = {"g": "txlow"}, {"g": _rows([0, 1, 2, 2, 3, 4])}
    r = check(h)
    assert r.unexplained_duplicates == 0  # the re-delivery itself is explained by the kill
    assert r.patterns["g"].row_duplicates == 1
    assert any(v.startswith("exactly-once:") and "2 rows for t/0@2" in v for v in r.violations)


def test_a_batch_delivered_but_missing_from_the_users_table_is_a_loss_the_delivery_check_cannot_see() -> None:
    # The commit(connection=) loss: every message was handed out in order (no gap, nothing to
    # re-read), but the transaction of offsets 2..3 rolled back and the position stayed past them.
    h = _history(_deliver([0, 1, 2, 3, 4]))
    h.patterns, h.rows = {"g": "txlow"}, {"g": _rows([0, 1, 4])}
    r = check(h)
    assert r.losses == 0 and r.patterns["g"].row_losses == 2
    assert any("table has no row for t/0@2" in v for v in r.violations)


def test_poison_must_be_dead_lettered_and_may_be_skipped_by_order_and_commits() -> None:
    acks = [Ack("t", "0", i, f"p-{i}", float(i)) for i in range(5)]  # p-2 poison (the harness decides)
    ds = [
        Delivery("g", "t", "0", o, f"p-{o}", 1, "m1", 1, 100.0 + i * 0.01, seq=i)
        for i, o in enumerate([0, 1, 3, 4])
    ]
    samples = [Sample(100.0, "g", "t", "0", 0, "m1", 1), Sample(100.5, "g", "t", "0", 3, "m1", 1)]
    h = History(
        ["g"],
        acks,
        ds,
        samples,
        [],
        patterns={"g": "handler-dlq"},
        poison=frozenset({"p-2"}),
        dead_letters={"g": [DeadLetter("g", "t", "0", 2, "p-2", 100.015)]},
    )
    r = check(h)
    assert r.ok, r.summary()
    assert r.patterns["g"].dead_lettered == 1
    h.dead_letters = {"g": []}
    missing = check(h)
    assert any(v.startswith("loss:") and "never dead-lettered t/0@2" in v for v in missing.violations)


def test_a_transactional_handler_table_has_each_good_message_once_and_no_row_for_poison() -> None:
    acks = [Ack("t", "0", i, f"p-{i}", float(i)) for i in range(5)]  # p-2 poison
    ds = [
        Delivery("g", "t", "0", o, f"p-{o}", 1, "m1", 1, 100.0 + i * 0.01, seq=i)
        for i, o in enumerate([0, 1, 3, 4])
    ]
    h = History(
        ["g"],
        acks,
        ds,
        [],
        [],
        patterns={"g": "txh"},
        poison=frozenset({"p-2"}),
        dead_letters={"g": [DeadLetter("g", "t", "0", 2, "p-2", 100.015)]},
        rows={"g": [Row("g", "t", "0", o, f"p-{o}") for o in (0, 1, 3, 4)]},
    )
    r = check(h)
    assert r.ok, r.summary()  # the poison has no row, and that is no loss
    assert r.patterns["g"].row_losses == 0 and r.patterns["g"].dead_lettered == 1
    h.rows = {"g": [Row("g", "t", "0", o, f"p-{o}") for o in (0, 1, 2, 3, 4)]}
    kept = check(h)
    assert any("has a row for poison t/0@2" in v for v in kept.violations)


def test_a_message_that_is_not_poison_in_the_dead_letter_topic_needs_a_fault() -> None:
    acks = [Ack("t", "0", i, f"p-{i}", float(i)) for i in range(2)]
    ds = [Delivery("g", "t", "0", o, f"p-{o}", 1, "m1", 1, 100.0 + o, seq=o) for o in (0, 1)]
    h = History(
        ["g"],
        acks,
        ds,
        [],
        [],
        patterns={"g": "queue"},
        reads={"g": "t"},
        dead_letters={"g": [DeadLetter("g", "t", "0", 1, "p-1", 102.0)]},
    )
    assert any(v.startswith("dead letter:") for v in check(h).violations)
    h.faults = [Fault("zombie", 101.0, 101.5, pid=1)]
    assert check(h).ok


def test_a_claim_or_job_acked_and_handed_out_again_under_a_later_generation_is_flagged() -> None:
    ds = _deliver([0, 1, 2, 3, 4], gen=1) + _deliver([3, 4], pid=2, member="w2", gen=2, t0=105.0)
    h = _history(ds, faults=[Fault("kill", 104.0, 104.0, pid=None)])
    h.patterns = {"g": "claims"}
    h.user_acks = [UserAck("g", "t", "0", o, f"id-0-{o}", 1, 1, 101.0) for o in range(5)]
    r = check(h)
    assert any(v.startswith("acked again:") and "t/0@3" in v for v in r.violations)
    h.user_acks = [UserAck("g", "t", "0", o, f"id-0-{o}", 1, 1, 101.0) for o in range(3)]
    assert check(h).ok  # only 0..2 were acked: 3..4 coming back is the at-least-once window


def test_queue_jobs_have_no_order_and_a_nack_explains_the_job_coming_back() -> None:
    ds = _deliver([3, 1, 0, 4, 2]) + _deliver([1], pid=2, member="c2", gen=2, t0=101.0)
    h = _history(ds, faults=[Fault("nacked", 100.2, 100.2, pid=1, groups=frozenset({"g"}))])
    h.patterns = {"g": "queue"}
    r = check(h)
    assert r.ok, r.summary()
    assert r.patterns["g"].explained_by["nacked"] == 1
    h.faults = [Fault("nacked", 100.2, 100.2, pid=1, groups=frozenset({"other"}))]
    assert check(h).unexplained_duplicates == 1  # a fault scoped to another group explains nothing here


def test_event_store_guards_and_tally_coverage() -> None:
    acks = [Ack("s", "a", p, f"e-{p}", float(p)) for p in (1, 3, 5)]
    items = [StoreItem("a", p) for p in (1, 3, 5)]
    ds = [Delivery("es", "s", "a", p, f"e-{p}", 1, "w", 7, 100.0 + p, seq=i) for i, p in enumerate((1, 3, 5))]
    base = dict(patterns={"es": "es"}, reads={"es": "s"}, store_items=items)
    good = [Tally("es", "a", 1, 3, 3, 4, 1, 104.0), Tally("es", "a", 5, 5, 5, 6, 1, 106.0)]
    r = check(History(["es"], acks, ds, [], [], tallies={"es": good}, **base))  # type: ignore[arg-type]
    assert r.ok, r.summary()
    assert r.patterns["es"].tallies == 2
    # Appended at 6 with guard position 3 although Item a@5 came in between: the guard failed.
    bad = [Tally("es", "a", 1, 3, 3, 6, 1, 106.0)]
    r = check(History(["es"], acks, ds, [], [], tallies={"es": bad}, **base))  # type: ignore[arg-type]
    assert any(v.startswith("guard:") for v in r.violations)
    assert any(v.startswith("tally:") and "a@5" in v for v in r.violations)
    twice = [*good, Tally("es", "a", 5, 5, 5, 7, 2, 107.0)]
    r = check(History(["es"], acks, ds, [], [], tallies={"es": twice}, **base))  # type: ignore[arg-type]
    assert r.patterns["es"].tally_duplicates == 1 and any("covered by Tallies" in v for v in r.violations)
    r = check(
        History(["es"], acks, ds, [], [Fault("kill", 106.5, 106.5, pid=1)], tallies={"es": twice}, **base)
    )  # type: ignore[arg-type]
    assert r.ok, r.summary()


def test_event_store_positions_may_skip_but_not_go_unseen() -> None:
    acks = [Ack("s", "a", p, f"e-{p}", float(p)) for p in (1, 4, 9)]
    ds = [Delivery("es", "s", "a", p, f"e-{p}", 1, "w", 7, 100.0 + i, seq=i) for i, p in enumerate((1, 4, 9))]
    r = check(History(["es"], acks, ds, [], [], patterns={"es": "es"}, reads={"es": "s"}))
    assert r.ok, r.summary()


def test_breaches_the_members_saw_are_violations_and_the_summary_has_one_line_per_pattern() -> None:
    h = _history(_deliver([0, 1, 2, 3, 4]) + _deliver([0, 1, 2, 3, 4], group="h"))
    h.groups, h.patterns = ["g", "h"], {"g": "poll", "h": "commit-async"}
    h.breaches = ["L-0-1: g-claims: ack() after extend() raised LeaseLostError returned silently"]
    r = check(h)
    assert r.violations == [
        "breach: L-0-1: g-claims: ack() after extend() raised LeaseLostError returned silently"
    ]
    table = r.table().splitlines()
    assert table[0].split()[:3] == ["pattern", "group", "acked"]
    assert [line.split()[:3] for line in table[1:]] == [["commit-async", "h", "5"], ["poll", "g", "5"]]


def test_the_recordings_read_back_into_a_history(tmp_path: Path) -> None:
    from tests.chaos.harness import read_history

    (tmp_path / "groups.tsv").write_text("g-tx\ttx\ng-claims\tclaims\n")
    (tmp_path / "acks-0.tsv").write_text("A\torders\t0\t0\tp-0\t99.0\nF\tp-1\t99.5\tboom\n")
    (tmp_path / "T-0-1.tsv").write_text(
        "D\tg-tx\torders\t0\t0\tp-0\t7\tm1\t1\t100.0\n"
        "V\t101.0\trolled_back\tgroup=g-tx messages=1 since=100.000000\n"
        "V\t101.5\tmember_fenced\tgroup=g-tx member=m1\n"
        "N\tg-tx\trolled_back\n"
        "K\tg-claims\torders\t0\t0\tp-0\t7\t3\t102.0\n"
        "B\t103.0\tack() returned silently\n"
    )
    (tmp_path / "user_rows").write_text("g-tx\torders\t0\t0\tp-0\n")
    h = read_history(tmp_path, [], [])
    assert h.patterns == {"g-tx": "tx", "g-claims": "claims"} and h.reads["g-tx"] == "orders"
    assert [a.msg_id for a in h.acks] == ["p-0"]
    assert h.rows == {"g-tx": [Row("g-tx", "orders", "0", 0, "p-0")]}
    rolled = next(f for f in h.faults if f.kind == "rolled_back")
    assert (rolled.start, rolled.end, rolled.pid, rolled.groups) == (100.0, 101.0, 7, frozenset({"g-tx"}))
    fenced = next(f for f in h.faults if f.kind == "fenced")
    assert fenced.start == 101.5 - 3.0  # a fence comes up to a session after the member fell silent
    assert h.user_acks == [UserAck("g-claims", "orders", "0", 0, "p-0", 7, 3, 102.0)]
    assert h.counters[("g-tx", "rolled_back")] == 1 and h.breaches == ["T-0-1: ack() returned silently"]


def test_a_partition_that_left_and_came_back_within_one_generation_is_not_a_skip() -> None:
    # m1 handled 0..1, lost the lease, m2 handled 2..3, m1 took it back at 4 (same generation).
    ds = (
        _deliver([0, 1], t0=100.0)
        + _deliver([2, 3], pid=2, member="m2", t0=101.0)
        + [replace(d, seq=d.seq + 2) for d in _deliver([4], t0=102.0)]
    )
    assert check(_history(ds)).ok
    late = _deliver([0, 1], t0=100.0) + [replace(d, seq=d.seq + 2) for d in _deliver([4], t0=100.5)]
    late += _deliver([2, 3], pid=2, member="m2", t0=101.0)  # handled only after m1 jumped ahead
    assert any(v.startswith("order:") and "1 -> 4" in v for v in check(_history(late)).violations)


# -- limited queues, delayed jobs, schedules ---------------------------------------------

LIMITS = QueueLimits(per_key=2, rate=5, per=1.0, visibility=2.0)


def _take(offset: int, key: str | None, asked: float, got: float, acked_from: float | None) -> JobTake:
    return JobTake("g", "t", "0", offset, f"id-0-{offset}", key, asked, got, acked_from)


def _limited(takes: list[JobTake], **fields: object) -> History:
    h = History(["g"], [], [], [], [], patterns={"g": "lqueue"}, queue_limits={"g": LIMITS}, job_takes=takes)
    for name, value in fields.items():
        setattr(h, name, value)
    return h


def test_a_limited_queue_within_its_limits_passes() -> None:
    takes = [
        # two of key a at once, a third only once one of them was acked
        _take(0, "a", 10.0, 10.01, 10.5),
        _take(1, "a", 10.0, 10.01, 10.6),
        _take(2, "a", 10.5, 10.52, 10.9),
        _take(3, "b", 10.5, 10.52, 10.7),
        # five within a second, the next after it
        _take(4, None, 10.6, 10.61, None),
        _take(5, None, 11.2, 11.21, 11.3),
    ]
    r = check(_limited(takes, not_before={"id-0-5": 11.0}))
    assert r.ok, r.summary()


def test_a_key_over_its_limit_from_the_consumers_timestamps_is_flagged() -> None:
    takes = [
        _take(0, "a", 10.0, 10.01, 10.5),
        _take(1, "a", 10.0, 10.01, 10.6),
        _take(2, "a", 10.2, 10.22, 10.9),  # a third while both are still out
    ]
    r = check(_limited(takes))
    assert any(v.startswith("per-key limit:") and "'a'" in v for v in r.violations), r.summary()


def test_a_job_whose_lease_ran_out_no_longer_counts_toward_its_key() -> None:
    # The first job's ack came after its visibility timeout: from then on it was not in flight.
    takes = [
        _take(0, "a", 10.0, 10.01, 13.0),
        _take(1, "a", 10.0, 10.01, 10.5),
        _take(2, "a", 12.1, 12.12, 12.5),
    ]
    assert check(_limited(takes)).ok
    # An ack that did not return (lease lost, nacked) ends nothing: the job counts no span at all.
    assert check(_limited([*takes[1:], _take(3, "a", 12.1, 12.12, None)])).ok


def test_more_jobs_than_the_rate_within_one_window_are_flagged() -> None:
    takes = [_take(i, None, 10.0 + 0.1 * i, 10.0 + 0.1 * i + 0.01, None) for i in range(6)]
    r = check(_limited(takes))
    assert any(v.startswith("rate limit:") and "6 jobs" in v for v in r.violations), r.summary()
    # Takes slow enough that they may have spanned a whole window are not a breach.
    slow = [_take(i, None, 10.0 + 0.1 * i, 11.2, None) for i in range(6)]
    assert check(_limited(slow)).ok


def test_a_delayed_job_handed_out_before_its_time_is_flagged() -> None:
    r = check(_limited([_take(0, None, 10.0, 10.2, 10.3)], not_before={"id-0-0": 10.5}))
    assert any(v.startswith("early:") and "0.300 s before" in v for v in r.violations), r.summary()


def test_a_tick_published_twice_or_left_out_is_flagged() -> None:
    ticks = [("s", "2026-01-01T00:00:00+00:00"), ("s", "2026-01-01T00:00:01+00:00")]
    assert check(_limited([], ticks=ticks, tick_every=1.0)).ok
    twice = check(_limited([], ticks=[*ticks, ticks[1]], tick_every=1.0))
    assert any(v.startswith("tick twice:") for v in twice.violations), twice.summary()
    gap = check(_limited([], ticks=[*ticks, ("s", "2026-01-01T00:00:03+00:00")], tick_every=1.0))
    assert any(v.startswith("tick missed:") for v in gap.violations), gap.summary()


def test_a_duplicate_after_an_async_commit_that_failed_is_explained_by_it(tmp_path: Path) -> None:
    from tests.chaos.harness import read_history

    # P-1 handled 0..1 and fired a commit that failed (the partition had moved on); P-0, its new
    # owner, reads them again from the last commit.
    (tmp_path / "groups.tsv").write_text("g-async\tcommit-async\n")
    (tmp_path / "acks-0.tsv").write_text("A\torders\t0\t0\tp-0\t99.0\nA\torders\t0\t1\tp-6\t99.0\n")
    handled = "D\tg-async\torders\t0\t0\tp-0\t{pid}\t{m}\t{g}\t{t0}\nD\tg-async\torders\t0\t1\tp-6\t{pid}\t{m}\t{g}\t{t1}\n"
    failed = "V\t101.8\tcommit_failed\tgroup=g-async since=101.100000\n"
    (tmp_path / "P-0-1.tsv").write_text(handled.format(pid=2, m="m2", g=2, t0=102.2, t1=102.3))
    (tmp_path / "P-1-1.tsv").write_text(handled.format(pid=1, m="m1", g=1, t0=101.0, t1=101.1) + failed)
    h = read_history(tmp_path, [], [])
    commit = next(f for f in h.faults if f.kind == "ack_failed")
    assert (commit.start, commit.end, commit.pid, commit.groups) == (101.1, 101.8, 1, frozenset({"g-async"}))
    r = check(h)
    assert r.ok and r.duplicates == 2 and r.explained_by["ack_failed"] == 2
    (tmp_path / "P-1-1.tsv").write_text(handled.format(pid=1, m="m1", g=1, t0=101.0, t1=101.1))
    unexplained = check(read_history(tmp_path, [], []))
    assert unexplained.unexplained_duplicates == 2 and not unexplained.ok
