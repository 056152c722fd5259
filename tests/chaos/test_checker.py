"""The chaos checker flags each kind of breach in a synthetic history, and passes a clean one."""

from __future__ import annotations

from dataclasses import replace

from tests.chaos.checker import Ack, Delivery, Fault, History, Sample, check


def _acks(n: int, partition: str = "0") -> list[Ack]:
    return [Ack("t", partition, i, f"id-{partition}-{i}", float(i)) for i in range(n)]


def _deliver(offsets: list[int], *, t0: float = 100.0, pid: int = 1, member: str = "m1", gen: int = 1,
             group: str = "g", partition: str = "0") -> list[Delivery]:
    return [
        Delivery(group, "t", partition, o, f"id-{partition}-{o}", pid, member, gen, t0 + i * 0.01, seq=i)
        for i, o in enumerate(offsets)
    ]


def _samples(values: list[tuple[float, int]], owner: str | None = "m1", epoch: int = 1) -> list[Sample]:
    return [Sample(t, "g", "t", "0", c, owner, epoch) for t, c in values]


def _history(deliveries: list[Delivery], samples: list[Sample] | None = None, faults: list[Fault] | None = None,
             acks: list[Ack] | None = None) -> History:
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
