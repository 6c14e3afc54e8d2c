"""The one store API over SQL that producer, workers and ops all use."""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

from common.budget import Budget
from common.db import insert_ignore, make_engine
from common.errors import UnknownDatasetError
from common.schema import INPUT_COLUMNS, datasets, meta, metadata, prompts, results, utcnow
from common.settings import DEFAULT_DB_CONNECTIONS
from common.tokenids import unpack


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


@dataclass(frozen=True)
class PromptRow:
    dataset: str
    sample_id: str
    state: str
    input_ids: list[int]
    prompt_tokens: int
    max_new_tokens: int
    attempts: int


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
    )


def _cost(budget: Budget) -> sa.ColumnElement[int]:
    """A result's tokens on the dataset's budget basis, as SQL."""
    if budget.basis == "total":
        return results.c.completion_tokens + results.c.prompt_tokens
    return results.c.completion_tokens


# The group commit's statements are written for the driver directly: SQLAlchemy's
# per-row parameter handling of a 15-column INSERT cost more CPU than the database did.
_RESULT_COLUMNS = (
    "dataset", "sample_id", "rid", "prompt_tokens", "completion_tokens", "cached_tokens",
    "reasoning_tokens", "finish_reason", "finish_detail", "output_ids", "output_text",
    "e2e_latency_s", "server", "model", "created_at",
)


def _placeholder(dialect: sa.Dialect) -> str:
    if dialect.paramstyle == "qmark":
        return "?"
    if dialect.paramstyle in ("format", "pyformat"):
        return "%s"
    raise NotImplementedError(f"paramstyle {dialect.paramstyle} of {dialect.name}")


# The worker's group statements (a group's SELECT, INSERT and UPDATE) reach psycopg as
# written, through a RawCursor with numbered placeholders: psycopg parses a statement
# written with %s for its placeholders on every execution once it has more than 50
# parameters (its cache stops there), and at a group's size that parsing was about half the
# worker's time in its shared commit.
def _numbered(dialect: sa.Dialect, sql: str) -> str:
    """The statement as PostgreSQL takes it ($1, $2, ...); SQLite's as it is."""
    if dialect.name != "postgresql":
        return sql
    parts = sql.split("%s")
    return parts[0] + "".join(f"${i}{part}" for i, part in enumerate(parts[1:], 1))


def _run_as_written(engine: sa.Engine, sql: str, params: tuple[Any, ...],
                    binary: bool = False) -> list[tuple[Any, ...]]:
    """PostgreSQL: run one statement as written ($1, $2, ...) and return its rows, its
    errors raised as SQLAlchemy's.

    A single statement needs no transaction, so it runs in autocommit: no BEGIN before it,
    no COMMIT after it. It goes to psycopg on a pooled connection directly: through a
    SQLAlchemy connection with the autocommit option, the worker spent 2-9% more CPU a
    sample (docs/PERFORMANCE_EXPERIMENTS.md, "Eighth round"). ``binary``: the rows come
    in PostgreSQL's binary format, where a bytea as text is hex, twice its size (a prompt
    read returns every prompt's token ids).
    """
    import psycopg

    pooled = None
    try:
        # The pool's checkout check runs as for any other use; a refused connection comes
        # out of it as psycopg's error, like a failed statement.
        pooled = engine.raw_connection()
        driver: Any = pooled.driver_connection
        driver.autocommit = True
        try:
            with psycopg.RawCursor(driver) as cur:
                cur.execute(sql, params, binary=binary)
                return cur.fetchall()
        finally:
            _back_to_transactions(pooled, driver)
    except psycopg.Error as exc:
        raise sa.exc.DBAPIError.instance(sql, params, exc, psycopg.Error,
                                         dialect=engine.dialect) from exc
    finally:
        if pooled is not None:
            pooled.close()


def _back_to_transactions(pooled: Any, driver: Any) -> None:
    """Return the connection to the pool as SQLAlchemy expects it (not in autocommit), or
    drop it: a pooled connection left in autocommit would make every later transaction
    on it a series of separate commits."""
    if not driver.broken and not driver.closed:
        try:
            driver.autocommit = False
            return
        except Exception:  # whatever it is, the connection is dropped below
            pass
    pooled.invalidate()


@functools.cache
def _results_insert_text(dialect: sa.Dialect, columns: tuple[str, ...], n: int) -> str:
    quote, ph = dialect.identifier_preparer.quote, _placeholder(dialect)
    values = "(" + ", ".join([ph] * len(columns)) + ")"
    return (f"INSERT INTO results ({', '.join(quote(c) for c in columns)}) "
            f"VALUES {', '.join([values] * n)} ON CONFLICT DO NOTHING RETURNING dataset, sample_id")


@functools.cache
def _encoders(dialect: sa.Dialect, table: str, columns: tuple[str, ...]) -> tuple[Any, ...]:
    """Each column's SQLAlchemy bind processor (packing, JSON, SQLite timestamps) or None."""
    t = metadata.tables[table]
    return tuple(t.c[c].type.dialect_impl(dialect).bind_processor(dialect) for c in columns)


def _by_columns(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, ...], list[dict[str, Any]]]:
    """The rows by the set of keys they have (normally one set): each set is one INSERT, and
    a column a row leaves out gets the database's default, as with SQLAlchemy."""
    by_columns: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for row in rows:
        columns = tuple(c for c in _RESULT_COLUMNS if c in row or c == "created_at")
        by_columns.setdefault(columns, []).append(row)
    return by_columns


def _insert_params(dialect: sa.Dialect, columns: tuple[str, ...],
                   rows: Sequence[dict[str, Any]], now: datetime) -> list[Any]:
    encoders = _encoders(dialect, "results", columns)
    params: list[Any] = []
    for row in rows:
        values = [row.get(c) for c in columns]
        values[-1] = values[-1] or now  # created_at comes last
        params += [v if f is None else f(v) for v, f in zip(values, encoders, strict=True)]
    return params


@functools.cache
def _by_keys(dialect: sa.Dialect, n: int, table: str = "") -> str:
    """A WHERE for n (dataset, sample_id) keys of prompts (``table``: a qualifier such as
    ``p.``). Written as ORs: both databases look each one up in the primary key that way,
    whereas SQLite scans the whole index for a row-value IN."""
    ph = _placeholder(dialect)
    return " OR ".join([f"({table}dataset = {ph} AND {table}sample_id = {ph})"] * n)


@functools.cache
def _prompts_select_sql(dialect: sa.Dialect, n: int) -> str:
    return _numbered(dialect, "SELECT p.dataset, p.sample_id, p.state, i.input_ids, "
                     "p.prompt_tokens, p.max_new_tokens, p.attempts FROM prompts p "
                     "JOIN prompt_inputs i ON i.dataset = p.dataset AND i.sample_id = p.sample_id "
                     f"WHERE {_by_keys(dialect, n, 'p.')}")


@functools.cache
def _mark_done_text(dialect: sa.Dialect, n: int) -> str:
    ph = _placeholder(dialect)
    return (f"UPDATE prompts SET state = 'done', error = NULL, updated_at = {ph} "
            f"WHERE {_by_keys(dialect, n)}")


def _mark_done_params(dialect: sa.Dialect, rows: Sequence[dict[str, Any]],
                      now: datetime) -> list[Any]:
    (stamp,) = _encoders(dialect, "prompts", ("updated_at",))
    return [stamp(now) if stamp else now,
            *(v for row in rows for v in (row["dataset"], row["sample_id"]))]


@functools.cache
def _settle_sql(dialect: sa.Dialect, inserts: tuple[tuple[tuple[str, ...], int], ...],
                n: int) -> str:
    """PostgreSQL: a group's INSERTs (by columns and row count) and the UPDATE marking its
    n prompts done, as one statement: atomic on its own, so it needs no transaction, and
    one round trip where BEGIN, the statements and COMMIT took one each."""
    parts = [f"i{k} AS ({_results_insert_text(dialect, columns, count)})"
             for k, (columns, count) in enumerate(inserts)]
    parts.append(f"done AS ({_mark_done_text(dialect, n)})")
    inserted = " UNION ALL ".join(f"SELECT dataset, sample_id FROM i{k}"
                                  for k in range(len(inserts)))
    return _numbered(dialect, f"WITH {', '.join(parts)} {inserted}")


@functools.lru_cache(maxsize=32)  # keyed by engine dialect: one entry per Store in practice
def _prompt_insert(
    dialect: sa.Dialect, table: str, keys: tuple[str, ...]
) -> tuple[str, Callable[[Sequence[dict[str, Any]]], list[tuple[Any, ...]]]]:
    """The INSERT ... ON CONFLICT DO NOTHING into prompts or prompt_inputs of rows with
    these keys, as the driver takes it, and a function turning rows into its parameters
    (timestamps not given are the chunk's ``now``)."""
    columns = metadata.tables[table].c
    stamps = tuple(k for k in ("created_at", "updated_at") if k in columns and k not in keys)
    names = [*keys, *stamps]
    quote, ph = dialect.identifier_preparer.quote, _placeholder(dialect)
    sql = (f"INSERT INTO {table} ({', '.join(quote(c) for c in names)}) "
           f"VALUES ({', '.join([ph] * len(names))}) ON CONFLICT DO NOTHING")
    encoders = _encoders(dialect, table, keys)
    (stamp,) = _encoders(dialect, "prompts", ("created_at",))

    def params(rows: Sequence[dict[str, Any]]) -> list[tuple[Any, ...]]:
        now = utcnow()
        tail = tuple(stamp(now) if stamp else now for _ in stamps)
        return [(*[row[k] if f is None else f(row[k]) for k, f in zip(keys, encoders, strict=True)],
                 *tail) for row in rows]

    return sql, params


class Store:
    def __init__(self, url: str, connections: int = DEFAULT_DB_CONNECTIONS) -> None:
        """``connections``: most connections to PostgreSQL this store holds at once."""
        self.url = url
        self.engine = make_engine(url, connections)

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

    # -- prompts --------------------------------------------------------------------------

    def prompt_states(self, dataset: str) -> dict[str, str]:
        q = sa.select(prompts.c.sample_id, prompts.c.state).where(prompts.c.dataset == dataset)
        with self.engine.connect() as conn:
            return {sid: state for sid, state in conn.execute(q)}

    def insert_prompts(self, rows: Sequence[dict[str, Any]]) -> None:
        """Store new prompts in one transaction, each row with its ``messages`` and
        ``input_ids``; a prompt stored before is left as it is."""
        if not rows:
            return
        split = {"prompts": tuple(k for k in rows[0] if k not in INPUT_COLUMNS),
                 "prompt_inputs": ("dataset", "sample_id", *INPUT_COLUMNS)}
        with self.engine.begin() as conn:
            for table, keys in split.items():
                # SQLAlchemy's per-row parameter handling costs the producer more than the
                # database's insert itself; the same column encoders, applied here in one
                # pass, store exactly the same values.
                sql, params = _prompt_insert(self.engine.dialect, table, keys)
                conn.exec_driver_sql(sql, params(rows))

    def refresh_statistics(self) -> None:
        """PostgreSQL: gather the planner's statistics on the prompt tables (no-op on SQLite,
        whose planner looks keys up in the primary key without them).

        Called after a load. Without statistics, PostgreSQL's planner reads a worker's group
        of keys of one dataset through ix_prompts_dataset_state, every row of the dataset,
        rather than through the primary key: at 88,000 prompts in one dataset a group's
        store took 42 ms instead of 1.4. Autovacuum gathers them in time, where it runs;
        this does not wait for it (docs/PERFORMANCE_EXPERIMENTS.md, "Twenty-first round").
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
        q = sa.select(prompts.c.sample_id).where(
            prompts.c.dataset == dataset, prompts.c.state == state
        )
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
        unique = list(dict.fromkeys(keys))
        sql = _prompts_select_sql(self.engine.dialect, len(unique))
        params = tuple(v for key in unique for v in key)
        if self.engine.dialect.name == "postgresql":
            rows: Sequence[Any] = _run_as_written(self.engine, sql, params, binary=True)
        else:
            with self.engine.connect() as conn:
                rows = conn.exec_driver_sql(sql, params).all()
        found = {(r[0], r[1]): PromptRow(r[0], r[1], r[2], unpack(bytes(r[3])), r[4], r[5], r[6])
                 for r in rows}
        return [found.get(key) for key in keys]

    def record_attempt(self, dataset: str, sample_id: str, error: str, count: bool = True) -> int:
        """Record a failed attempt's error, counted unless ``count`` is False; returns attempts."""
        where = (prompts.c.dataset == dataset, prompts.c.sample_id == sample_id)
        attempts = prompts.c.attempts + 1 if count else prompts.c.attempts
        with self.engine.begin() as conn:
            conn.execute(
                prompts.update()
                .where(*where)
                .values(attempts=attempts, error=error[:4000], updated_at=utcnow())
            )
            return int(conn.scalar(sa.select(prompts.c.attempts).where(*where)) or 0)

    def mark_failed(self, dataset: str, sample_id: str, error: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(
                prompts.update()
                .where(prompts.c.dataset == dataset, prompts.c.sample_id == sample_id)
                .where(prompts.c.state != "done")
                .values(state="failed", error=error[:4000], updated_at=utcnow())
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

    def save_result(self, row: dict[str, Any]) -> bool:
        """Store one result and mark its prompt done, atomically; False if it already existed."""
        return (row["dataset"], row["sample_id"]) in self.save_results([row])

    def save_results(self, rows: Sequence[dict[str, Any]]) -> set[tuple[str, str]]:
        """Store results and mark their prompts done, all in one transaction (one commit
        for many samples); returns the (dataset, sample_id) of those not stored before."""
        if not rows:
            return set()
        dialect, now = self.engine.dialect, utcnow()
        by_columns = _by_columns(rows)
        # RETURNING, not rowcount: psycopg reports -1 for ON CONFLICT DO NOTHING.
        if dialect.name == "postgresql":
            sql = _settle_sql(dialect, tuple((c, len(same)) for c, same in by_columns.items()),
                              len(rows))
            params = [v for c, same in by_columns.items()
                      for v in _insert_params(dialect, c, same, now)]
            params += _mark_done_params(dialect, rows, now)
            return {(d, sid) for d, sid in _run_as_written(self.engine, sql, tuple(params))}
        inserted: set[tuple[str, str]] = set()
        with self.engine.begin() as conn:
            for columns, same in by_columns.items():
                sql = _results_insert_text(dialect, columns, len(same))
                params = _insert_params(dialect, columns, same, now)
                inserted.update((d, sid) for d, sid in conn.exec_driver_sql(sql, tuple(params)))
            conn.exec_driver_sql(_mark_done_text(dialect, len(rows)),
                                 tuple(_mark_done_params(dialect, rows, now)))
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
