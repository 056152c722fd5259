"""Every ```python block of the public contract (API.md) runs, as written, against a real Bus.

API.md is read from beside the repository (CI puts a copy at ``../shared/API.md`` next to the
clone), or from ``$BUS_API_MD``. When it cannot be found the test fails if ``$CI`` is set and is
skipped otherwise.

Each block is one parametrized test (id: block number and first line). Its fragment becomes the
body of ``async def _snippet(): ...`` (it ends in ``return locals()`` so the test can look at
what it made), compiled with API.md's own line numbers (a traceback points at API.md), and run
with a timeout in a namespace prepared by the block's setup (found by a phrase the block
contains): a Bus ``b`` on the test's fresh schema, the names the fragment leaves undefined
(``payload``, ``handler``, ``MyStruct``, ``tp``, ``offset``, ``c`` ...), the topics, groups and
messages it expects. After it ran, the setup's check asserts what the fragment implies.

What is not run literally, and how it is rewritten (nothing else is):

1. ``-> T`` after a call is a return annotation, not Python: it is removed, and the statement
   it ends is checked to produce a ``T`` (``x = await f() -> T`` becomes
   ``x = _returns(await f(), "T")``; a bare ``await f() -> T`` becomes ``_returns(await f(), "T")``).
2. ``...`` placeholders: a keyword argument ``name=...`` gets the value the block's setup
   gives for ``name``; a positional ``...`` argument gets the setup's ``"..."`` value; a ``...``
   element of a list literal ("and more like it") is dropped; a string with `` ...`` in it
   (``"INSERT INTO seen ..."``) gets the setup's value for that string; a ``{...}`` (an elided
   dict) gets the setup's value for ``"{...}"``. A bare ``...`` statement (an elided body) stays:
   it is valid Python and does nothing.
3. ``async for m in c: ...`` (a loop with an elided body) takes one item: its body becomes ``break``.
4. Where a fragment relies on something it never makes from its own results, one statement is
   inserted after a given line (``Plan.insert_after``): block "Queues" gets ``job = jobs[0]`` after
   the take (it acks a ``job`` it never picks); block "Event store" gets an append of
   ``UserJoinedCourse(course_name="Algebra", user_id="joe")`` after its append, since its
   ``claim_next(partition_by=["course_name", "user_id"])`` finds partitions only in events that
   carry both attributes and the fragment appends a ``CourseCreated`` alone (without it
   ``claim_next`` returns None and ``c.offset_id`` fails).
5. Lines that list alternative calls on one object (claim: ``ack()`` / ``ack(offset)`` /
   ``release()`` / ``extend(seconds)``; queue: ``ack(job) ; nack(job)``) run one at a time: the
   block runs once per alternative, with the other alternatives left out. Read top to bottom
   they would act on an object already finished by the first (an ``extend`` after an ``ack``).
   Block "Queue features" runs once with its ``cancel_job`` and once with its ``job_result``
   instead (the result of a job cancelled before its take is a JobFailedError, not a value).
6. Comments are ignored, as Python ignores them; values a comment promises are asserted by the
   block's check instead.
"""

from __future__ import annotations

import ast
import asyncio
import io
import os
import re
import textwrap
import tokenize
import types
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest

import bus
from bus.testing import FAST  # short sessions and debounce: groups join in a fraction of a second

HERE = Path(__file__).resolve()
# ../shared/API.md beside the repository clone (parents[2] is the repository itself).
CANDIDATES = [HERE.parents[3] / "shared" / "API.md", HERE.parents[2] / "shared" / "API.md"]
TIMEOUT = 20.0


def api_md() -> Path | None:
    """Where API.md is, or None."""
    explicit = os.environ.get("BUS_API_MD")
    paths = [Path(explicit)] if explicit else CANDIDATES
    return next((p for p in paths if p.is_file()), None)


@dataclass(frozen=True)
class Block:
    """One ```python block of API.md."""

    index: int
    line: int  # API.md line of the block's first code line
    code: str

    @property
    def first_line(self) -> str:
        return self.code.splitlines()[0].strip()


def blocks() -> list[Block]:
    """Every ```python block of API.md, in order."""
    path = api_md()
    if path is None:
        return []
    text = path.read_text()
    found = []
    for i, match in enumerate(re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M)):
        line = text.count("\n", 0, match.start(1)) + 1
        found.append(Block(i, line, match.group(1)))
    return found


# -- the transformation ---------------------------------------------------------------------------


def strip_annotations(code: str) -> tuple[str, dict[int, str]]:
    """Rule 1: remove each `-> T` (up to a comment or the end of its line); {line: "T"}."""
    lines = code.splitlines(keepends=True)
    found: dict[int, str] = {}
    tokens = list(tokenize.generate_tokens(io.StringIO(code).readline))
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.OP and tok.string == "->":
            row, col = tok.start
            if lines[row - 1].lstrip().startswith(("def ", "async def ")):
                continue  # a function's own return annotation is Python
            end = next(
                t.start[1]
                for t in tokens[i + 1 :]
                if t.start[0] != row or t.type in (tokenize.COMMENT, tokenize.NEWLINE, tokenize.NL)
            )
            text = lines[row - 1]
            end = end if end > col else len(text.rstrip("\n"))
            found[row] = text[tok.end[1] : end].strip()
            lines[row - 1] = text[:col] + " " * (end - col) + text[end:]
    return "".join(lines), found


@dataclass
class Plan:
    """What a block's setup prepared."""

    names: dict[str, Any] = field(default_factory=dict)
    fill: dict[str, str] = field(default_factory=dict)  # rule 2: placeholder -> Python expression
    insert_after: dict[str, str] = field(default_factory=dict)  # rule 4: statement text -> statement
    menu: list[str] = field(default_factory=list)  # rule 5: alternative statements (their source)
    check: Callable[[dict[str, Any], str | None], Awaitable[None]] | None = None


class _Placeholders(ast.NodeTransformer):
    """Rule 2."""

    def __init__(self, fill: dict[str, str]) -> None:
        self.fill = fill

    def _value(self, key: str) -> ast.expr:
        if key not in self.fill:
            raise AssertionError(f"the block's setup gives no value for the placeholder {key!r}")
        text = self.fill[key]
        if text.startswith("*"):  # several positional arguments: `*(a, b)`
            return ast.Starred(ast.parse(text[1:], mode="eval").body, ast.Load())
        return ast.parse(text, mode="eval").body

    @staticmethod
    def _elided(node: ast.AST) -> bool:
        return isinstance(node, ast.Constant) and node.value is Ellipsis

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        for kw in node.keywords:
            if kw.arg is not None and self._elided(kw.value):
                kw.value = self._value(kw.arg)
        node.args = [self._value("...") if self._elided(a) else a for a in node.args]
        return node

    def visit_List(self, node: ast.List) -> ast.AST:
        self.generic_visit(node)
        node.elts = [e for e in node.elts if not self._elided(e)]
        return node

    def visit_Set(self, node: ast.Set) -> ast.AST:
        if len(node.elts) == 1 and self._elided(node.elts[0]):
            return self._value("{...}")
        return self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        if isinstance(node.value, str) and " ..." in node.value:
            return self._value(node.value)
        return node


def build(block: Block, plan: Plan, keep: str | None) -> types.CodeType:
    """The block as `async def _snippet()`, rewritten by rules 1-5 (`keep`: the menu item kept)."""
    code, annotations = strip_annotations(block.code)
    source = "async def _snippet():\n" + textwrap.indent(code, "    ") + "\n    return locals()\n"
    tree = ast.parse(source)
    wanted = {line + 1: t for line, t in annotations.items()}  # +1: the `async def` line
    used: set[int] = set()
    inserted: set[str] = set()

    def segment(stmt: ast.stmt) -> str:
        return (ast.get_source_segment(source, stmt) or "").strip()

    def rewrite(body: list[ast.stmt]) -> list[ast.stmt]:
        out: list[ast.stmt] = []
        for at, stmt in enumerate(body):
            text = segment(stmt)
            if text in plan.menu and text != keep:
                continue  # rule 5
            for name in ("body", "orelse", "finalbody"):
                inner = getattr(stmt, name, None)
                if isinstance(inner, list) and inner and not isinstance(stmt, ast.ClassDef):
                    setattr(stmt, name, rewrite(inner))
            if (
                isinstance(stmt, (ast.For, ast.AsyncFor))
                and len(stmt.body) == 1
                and isinstance(stmt.body[0], ast.Expr)
                and _Placeholders._elided(stmt.body[0].value)
            ):
                stmt.body = [ast.copy_location(ast.Break(), stmt.body[0])]  # rule 3
            end = stmt.end_lineno or stmt.lineno
            # `a();  b() -> T`: the annotation is the line's last statement's
            last_on_line = all((later.end_lineno or later.lineno) != end for later in body[at + 1 :])
            if end in wanted and last_on_line and isinstance(stmt, (ast.Expr, ast.Assign)):
                used.add(end)
                stmt.value = ast.Call(
                    func=ast.Name("_returns", ast.Load()),
                    args=[stmt.value, ast.Constant(wanted[end]), ast.Constant(block.line + end - 2)],
                    keywords=[],
                )
            out.append(stmt)
            for marker, extra in plan.insert_after.items():
                if marker in text:
                    inserted.add(marker)
                    out.extend(ast.parse(extra).body)  # rule 4
        return out

    fn = tree.body[0]
    assert isinstance(fn, ast.AsyncFunctionDef)
    fn.body = rewrite(fn.body)
    assert used == set(wanted), f"annotations not attached to a statement: {set(wanted) - used}"
    assert inserted == set(plan.insert_after), (
        f"insert_after markers not found: {set(plan.insert_after) - inserted}"
    )
    tree = _Placeholders(plan.fill).visit(tree)
    ast.fix_missing_locations(tree)
    ast.increment_lineno(tree, block.line - 2)
    return compile(tree, "API.md", "exec")


TYPE_NAMES = {k: getattr(bus, k) for k in dir(bus) if not k.startswith("_")} | {"bus": bus}  # lazy names too


def conforms(value: Any, tp: Any) -> bool:
    """isinstance for the annotations API.md uses: classes, `list[X]`, `set[X]`, `dict[K, V]`, `X | None`."""
    if tp is None or tp is type(None):
        return value is None
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        return any(conforms(value, a) for a in typing.get_args(tp))
    if origin in (list, set, tuple):
        (item,) = typing.get_args(tp)[:1]
        return isinstance(value, origin) and all(conforms(v, item) for v in value)
    if origin is dict:
        key, val = typing.get_args(tp)
        return isinstance(value, dict) and all(
            conforms(k, key) and conforms(v, val) for k, v in value.items()
        )
    return isinstance(value, tp)


def make_returns(log: list[tuple[str, Any]]) -> Callable[[Any, str, int], Any]:
    def _returns(value: Any, annotation: str, line: int) -> Any:
        tp = eval(annotation, dict(TYPE_NAMES))  # noqa: S307 - an annotation written in API.md
        assert conforms(value, tp), f"API.md line {line}: expected {annotation}, got {value!r}"
        log.append((annotation, value))
        return value

    return _returns


# -- the blocks' setups and checks -----------------------------------------------------------------


class MyStruct(msgspec.Struct):
    """The type the consumer block decodes into."""

    order_id: int
    item: str


@dataclass
class Ctx:
    b: bus.Bus
    connect: Callable[..., Any]
    dsn: str
    schema: str
    monkeypatch: pytest.MonkeyPatch
    returned: list[tuple[str, Any]]


def _returned(ctx: Ctx, annotation: str) -> list[Any]:
    return [v for a, v in ctx.returned if a == annotation]


async def setup_connecting(ctx: Ctx) -> Plan:
    # dsn=None means $BUS_DSN: point it at the test server; **config puts the Bus on the test's schema.
    ctx.monkeypatch.setenv("BUS_DSN", ctx.dsn)
    config = {"schema": ctx.schema, **FAST}

    async def check(got: dict[str, Any], _: str | None) -> None:
        assert isinstance(got["b"], bus.Bus)
        assert got["b"].dsn == ctx.dsn
        assert got["b"].config.schema == ctx.schema

    return Plan(names={"config": config}, check=check)


async def setup_topics(ctx: Ctx) -> Plan:
    async def check(got: dict[str, Any], _: str | None) -> None:
        info = got["info"]
        assert isinstance(info, bus.TopicInfo)
        assert (info.name, info.partitions, info.semantics, info.cleanup) == ("orders", 8, "pubsub", "delete")
        assert (info.retention, info.namespace, info.task) == (timedelta(days=7), "shop", "billing")
        (listed,) = _returned(ctx, "list[TopicInfo]")
        assert [t.name for t in listed] == ["orders"]
        assert await ctx.b.list_topics() == []  # deleted by the block's last line

    return Plan(names={"timedelta": timedelta}, check=check)


async def setup_publishing(ctx: Ctx) -> Plan:
    await ctx.b.create_topic("orders", partitions=8)
    fill = {"key": '"cust-2"', "partition": '"5"', "headers": '{"h": "2"}'}

    async def check(got: dict[str, Any], _: str | None) -> None:
        rec, (one,) = got["rec"], got["recs"]
        assert isinstance(rec, bus.Record) and rec.topic == "orders"
        (m,) = await ctx.b.read("orders", partition=rec.partition, offset=rec.offset, max_messages=1)
        assert (m.key, m.headers, m.value(dict)) == ("cust-1", {"k": "v"}, {"order_id": 1})
        assert (one.topic, one.partition) == ("orders", "5")
        (m,) = await ctx.b.read("orders", partition="5", offset=one.offset, max_messages=1)
        assert (m.key, m.headers, m.value(dict)) == ("cust-2", {"h": "2"}, {"order_id": 1})

    return Plan(names={"payload": {"order_id": 1}}, fill=fill, check=check)


async def setup_consumer(ctx: Ctx) -> Plan:
    await ctx.b.create_topic("orders", partitions=1)
    # More than one poll's worth (max_poll_records=500), so `async for` after the poll finds one.
    sent = [MyStruct(order_id=i, item=f"item-{i}") for i in range(520)]
    await ctx.b.publish_many("orders", [bus.Outgoing(s, key=f"cust-{i % 7}") for i, s in enumerate(sent)])
    tp = bus.TopicPartition("orders", "0")

    async def check(got: dict[str, Any], _: str | None) -> None:
        batch, m = got["batch"], got["m"]
        assert batch and all(isinstance(x, bus.Message) for x in batch)
        assert [x.offset for x in batch] == list(range(len(batch)))
        assert isinstance(m, bus.Message) and m.offset == len(batch)  # the next one, in order
        assert m.value(MyStruct) == sent[m.offset]
        group = await ctx.b.admin.describe_group("email")
        assert group.members == []  # leaving the block left the group
        (lag,) = group.partitions
        # `await c.commit()` committed everything polled (the batch and the poll behind `async for`);
        # the later seek back to 0 polled nothing, so leaving the block had nothing newer to commit.
        assert lag.committed is not None and len(batch) < lag.committed <= len(sent)

    return Plan(names={"tp": tp, "offset": 0, "MyStruct": MyStruct}, check=check)


async def setup_subscribe(ctx: Ctx) -> Plan:
    await ctx.b.create_topic("orders", partitions=2)
    await ctx.b.create_topic("orders.dlq", partitions=1)
    seen: list[bus.Message] = []

    async def handler(m: bus.Message) -> None:
        seen.append(m)

    async def check(got: dict[str, Any], _: str | None) -> None:
        assert isinstance(got["sub"], bus.Subscription)
        group = await ctx.b.admin.describe_group("email")
        assert group.subscription.start == "earliest"
        assert group.members == []  # stopped: it left the group
        assert all(isinstance(m, bus.Message) for m in seen)

    return Plan(names={"handler": handler}, check=check)


CLAIM_MENU = [
    "await claim.ack()",
    "await claim.ack(offset)",
    "await claim.release()",
    "await claim.extend(seconds)",
]


async def setup_claims(ctx: Ctx) -> Plan:
    await ctx.b.create_topic("orders", partitions=1)
    await ctx.b.publish_many("orders", [bus.Outgoing({"n": i}) for i in range(250)])
    claims: dict[str, bus.Claim] = {}

    async def check(got: dict[str, Any], keep: str | None) -> None:
        claim = got["claim"]
        assert isinstance(claim, bus.Claim) and (claim.topic, claim.partition) == ("orders", "0")
        assert claim.messages and all(isinstance(m, bus.Message) for m in claim.messages)
        assert keep is not None
        claims[keep] = claim
        first = claim.messages[0].offset
        # The alternatives run in menu order, each on the cursor the previous one left.
        expected_first = {CLAIM_MENU[0]: 0, CLAIM_MENU[1]: 100, CLAIM_MENU[2]: 151, CLAIM_MENU[3]: 151}
        assert first == expected_first[keep], (keep, first)
        assert len(claim.messages) == min(100, 250 - first)
        if keep == "await claim.extend(seconds)":
            assert claim.lease_expires_at > datetime.now(claim.lease_expires_at.tzinfo) + timedelta(
                seconds=60
            )
            # Held: nobody else gets the partition while the lease lasts.
            assert await ctx.b.claim("billing", topic="orders", worker_id="w-2") is None

    return Plan(names={"offset": 150, "seconds": 90.0}, menu=CLAIM_MENU, check=check)


async def setup_queues(ctx: Ctx) -> Plan:
    await ctx.b.create_topic("jobs", partitions=2, semantics="queue")
    await ctx.b.create_topic("jobs.dlq", partitions=1)
    await ctx.b.publish_many("jobs", [bus.Outgoing({"job": i}, key=f"k{i}") for i in range(4)])

    async def check(got: dict[str, Any], keep: str | None) -> None:
        jobs, job = got["jobs"], got["job"]
        assert jobs and all(isinstance(j, bus.Message) for j in jobs)
        assert job.topic == "jobs"
        if keep == "await q.nack(job, delay=2.0)":
            # Back in the queue, not visible for the delay.
            async with ctx.b.queue_consumer("jobs") as other:
                again = await other.take(max_messages=10, timeout=0.3)
                assert (job.partition, job.offset) not in {(j.partition, j.offset) for j in again}

    return Plan(
        insert_after={"jobs = await q.take(": "job = jobs[0]"},
        menu=["await q.ack(job)", "await q.nack(job, delay=2.0)"],
        check=check,
    )


async def setup_where_services_run(ctx: Ctx) -> Plan:
    """bus.connect() is lazy: the block makes connectors; the check opens nothing but reads their settings."""
    made: list[tuple[str | None, dict[str, Any], Any]] = []
    real = bus.connect

    def recording(dsn: str | None = None, **config: Any) -> Any:
        connector = real(dsn, **config)
        made.append((dsn, config, connector))
        return connector

    ctx.monkeypatch.setattr(bus, "connect", recording)

    async def check(got: dict[str, Any], _: str | None) -> None:
        (pooled_dsn, pooled, _c), (ha_dsn, ha, last) = made
        assert got["b"] is last  # the block's second connector
        settings = bus.Config.load(pooled)
        assert (settings.pooler, settings.direct_dsn) == ("transaction", "postgresql://app@db:5432/app")
        assert not settings.listens or settings.direct_dsn is not None
        assert pooled_dsn is not None and "6432" in pooled_dsn
        assert ha == {} and ha_dsn is not None and "target_session_attrs=read-write" in ha_dsn
        assert bus.Config.load(ha).pooler is None

    return Plan(check=check)


async def setup_kafka_consumer(ctx: Ctx) -> Plan:
    """A started poll consumer `c` that owns both partitions of "orders" and polled from them."""
    await ctx.b.create_topic("orders", partitions=2)
    for p in ("0", "1"):
        await ctx.b.publish_many("orders", [bus.Outgoing({"i": i}, partition=p) for i in range(3)])
    since = datetime.now(UTC)
    for p in ("0", "1"):
        await ctx.b.publish_many("orders", [bus.Outgoing({"i": i}, partition=p) for i in range(3, 5)])
    c = ctx.b.consumer("reports", topics=["orders"], start="earliest", auto_commit=False)
    await c.start()
    await c.wait_assigned(10)
    tps = [bus.TopicPartition("orders", "0"), bus.TopicPartition("orders", "1")]
    deadline = asyncio.get_running_loop().time() + 10
    polled: set[str] = set()
    while polled != {"0", "1"} and asyncio.get_running_loop().time() < deadline:
        polled |= {m.partition for m in await c.poll(timeout=0.2)}
    await c.commit()

    async def check(got: dict[str, Any], _: str | None) -> None:
        try:
            assert _returned(ctx, "set[TopicPartition]") == [set()]  # paused, then resumed
            (position,) = _returned(ctx, "int")
            assert 0 < position <= 5
            (committed,) = _returned(ctx, "int | None")
            assert committed is not None and 0 < committed <= 5
            assert _returned(ctx, "dict[TopicPartition, int]") == [
                {tp: 0 for tp in tps},
                {tp: 5 for tp in tps},
            ]
            assert _returned(ctx, "dict[TopicPartition, int | None]") == [{tps[0]: 3}]
            # seek_to_end ran last: both partitions continue after their last message.
            assert [await c.position(tp) for tp in tps] == [5, 5]
            assert await c.poll(timeout=0.3) == []
        finally:
            await c.close()

    return Plan(names={"c": c, "tps": tps, "tp": tps[0], "datetime": since}, check=check)


async def setup_queue_features(ctx: Ctx) -> Plan:
    if not hasattr(bus.Bus, "schedule"):
        pytest.skip("the block's b.schedule/unschedule/schedules come with the scheduler")
    cancel = 'await b.admin.cancel_job("jobs", rec)'
    await ctx.b.create_topic("jobs", partitions=8, semantics="queue")

    async def check(got: dict[str, Any], keep: str | None) -> None:
        b, rec = ctx.b, got["rec"]
        assert isinstance(rec, bus.Record) and rec.topic == "jobs"
        per_key, rate, paused, ttl = await b.admin.queue_settings("jobs")
        assert (per_key, rate, paused, ttl) == (None, None, False, timedelta(days=1))
        async with b.queue_consumer("jobs") as q:  # the delayed job is not due for 5 minutes
            assert await q.take(max_messages=10, timeout=0.2) == []
        if keep == cancel:
            with pytest.raises(bus.JobFailedError) as failed:
                await b.job_result("jobs", rec, timeout=0.5)
            assert failed.value.status == "cancelled"
        else:
            assert got["value"] == {"rows": 42}
        assert "nightly" not in [s.name for s in await b.schedules()]

    return Plan(
        names={"payload": {"report": "x"}, "timedelta": timedelta, "datetime": datetime},
        menu=[cancel, 'value = await b.job_result("jobs", rec, timeout=30.0)'],
        check=check,
    )


async def setup_reader(ctx: Ctx) -> Plan:
    await ctx.b.create_topic("orders", partitions=8)
    for i in range(3):
        await ctx.b.publish("orders", {"n": i}, partition="3")

    async def check(got: dict[str, Any], _: str | None) -> None:
        msgs = got["msgs"]
        assert [(m.partition, m.offset, m.value(dict)) for m in msgs] == [
            ("3", i, {"n": i}) for i in range(3)
        ]

    return Plan(check=check)


async def setup_event_store(ctx: Ctx) -> Plan:
    # The block defines the event classes; a registry of tags of its own keeps them from clashing
    # with (or outliving) classes of other tests in this process.
    ctx.monkeypatch.setattr(bus.eventstore, "_registry", dict(bus.eventstore._registry))
    fill = {"...": '"enrollment"'}
    # claim_next(partition_by=["course_name", "user_id"]) finds partitions only in events carrying
    # both attributes (SEMANTICS.md 2); the block appends a CourseCreated alone, so without this
    # claim_next returns None and the block's `c.offset_id` fails.
    joined = 'await store.append(UserJoinedCourse(course_name="Algebra", user_id="joe"))'

    async def check(got: dict[str, Any], _: str | None) -> None:
        created, joined_cls = got["CourseCreated"], got["UserJoinedCourse"]
        assert created.payload_attribute_names() == ("course_name",)
        assert created.to_conditions(course_name="Algebra", user_id="joe") == [
            bus.QueryCondition("course.created", "course_name", "Algebra")
        ]
        (rec,) = got["recs"]
        assert rec.position == 1
        (active,) = _returned(ctx, "bool")
        assert active is True
        claim = got["c"]
        assert isinstance(claim, bus.EventClaim)
        assert claim.partition_value == {"course_name": "Algebra", "user_id": "joe"}
        both = [created(course_name="Algebra"), joined_cls(course_name="Algebra", user_id="joe")]
        assert [e.message for e in claim.messages] == both  # conditional AND: CourseCreated is in it
        assert claim.guard.position == claim.messages[-1].position
        (events,) = _returned(ctx, "list[PositionedEvent]")
        assert [e.message for e in events] == both
        # Acked: nothing is pending for that partition any more.
        again = await ctx.b.event_store("courses").claim_next(
            "enrollment",
            partition_by=["course_name", "user_id"],
            handled_types=[created, joined_cls],
            worker_id="w-2",
        )
        assert again is None

    return Plan(fill=fill, insert_after={"recs = await store.append(": joined}, check=check)


async def setup_admin(ctx: Ctx) -> Plan:
    await ctx.b.create_topic("orders", partitions=2)
    await ctx.b.publish_many("orders", [bus.Outgoing({"n": i}, partition=str(i % 2)) for i in range(6)])
    async with ctx.b.consumer("email", topics=["orders"]) as c:
        got: list[bus.Message] = []
        while len(got) < 6:
            got += await c.poll(timeout=5.0)
        await c.commit()

    async def check(got: dict[str, Any], _: str | None) -> None:
        (groups,) = _returned(ctx, "list[bus.GroupSummary]")
        assert [g.name for g in groups] == ["email"]
        (described,) = _returned(ctx, "bus.GroupDescription")
        assert [(p.topic, p.partition, p.committed, p.lag) for p in described.partitions] == [
            ("orders", "0", 3, 0),
            ("orders", "1", 3, 0),
        ]
        assert await ctx.b.admin.list_groups() == []  # deleted by the block
        (stats,) = _returned(ctx, "list[bus.PartitionStats]")
        assert sorted((s.partition, s.end_offset) for s in stats) == [("0", 3), ("1", 3)]

    return Plan(names={"timedelta": timedelta}, check=check)


async def setup_transaction(ctx: Ctx) -> Plan:
    await ctx.b.create_topic("orders", partitions=1)
    await ctx.b.publish_many("orders", [bus.Outgoing({"n": i}) for i in range(5)])
    # tx.connection has PostgreSQL's default search_path: the user's own table, named in full.
    table = f"{ctx.schema}.seen"
    await ctx.b.pool.execute(f"CREATE TABLE {table} (topic text, part text, off bigint)")
    c = ctx.b.consumer("g", topics=["orders"], auto_commit=False)
    await c.__aenter__()
    await c.wait_assigned(timeout=10.0)
    fill = {
        "INSERT INTO seen ...": f'"INSERT INTO {table} (topic, part, off) VALUES ($1, $2, $3)"',
        "...": "*(m.topic, m.partition, m.offset)",
    }

    async def check(got: dict[str, Any], _: str | None) -> None:
        try:
            rows = await ctx.b.pool.fetch(f"SELECT off FROM {table} ORDER BY off")
            assert [r["off"] for r in rows] == list(range(5))
            (lag,) = (await ctx.b.admin.describe_group("g")).partitions
            assert lag.committed == 5  # the offsets committed with the rows
            assert await c.poll(timeout=0.2) == []  # and nothing comes again after the rewind
        finally:
            await c.close()

    return Plan(names={"c": c}, fill=fill, check=check)


async def setup_transactional_handler(ctx: Ctx) -> Plan:
    from bus.testing import eventually

    await ctx.b.create_topic("orders", partitions=2)
    await ctx.b.create_topic("receipts", partitions=1)
    await ctx.b.publish_many("orders", [bus.Outgoing({"n": i}) for i in range(6)])
    table = f"{ctx.schema}.payments"
    await ctx.b.pool.execute(f"CREATE TABLE {table} (id serial PRIMARY KEY)")
    fill = {
        "INSERT INTO payments ...": f'"INSERT INTO {table} DEFAULT VALUES"',
        "{...}": '{"receipt": True}',
    }

    async def check(got: dict[str, Any], _: str | None) -> None:
        sub = got["sub"]
        try:
            await eventually(lambda: sub.processed == 6)
        finally:
            await sub.stop()
        assert await ctx.b.pool.fetchval(f"SELECT count(*) FROM {table}") == 6
        assert len(await ctx.b.read("receipts", partition="0")) == 6
        lags = (await ctx.b.admin.describe_group("billing")).partitions
        assert sum(p.committed or 0 for p in lags) == 6  # the offsets committed with the rows

    return Plan(fill=fill, check=check)


async def setup_idempotent(ctx: Ctx) -> Plan:
    await ctx.b.create_topic("orders", partitions=4)

    async def check(got: dict[str, Any], _: str | None) -> None:
        rec = got["rec"]
        assert isinstance(rec, bus.Record)
        again = await ctx.b.publish("orders", {"order_id": 42}, idempotency_key="order-42")
        assert (again.partition, again.offset) == (rec.partition, rec.offset)
        stats = await ctx.b.admin.topic_stats("orders")
        assert sum(s.end_offset for s in stats) == 1  # one copy

    return Plan(names={"payload": {"order_id": 42}}, check=check)


async def setup_faststream(ctx: Ctx) -> Plan:
    # BusBroker() takes bus.connect()'s defaults: $BUS_DSN and $BUS_SCHEMA point it at the test's schema.
    import pydantic

    from bus.client import key_partition

    ctx.monkeypatch.setenv("BUS_DSN", ctx.dsn)
    ctx.monkeypatch.setenv("BUS_SCHEMA", ctx.schema)
    await ctx.b.create_topic("orders", partitions=4)

    class Order(pydantic.BaseModel):
        id: int
        amount: int

    async def check(got: dict[str, Any], _: str | None) -> None:
        broker = got["broker"]
        try:
            # The real publish went through PostgreSQL (to the key's partition); the in-memory one did not.
            (m,) = await ctx.b.read("orders", partition=key_partition("cust-1", 4), offset=0)
            assert (m.key, m.value(dict)) == ("cust-1", {"id": 1, "amount": 3})
            stats = await ctx.b.admin.topic_stats("orders")
            assert sum(s.end_offset for s in stats) == 1
            assert got["app"].broker is broker
        finally:
            await broker.stop()

    return Plan(names={"Order": Order}, check=check)


async def setup_faststream_ecosystem(ctx: Ctx) -> Plan:
    # A started broker on the test's schema: a subscriber that answers "quotes", one read by get_one.
    import msgspec

    from bus.faststream import BusBroker

    class Order(msgspec.Struct):
        id: int
        amount: int

    broker = BusBroker(ctx.dsn, schema=ctx.schema, create_topics=True, **FAST)

    @broker.subscriber("quotes", group="pricing")
    async def quote(order: Order) -> dict[str, int]:
        return {"id": order.id, "price": order.amount * 10}

    sub = broker.subscriber("events", group="reader")
    await broker.start()
    await broker.publish({"event": 1}, "events")

    async def check(got: dict[str, Any], _: str | None) -> None:
        try:
            assert await got["reply"].decode() == {"id": 1, "price": 30}
            assert await got["msg"].decode() == {"event": 1}
            assert [m.value(dict)["id"] for m in await ctx.b.read("orders")] == [1, 2, 3]
            assert got["router"] in broker.routers
        finally:
            await broker.stop()

    return Plan(
        names={
            "broker": broker,
            "Order": Order,
            "sub": sub,
            **{f"o{i}": Order(id=i, amount=i) for i in (1, 2, 3)},
        },
        check=check,
    )


Setup = Callable[[Ctx], Awaitable[Plan]]


# phrase (unique to one block) -> (setup, xfail reason or None)
async def setup_workflows(ctx: Ctx) -> Plan:
    import msgspec

    table = f"{ctx.schema}.payments"
    await ctx.b.pool.execute(f"CREATE TABLE {table} (order_id text PRIMARY KEY)")
    await ctx.b.create_topic("shipments", partitions=2)

    class Order(msgspec.Struct):
        id: str
        items: list[int]

    class Receipt(msgspec.Struct):
        card: str
        packed: list[int]
        shipped: bool
        ok: bool

    charged: list[str] = []

    def charge_card(order: Order) -> str:
        charged.append(order.id)
        return f"card-{order.id}"

    def refund(card: str) -> None:
        raise AssertionError("nothing failed: no compensation runs")

    @ctx.b.workflow("pack")
    async def pack(wctx: bus.WorkflowContext, item: int) -> int:
        return item * 10

    def short(hours: float = 0, days: float = 0) -> timedelta:
        """The snippet's hours and days, as tenths of a second and seconds."""
        return timedelta(seconds=hours * 0.1 + days * 10)

    order = Order(id="1", items=[1, 2, 3])
    await ctx.b.send("order-1", "approval", True)  # kept until the run receives it

    async def check(got: dict[str, Any], _: str | None) -> None:
        assert got["receipt"] == Receipt(card="card-1", packed=[10, 20, 30], shipped=True, ok=True)
        assert charged == ["1"]
        assert await ctx.b.pool.fetchval(f"SELECT count(*) FROM {table}") == 1
        assert await ctx.b.get_event("order-1", "status") == "shipped"
        assert (await ctx.b.admin.workflow("order-1")).status == "succeeded"
        forks = [w for w in await ctx.b.admin.workflows(name="checkout") if w.workflow_id != "order-1"]
        assert len(forks) == 1 and forks[0].steps[0].name.endswith(
            "charge_card"
        )  # steps 1-2 kept by the fork

    return Plan(
        names={
            "Order": Order,
            "Receipt": Receipt,
            "charge_card": charge_card,
            "refund": refund,
            "order": order,
            "wid": "order-1",
            "timedelta": short,
        },
        fill={
            "INSERT INTO payments ...": f'"INSERT INTO {table} (order_id) VALUES (1)"',
            "...": "*(card, packed, shipped is not None, ok)",
        },
        insert_after={
            'run = await b.start_workflow("checkout"': 'await b.publish("shipments", {"carrier": "ups"}, key=order.id)'
        },
        check=check,
    )


async def setup_job_features(ctx: Ctx) -> Plan:
    # "jobs" is made as the block's create_topic makes it (fair), so that call finds it there;
    # a consumer `q` holds one job (`job`) for the progress call; `rec` is another job's record.
    await ctx.b.create_topic("jobs", semantics="queue", fair=True)
    await ctx.b.create_topic("jobs.done", partitions=1)
    held = await ctx.b.publish("jobs", {"held": 1})
    q = ctx.b.queue_consumer("jobs", visibility_timeout=30)
    await q.start()
    (job,) = await q.take(max_messages=1, timeout=5.0)
    assert job.offset == held.offset
    rec = await ctx.b.publish("jobs", {"resize": 7})

    async def check(got: dict[str, Any], _: str | None) -> None:
        try:
            b = ctx.b
            assert isinstance(got["w"], bus.Worker)
            status = await b.job_status("jobs", held)
            assert status.state == "running" and status.progress == {"done": 40, "of": 100}
            again = await b.publish("jobs", {"other": 1}, unique=bus.Unique("report:42"))
            assert isinstance(again, bus.Record)
            assert isinstance(got["group"], bus.JobGroup)
            assert await b.read("jobs.done") == []  # the group's jobs are waiting: no callback yet
        finally:
            await q.close()

    return Plan(
        names={
            "payload": {"report": 42},
            "timedelta": timedelta,
            "q": q,
            "job": job,
            "rec": rec,
            "outgoing_list": [bus.Outgoing({"n": i}) for i in range(3)],
        },
        check=check,
    )


SETUPS: dict[str, tuple[Setup, str | None]] = {
    "async with bus.connect(dsn=None, **config) as b:": (setup_connecting, None),
    "info = await b.create_topic(": (setup_topics, None),
    "recs = await b.publish_many(": (setup_publishing, None),
    'c = b.consumer("email", topics=["orders"],': (setup_consumer, None),
    'sub = await b.subscribe("email", handler,': (setup_subscribe, None),
    'claim = await b.claim("billing", topic="orders",': (setup_claims, None),
    'q = b.queue_consumer("jobs",': (setup_queues, None),
    'msgs = await b.read("orders", partition="3"': (setup_reader, None),
    'class CourseCreated(bus.Event, tag="course.created"):': (setup_event_store, None),
    "a = b.admin": (setup_admin, None),
    "async with c.transaction() as tx:": (setup_transaction, None),
    "transactional=True,": (setup_transactional_handler, None),
    'idempotency_key="order-42")': (setup_idempotent, None),
    "await b.admin.pause_queue(": (setup_queue_features, None),
    "await c.offsets_for_times(": (setup_kafka_consumer, None),
    'pooler="transaction",': (setup_where_services_run, None),
    "from bus.faststream import BusBroker, TestBusBroker": (setup_faststream, None),
    "router = bus.faststream.BusRouter(prefix=": (setup_faststream_ecosystem, None),
    '@b.workflow("checkout")': (setup_workflows, None),
    'w = await b.worker("jobs", resize, concurrency=16)': (setup_job_features, None),
}


def setup_of(block: Block) -> tuple[str, Setup, str | None] | None:
    hits = [(p, s, x) for p, (s, x) in SETUPS.items() if p in block.code]
    assert len(hits) <= 1, f"block {block.index} matches several setups: {[h[0] for h in hits]}"
    return hits[0] if hits else None


def _params() -> list[Any]:
    found = blocks()
    if not found:
        return [pytest.param(None, id="API.md-not-found")]
    params = []
    for block in found:
        hit = setup_of(block)
        marks = [pytest.mark.xfail(strict=True, reason=hit[2])] if hit and hit[2] else []
        params.append(pytest.param(block, id=f"{block.index}-{block.first_line[:40].strip()}", marks=marks))
    return params


def _missing() -> None:
    where = ", ".join(str(p) for p in CANDIDATES)
    message = f"API.md not found (looked at $BUS_API_MD, {where}); the contract's snippets cannot be checked"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.mark.parametrize("block", _params())
async def test_api_snippet_runs(
    block: Block | None, connect: Any, dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if block is None:
        _missing()
        return
    hit = setup_of(block)
    assert hit is not None, (
        f"API.md block {block.index} ({block.first_line!r}) has no setup: add one to SETUPS"
    )
    _, setup, _ = hit
    returned: list[tuple[str, Any]] = []
    b = await connect(**FAST)
    ctx = Ctx(b, connect, dsn, schema, monkeypatch, returned)
    plan = await setup(ctx)
    for keep in plan.menu or [None]:
        returned.clear()
        namespace: dict[str, Any] = {
            "__name__": "api_snippet",
            "bus": bus,
            "asyncio": asyncio,
            "b": b,
            "_returns": make_returns(returned),
            **plan.names,
        }
        exec(build(block, plan, keep), namespace)  # noqa: S102 - the contract's own code
        got = await asyncio.wait_for(namespace["_snippet"](), TIMEOUT)
        if plan.check is not None:
            await plan.check(got, keep)


def test_api_md_blocks_all_have_a_setup() -> None:
    found = blocks()
    if not found:
        _missing()
    assert len(found) >= 12
    used = {p for block in found if (hit := setup_of(block)) for p in [hit[0]]}
    assert used == set(SETUPS), f"setups whose phrase no API.md block contains: {set(SETUPS) - used}"
    assert all(setup_of(block) for block in found)


def test_api_md_missing_fails_in_ci_and_skips_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="API.md not found"):
        _missing()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="API.md not found"):
        _missing()


def test_return_annotations_are_checked() -> None:
    returned: list[tuple[str, Any]] = []
    check = make_returns(returned)
    record = bus.TopicPartition("t", "0")
    assert check([record], "list[bus.TopicPartition]", 1) == [record]
    assert check(None, "bus.Claim | None", 2) is None
    with pytest.raises(AssertionError, match="API.md line 3: expected list"):
        check([record, 1], "list[bus.TopicPartition]", 3)
    with pytest.raises(AssertionError, match="expected bool"):
        check(1, "bool", 4)
    assert [a for a, _ in returned] == ["list[bus.TopicPartition]", "bus.Claim | None"]


def test_the_rewriting_is_what_the_docstring_says() -> None:
    code = (
        'x = await f("a ...", key=..., v=[1, ...]) -> list[int]   # c\nasync for m in c: ...\nawait g(...)\n'
    )
    text, found = strip_annotations(code)
    assert found == {1: "list[int]"} and "->" not in text and "# c" in text
    plan = Plan(fill={"key": '"k"', "a ...": '"sql"', "...": "*(1, 2)"})
    tree = build(Block(0, 10, code), plan, None)
    snippet = next(c for c in tree.co_consts if isinstance(c, types.CodeType))
    assert "_returns" in snippet.co_names and "g" in snippet.co_names
    assert "sql" in snippet.co_consts and "k" in snippet.co_consts
    assert snippet.co_firstlineno == 9  # the `async def` line sits just above API.md's first code line
