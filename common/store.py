"""The one store API over SQL that producer, workers and ops all use."""

from __future__ import annotations

import dataclasses
import functools
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from common.budget import Budget, cost_on
from common.db import insert_ignore, make_engine
from common.draws import Mixtures
from common.errors import UnknownDatasetError
from common.order import Order
from common.rows import NewConversation, NewPrompt, ResultRow
from common.schema import conversations, datasets, meta, prompt_inputs, prompts, results, utcnow
from common.settings import DEFAULT_DB_CONNECTIONS
from common.sqltext import storable, storable_or_none


@dataclass(frozen=True)
class DatasetRow:
    name: str
    budget: Budget
    sampling: dict[str, Any]
    max_seq_len: int
    tokenizer: str
    template_hash: str
    reasoning_open: str | None = None
    state: str = "open"
    close_reason: str | None = None
    closed_at: datetime | None = None
    used_at_close: int | None = None
    stamp: str = ""
    turns: str = "last"  # "all": each conversation regenerated turn by turn
    template_kwargs: dict[str, Any] | None = None
    order: Order = field(default_factory=Order)
    mixtures: Mixtures = field(default_factory=Mixtures)
    generations: int = 1  # samples of each prompt, ``<id>_gen<k>`` when more than one
    # SGLang's parser name for the model's tool calls (``--tool-call-parser``), or None.
    tool_call_parser: str | None = None
    # The reasoning opener of each template draw, by ``draw_key`` (common/kept.py
    # ``sample_closer``); None without template mixtures.
    reasoning_opens: dict[str, str | None] | None = None


@dataclass(frozen=True)
class PromptRow:
    dataset: str
    sample_id: str
    state: str
    input_ids: list[int]
    prompt_tokens: int
    max_new_tokens: int
    attempts: int
    conversation: str | None = None  # a turn of this conversation (``--turns all``)


def new_stamp(name: str) -> str:
    return f"{name}@{uuid.uuid4().hex[:12]}"


def as_utc(value: datetime | None) -> datetime | None:
    # SQLite hands back naive datetimes; every stored time is UTC.
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=UTC)


def _dataset_row(r: sa.Row[Any]) -> DatasetRow:
    return DatasetRow(
        name=r.name,
        budget=Budget(int(r.budget_tokens), r.basis, r.policy),
        sampling=dict(r.sampling),
        max_seq_len=r.max_seq_len,
        tokenizer=r.tokenizer,
        template_hash=r.template_hash,
        reasoning_open=r.reasoning_open,
        state=r.state,
        close_reason=r.close_reason,
        closed_at=as_utc(r.closed_at),
        used_at_close=r.used_at_close,
        stamp=r.stamp,
        turns=r.turns or "last",
        template_kwargs=r.template_kwargs,
        order=Order(r.sample_order, r.seed),
        mixtures=Mixtures.from_json(r.mixtures),
        generations=r.generations or 1,
        tool_call_parser=r.tool_call_parser,
        reasoning_opens=r.reasoning_opens,
    )


def kept_completion_tokens() -> sa.ColumnElement[int]:
    """A result's completion tokens if it is kept (common.kept), else 0, as SQL."""
    return sa.case((results.c.kept.is_(sa.true()), results.c.completion_tokens), else_=0)


def _cost(budget: Budget) -> sa.ColumnElement[int]:
    """A result's tokens on the dataset's budget basis, as SQL."""
    cost: sa.ColumnElement[int] = cost_on(budget.basis, results.c.prompt_tokens,
                                          results.c.completion_tokens,
                                          kept_completion_tokens())
    return cost


def _columns(table: sa.Table, row_type: type[Any]) -> tuple[str, ...]:
    """The columns of ``table`` that ``row_type`` has a field for."""
    names = {f.name for f in dataclasses.fields(row_type)}
    return tuple(c.name for c in table.c if c.name in names)


_PROMPT_COLUMNS = _columns(prompts, NewPrompt)
_PROMPT_INPUT_COLUMNS = _columns(prompt_inputs, NewPrompt)
_RESULT_COLUMNS = _columns(results, ResultRow)
_CONVERSATION_COLUMNS = _columns(conversations, NewConversation)


def _values(row: Any, columns: tuple[str, ...], **extra: Any) -> dict[str, Any]:
    """A typed row's parameters for ``columns``, with ``extra`` ones (its timestamps)."""
    return {**{c: getattr(row, c) for c in columns}, **extra}


def _result_values(row: ResultRow, now: datetime) -> dict[str, Any]:
    """A result's parameters; its text as both databases hold it (common/sqltext.py)."""
    return _values(row, _RESULT_COLUMNS, created_at=now, output_text=storable(row.output_text))


def _error_text(error: str) -> str:
    return storable(error[:4000])


def by_keys(table: sa.Table, n: int) -> sa.ColumnElement[bool]:
    """A WHERE for n (dataset, sample_id) keys of ``table``, bound as d0, s0, d1, ... (see
    ``key_params``). As ORs of pairs: both databases look each one up in the primary key
    that way, whereas SQLite scans the whole table for a row-value IN."""
    return sa.or_(*(sa.and_(table.c.dataset == sa.bindparam(f"d{i}"),
                            table.c.sample_id == sa.bindparam(f"s{i}")) for i in range(n)))


def key_params(keys: Iterable[tuple[str, str]]) -> dict[str, str]:
    params = {}
    for i, (dataset, sample_id) in enumerate(keys):
        params[f"d{i}"], params[f"s{i}"] = dataset, sample_id
    return params


# The statements for n keys are built once and kept: SQLAlchemy then finds a kept
# statement's compiled form without walking the statement again for its cache key.
@functools.lru_cache(maxsize=128)
def _prompts_read(n: int) -> sa.Select[Any]:
    return sa.select(
        prompts.c.dataset, prompts.c.sample_id, prompts.c.state, prompt_inputs.c.input_ids,
        prompts.c.prompt_tokens, prompts.c.max_new_tokens, prompts.c.attempts,
        prompt_inputs.c.conversation,
    ).join(prompt_inputs, sa.and_(prompt_inputs.c.dataset == prompts.c.dataset,
                                  prompt_inputs.c.sample_id == prompts.c.sample_id),
           ).where(by_keys(prompts, n))


@functools.lru_cache(maxsize=128)
def _mark_done(n: int) -> sa.Update:
    return (sa.update(prompts).where(by_keys(prompts, n))
            .values(state="done", error=None, updated_at=sa.bindparam("now")))


@functools.cache
def _stored_on_postgresql() -> sa.Select[Any]:
    """PostgreSQL: store results and mark their prompts done in one statement, RETURNING
    the keys it stored. The rows come as one array a column (``r_<column>``, and ``now``):
    the statement's text is the same for any number of rows, so psycopg converts it once
    and the server plans it once per connection (a prepared statement), where a
    multi-row INSERT and an UPDATE of n keys differ for each n. As one statement it also
    needs no BEGIN and COMMIT of its own: one round trip where there were four."""
    src = sa.func.unnest(*(
        sa.bindparam(f"r_{c}", type_=postgresql.ARRAY(results.c[c].type, dimensions=1))
        for c in _RESULT_COLUMNS)).table_valued(
            *(sa.column(c, results.c[c].type) for c in _RESULT_COLUMNS)).render_derived()
    rows = sa.select(src).cte("r")
    now = sa.bindparam("now", type_=results.c.created_at.type)
    stored = (postgresql.insert(results)
              .from_select([*_RESULT_COLUMNS, "created_at"],
                           sa.select(*(rows.c[c] for c in _RESULT_COLUMNS), now))
              .on_conflict_do_nothing()
              .returning(results.c.dataset, results.c.sample_id).cte("stored"))
    done = (sa.update(prompts)
            .where(prompts.c.dataset == rows.c.dataset, prompts.c.sample_id == rows.c.sample_id)
            .values(state="done", error=sa.null(), updated_at=now).cte("done"))
    return sa.select(stored.c.dataset, stored.c.sample_id).add_cte(done)


class Store:
    def __init__(self, url: str, connections: int = DEFAULT_DB_CONNECTIONS) -> None:
        """``connections``: most connections to PostgreSQL this store holds at once."""
        self.url = url
        self.engine = make_engine(url, connections)

    @functools.cached_property
    def _inserts(self) -> tuple[Any, Any, Any, Any]:
        """This dialect's INSERT ... ON CONFLICT DO NOTHING into prompts, prompt_inputs,
        results (RETURNING the keys it stored) and conversations."""
        return (insert_ignore(self.engine, prompts), insert_ignore(self.engine, prompt_inputs),
                insert_ignore(self.engine, results).returning(results.c.dataset,
                                                              results.c.sample_id),
                insert_ignore(self.engine, conversations))

    def _one_statement(self) -> sa.Connection:
        """A connection for one statement that only reads, or writes all it writes by
        itself. On PostgreSQL in autocommit, where a statement is its own transaction: a
        transaction around it would cost a BEGIN and a COMMIT or ROLLBACK, a round trip
        each, for nothing (on SQLite, leaving autocommit costs a statement of its own)."""
        conn = self.engine.connect()
        if self.engine.dialect.name == "postgresql":
            conn.execution_options(isolation_level="AUTOCOMMIT")
        return conn

    def describe(self) -> str:
        """The database's URL without its password, for messages."""
        return self.engine.url.render_as_string(hide_password=True)

    @functools.cached_property
    def store_id(self) -> str:
        """This database's own id, made by whichever process asks first and never changed.

        A copy or a restore of the database keeps it; a new database (a deleted SQLite
        file, another PostgreSQL database) has another.
        """
        query = sa.select(meta.c.value).where(meta.c.key == "store_id")
        with self.engine.connect() as conn:
            # Read first, so a database user who may only read (a status board) gets it.
            found = conn.scalar(query)
        if found is not None:
            return str(found)
        with self.engine.begin() as conn:
            # Two processes may ask at once: the first insert wins, both read its value.
            conn.execute(insert_ignore(self.engine, meta).values(key="store_id",
                                                                 value=uuid.uuid4().hex))
            return str(conn.scalar(query))

    # -- datasets -------------------------------------------------------------------------

    def upsert_dataset(self, row: DatasetRow) -> None:
        """Create the dataset or update its terms; its close record is left alone."""
        values = {
            "budget_tokens": row.budget.tokens,
            "basis": row.budget.basis,
            "policy": row.budget.policy,
            "sampling": row.sampling,
            "max_seq_len": row.max_seq_len,
            "tokenizer": row.tokenizer,
            "template_hash": row.template_hash,
            "reasoning_open": row.reasoning_open,
            "turns": row.turns,
            "template_kwargs": row.template_kwargs or None,
            "sample_order": row.order.kind,
            "seed": row.order.seed,
            "mixtures": row.mixtures.to_json(),
            "generations": row.generations if row.generations > 1 else None,
            "tool_call_parser": row.tool_call_parser,
            "reasoning_opens": row.reasoning_opens,
            "updated_at": utcnow(),
        }
        with self.engine.begin() as conn:
            done = conn.execute(
                datasets.update().where(datasets.c.name == row.name).values(**values)
            )
            if done.rowcount == 0:
                conn.execute(
                    datasets.insert().values(
                        name=row.name, state="open", stamp=new_stamp(row.name), **values
                    )
                )

    def dataset(self, name: str) -> DatasetRow:
        with self.engine.connect() as conn:
            r = conn.execute(sa.select(datasets).where(datasets.c.name == name)).first()
        if r is None:
            raise UnknownDatasetError(name, self.dataset_names())
        return _dataset_row(r)

    def datasets(self) -> list[DatasetRow]:
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(datasets).order_by(datasets.c.name)).all()
        return [_dataset_row(r) for r in rows]

    def dataset_names(self) -> list[str]:
        with self.engine.connect() as conn:
            return list(conn.scalars(sa.select(datasets.c.name).order_by(datasets.c.name)))

    def record_close(
        self, name: str, reason: str, closed_at: datetime, used_at_close: int
    ) -> None:
        """Record the first close only: a later one must not move the timestamp."""
        with self.engine.begin() as conn:
            conn.execute(
                datasets.update()
                .where(datasets.c.name == name, datasets.c.state != "closed")
                .values(
                    state="closed",
                    close_reason=reason,
                    closed_at=closed_at,
                    used_at_close=used_at_close,
                    updated_at=utcnow(),
                )
            )

    def record_reopen(self, name: str, budget_tokens: int) -> None:
        with self.engine.begin() as conn:
            conn.execute(
                datasets.update()
                .where(datasets.c.name == name)
                .values(
                    state="open",
                    stamp=new_stamp(name),
                    budget_tokens=budget_tokens,
                    close_reason=None,
                    closed_at=None,
                    used_at_close=None,
                    updated_at=utcnow(),
                )
            )

    def set_sampling(self, name: str, sampling: dict[str, Any]) -> None:
        """Replace the dataset's sampling; workers take it within their cache's period."""
        with self.engine.begin() as conn:
            conn.execute(datasets.update().where(datasets.c.name == name)
                         .values(sampling=sampling, updated_at=utcnow()))

    def terms_changed_at(self, name: str) -> datetime | None:
        """When the dataset's row last changed (its terms, sampling, close or reopen)."""
        q = sa.select(datasets.c.updated_at).where(datasets.c.name == name)
        with self.engine.connect() as conn:
            return as_utc(conn.scalar(q))

    # -- prompts --------------------------------------------------------------------------

    def prompt_states(self, dataset: str) -> dict[str, str]:
        q = sa.select(prompts.c.sample_id, prompts.c.state).where(prompts.c.dataset == dataset)
        with self.engine.connect() as conn:
            return {sid: state for sid, state in conn.execute(q)}

    def insert_prompts(self, rows: Sequence[NewPrompt],
                       conversations: Sequence[NewConversation] = ()) -> None:
        """Store new prompts (and the conversations whose turns they are) in one
        transaction; a row stored before is left as it is."""
        if not rows and not conversations:
            return
        with self.engine.begin() as conn:
            if conversations:
                now = utcnow()
                conn.execute(self._inserts[3], [_values(c, _CONVERSATION_COLUMNS,
                                                        created_at=now)
                                                for c in conversations])
            self._insert_prompts(conn, rows)

    def _insert_prompts(self, conn: sa.Connection, rows: Sequence[NewPrompt]) -> None:
        if not rows:
            return
        now = utcnow()  # a prompt's two stamps equal, as the schema's defaults would not be
        into_prompts, into_inputs, *_ = self._inserts
        conn.execute(into_prompts, [_values(r, _PROMPT_COLUMNS, created_at=now,
                                            updated_at=now, error=storable_or_none(r.error))
                                    for r in rows])
        conn.execute(into_inputs, [_values(r, _PROMPT_INPUT_COLUMNS) for r in rows])

    def refresh_statistics(self) -> None:
        """PostgreSQL: gather the planner's statistics on the prompt tables (no-op on SQLite,
        whose planner looks keys up in the primary key without them).

        Called after a load. Without statistics, PostgreSQL's planner reads a worker's group
        of keys of one dataset through ix_prompts_dataset_state, every row of the dataset,
        rather than through the primary key: at 88,000 prompts in one dataset a group's
        store took 42 ms instead of 1.4. Autovacuum gathers them in time, where it runs;
        this does not wait for it.
        """
        if self.engine.dialect.name != "postgresql":
            return
        with self.engine.begin() as conn:
            conn.exec_driver_sql("ANALYZE prompts")
            # Only the key: the planner never filters on messages or token ids, and
            # sampling them would read every sampled row's TOAST.
            conn.exec_driver_sql("ANALYZE prompt_inputs (dataset, sample_id)")

    def ensure_statistics(self) -> bool:
        """PostgreSQL: gather the prompt tables' statistics if they hold prompts and have
        none (loaded by an earlier version where autovacuum is off, or carried over by
        pg_upgrade, which leaves them out); True if it did."""
        if self.engine.dialect.name != "postgresql":
            return False
        missing = sa.text(
            "SELECT EXISTS (SELECT 1 FROM prompts) AND NOT EXISTS (SELECT 1 FROM pg_stats "
            "WHERE schemaname = current_schema() AND tablename = 'prompts')")
        with self.engine.connect() as conn:
            if not conn.scalar(missing):
                return False
        self.refresh_statistics()
        return True

    def set_prompt_states(self, dataset: str, sample_ids: Iterable[str], state: str) -> None:
        ids = list(sample_ids)
        with self.engine.begin() as conn:
            for start in range(0, len(ids), 500):
                conn.execute(
                    prompts.update()
                    .where(prompts.c.dataset == dataset)
                    .where(prompts.c.sample_id.in_(ids[start : start + 500]))
                    .where(prompts.c.state != "done")
                    .values(state=state, updated_at=utcnow())
                )

    def sample_ids(
        self, dataset: str, state: str, updated_before: datetime | None = None
    ) -> list[str]:
        """The dataset's prompts in ``state``, in its publishing order (common/order.py)."""
        q = sa.select(prompts.c.sample_id).where(
            prompts.c.dataset == dataset, prompts.c.state == state
        ).order_by(prompts.c.rank.nulls_first(), prompts.c.sample_id)
        if updated_before is not None:
            q = q.where(prompts.c.updated_at < updated_before)
        with self.engine.connect() as conn:
            return list(conn.scalars(q))

    def prompt(self, dataset: str, sample_id: str) -> PromptRow | None:
        return self.prompts([(dataset, sample_id)])[0]

    def prompts(self, keys: Sequence[tuple[str, str]]) -> list[PromptRow | None]:
        """The prompts of (dataset, sample_id) keys, in order; None where there is none.
        One SELECT for all of them, whatever their datasets."""
        if not keys:
            return []
        unique = dict.fromkeys(keys)
        with self._one_statement() as conn:
            found = {(r.dataset, r.sample_id): PromptRow(*r)
                     for r in conn.execute(_prompts_read(len(unique)), key_params(unique))}
        return [found.get(key) for key in keys]

    def record_attempt(self, dataset: str, sample_id: str, error: str, count: bool = True) -> int:
        """Record a failed attempt's error, counted unless ``count`` is False; returns attempts."""
        where = (prompts.c.dataset == dataset, prompts.c.sample_id == sample_id)
        attempts = prompts.c.attempts + 1 if count else prompts.c.attempts
        with self.engine.begin() as conn:
            conn.execute(
                prompts.update()
                .where(*where)
                .values(attempts=attempts, error=_error_text(error), updated_at=utcnow())
            )
            return int(conn.scalar(sa.select(prompts.c.attempts).where(*where)) or 0)

    def mark_failed(self, dataset: str, sample_id: str, error: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(
                prompts.update()
                .where(prompts.c.dataset == dataset, prompts.c.sample_id == sample_id)
                .where(prompts.c.state != "done")
                .values(state="failed", error=_error_text(error), updated_at=utcnow())
            )

    def prompt_counts(self, dataset: str) -> dict[str, int]:
        q = (
            sa.select(prompts.c.state, sa.func.count())
            .where(prompts.c.dataset == dataset)
            .group_by(prompts.c.state)
        )
        with self.engine.connect() as conn:
            return {state: int(n) for state, n in conn.execute(q)}

    # -- results --------------------------------------------------------------------------

    def save_result(self, row: ResultRow) -> bool:
        """Store one result and mark its prompt done, atomically; False if it already existed."""
        return row.key in self.save_results([row])

    def save_results(self, rows: Sequence[ResultRow],
                     then: Sequence[NewPrompt] = ()) -> set[tuple[str, str]]:
        """Store results and mark their prompts done, all in one transaction (one commit
        for many samples); returns the (dataset, sample_id) of those not stored before.

        ``then``: the prompts these results make possible (a conversation's next turns),
        stored in the same transaction, so a turn's successor exists exactly when the
        turn is stored; one stored before is left as it is."""
        if not rows:
            return set()
        now = utcnow()
        if self.engine.dialect.name == "postgresql":
            return self._save_results_on_postgresql(rows, then, now)
        # RETURNING, not rowcount: psycopg reports -1 for ON CONFLICT DO NOTHING.
        into_results = self._inserts[2]
        keys = dict.fromkeys(r.key for r in rows)
        with self.engine.begin() as conn:
            stored = conn.execute(into_results, [_result_values(r, now) for r in rows])
            inserted = {(dataset, sample_id) for dataset, sample_id in stored}
            conn.execute(_mark_done(len(keys)), {"now": now, **key_params(keys)})
            self._insert_prompts(conn, then)
        return inserted

    def _save_results_on_postgresql(self, rows: Sequence[ResultRow], then: Sequence[NewPrompt],
                                    now: datetime) -> set[tuple[str, str]]:
        values = [_result_values(r, now) for r in rows]
        params: dict[str, Any] = {f"r_{c}": [v[c] for v in values] for c in _RESULT_COLUMNS}
        params["now"] = now
        # The next turns go in the same transaction; without them the one statement is its
        # own.
        with self.engine.begin() if then else self._one_statement() as conn:
            inserted = {(dataset, sample_id) for dataset, sample_id
                        in conn.execute(_stored_on_postgresql(), params)}
            self._insert_prompts(conn, then)
        return inserted

    def has_result(self, dataset: str, sample_id: str) -> bool:
        q = sa.select(results.c.id).where(
            results.c.dataset == dataset, results.c.sample_id == sample_id
        )
        with self.engine.connect() as conn:
            return conn.execute(q).first() is not None

    def result_costs(
        self, dataset: str, budget: Budget, sample_ids: Sequence[str] | None = None
    ) -> Iterator[tuple[str, int]]:
        """(sample_id, tokens on the dataset's basis) of stored results, all or the given."""
        q = sa.select(results.c.sample_id, _cost(budget)).where(results.c.dataset == dataset)
        if sample_ids is not None:
            q = q.where(results.c.sample_id.in_(list(sample_ids)))
        with self.engine.connect() as conn:
            for sid, tokens in conn.execution_options(yield_per=5000).execute(q):
                yield sid, int(tokens)

    def used_tokens(self, dataset: str, budget: Budget) -> int:
        total = sa.func.coalesce(sa.func.sum(_cost(budget)), 0)
        q = sa.select(total).where(results.c.dataset == dataset)
        with self.engine.connect() as conn:
            return int(conn.scalar(q) or 0)
