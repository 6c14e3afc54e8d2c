"""The SQL schema, in one place. SQLAlchemy Core; created on first use.

Tables:
  meta      facts about the database itself, one row each: today its ``store_id``, which
            the Redis holding its queues and ledgers records (common/pairing.py).
  datasets  one row per dataset: its budget terms, sampling and sampling mixtures
            (common/draws.py), tokenizer and reasoning opener (each template draw's, when
            it mixes template arguments), publishing order (``sample_order`` and ``seed``,
            common/order.py), generations per prompt, and its close.
  prompts   one row per (dataset, sample_id): its state (queued, done, failed, skipped),
            attempts and last error, its length and token allowance, and its ``rank``
            in the dataset's publishing order.
  prompt_inputs  one row per prompt, written once: its messages, tools and templated ids.
            Apart from prompts so that marking a prompt done rewrites a row of a few dozen
            bytes: SQLite rewrites a row's whole record to change one column, and with the
            ids inside, a prompt of 1,300 tokens wrote 12.7 KiB to the WAL to be marked done
            (0.7 KiB apart).
  results   one row per generated sample, unique (dataset, sample_id).
  conversations  one row per conversation whose every assistant turn is regenerated
            (``--turns all``): its messages as read and how many turns it has. Each turn
            is a prompt of its own, ``<conversation>#turn<N>``, whose prompt_inputs row
            names the conversation and the turn (common/conversation.py).

Token id lists are stored as packed little-endian uint32 bytes (4 bytes a token): exact,
compact, and cheap to write; ``datagen export`` and ``common.tokenids.unpack`` read them.
"""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa

from common.tokenids import TokenIds

metadata = sa.MetaData()

PROMPT_STATES = ("queued", "done", "failed", "skipped")


def utcnow() -> datetime:
    return datetime.now(UTC)


meta = sa.Table(
    "meta",
    metadata,
    sa.Column("key", sa.String(64), primary_key=True),
    sa.Column("value", sa.String(200), nullable=False),
)

datasets = sa.Table(
    "datasets",
    metadata,
    sa.Column("name", sa.String(100), primary_key=True),
    sa.Column("budget_tokens", sa.BigInteger, nullable=False),
    sa.Column("basis", sa.String(16), nullable=False, server_default="output"),
    sa.Column("policy", sa.String(16), nullable=False, server_default="drain"),
    sa.Column("state", sa.String(16), nullable=False, server_default="open"),
    sa.Column("sampling", sa.JSON, nullable=False),
    sa.Column("max_seq_len", sa.Integer, nullable=False),
    sa.Column("tokenizer", sa.String(500), nullable=False),
    sa.Column("template_hash", sa.String(64), nullable=False),
    # The reasoning opener the template leaves open at the end of its generation prompt
    # (common/kept.py), NULL for none; with template mixtures, each draw's, by its
    # canonical text (common/draws.py ``draw_key``): a drawn argument may turn it off.
    sa.Column("reasoning_open", sa.String(32)),
    sa.Column("reasoning_opens", sa.JSON(none_as_null=True)),
    # "all": every assistant turn regenerated, one prompt per turn; NULL or "last": the
    # last turn only, after the line's own earlier answers.
    sa.Column("turns", sa.String(8)),
    # SGLang's --tool-call-parser name its tool-calling turns are parsed with (NULL: none).
    sa.Column("tool_call_parser", sa.String(64)),
    # The chat template's kwargs: workers render a conversation's later turns with them.
    sa.Column("template_kwargs", sa.JSON(none_as_null=True)),
    # common/order.py: "shuffle" (with its seed) or "file" (seed NULL). A dataset created
    # before orders existed was published in file order.
    sa.Column("sample_order", sa.String(16), nullable=False, server_default="file"),
    sa.Column("seed", sa.BigInteger),
    # common/draws.py: each mixed key's choices and weights; NULL for none.
    sa.Column("mixtures", sa.JSON(none_as_null=True)),
    # Samples of each prompt (``--generations``); NULL for one, ids without a suffix.
    sa.Column("generations", sa.Integer),
    # The value every task of the dataset is stamped with, new at creation and at each
    # reopen: workers keep revoked stamps in memory for their whole life, so a dataset
    # reopened (or recreated under the same name) must not match an old revoke.
    sa.Column("stamp", sa.String(160), nullable=False),
    sa.Column("close_reason", sa.String(16)),
    sa.Column("closed_at", sa.DateTime(timezone=True)),
    sa.Column("used_at_close", sa.BigInteger),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, default=utcnow),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, default=utcnow),
)

prompts = sa.Table(
    "prompts",
    metadata,
    sa.Column("dataset", sa.String(100), primary_key=True),
    sa.Column("sample_id", sa.String(200), primary_key=True),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("prompt_tokens", sa.Integer, nullable=False),
    sa.Column("max_new_tokens", sa.Integer, nullable=False),
    sa.Column("source", sa.String(600)),
    sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
    sa.Column("error", sa.Text),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, default=utcnow),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, default=utcnow),
    # Its place in the dataset's publishing order (common/order.py); NULL for a prompt
    # stored before ranks existed. No index: only the rare republishing paths sort by it,
    # and an index would cost every insert of the producer.
    sa.Column("rank", sa.BigInteger),
    sa.Index("ix_prompts_dataset_state", "dataset", "state"),
)

prompt_inputs = sa.Table(
    "prompt_inputs",
    metadata,
    sa.Column("dataset", sa.String(100), primary_key=True),
    sa.Column("sample_id", sa.String(200), primary_key=True),
    sa.Column("messages", sa.JSON, nullable=False),
    sa.Column("input_ids", TokenIds, nullable=False),
    # The line's function schemas as read (OpenAI's), passed to the chat template with its
    # messages; NULL for a line without tools.
    sa.Column("tools", sa.JSON(none_as_null=True)),
    # A turn of a regenerated conversation: its id and the turn's number (from 1); NULL
    # for a prompt of its own.
    sa.Column("conversation", sa.String(200)),
    sa.Column("turn", sa.Integer),
    # The chat template arguments drawn for this prompt (common/draws.py), rendered into
    # its ids; NULL when the dataset mixes none.
    sa.Column("template_kwargs", sa.JSON(none_as_null=True)),
    sa.Index("ix_prompt_inputs_conversation", "dataset", "conversation", "turn"),
)

# The columns prompt_inputs took out of prompts: a database written before has them in
# prompts, and common/migrations.py moves them on first use.
INPUT_COLUMNS = ("messages", "input_ids")
# The columns added to prompt_inputs since it was first created, nullable; an existing
# database gets them from common/migrations.py on first use.
# The columns added to the tables since they were first created, (table, column) in the
# order they are added: nullable, or with a default that rows written before then hold. An
# existing database gets them from common/migrations.py on first use.
ADDED_COLUMNS = (
    ("prompt_inputs", "tools"), ("prompt_inputs", "conversation"), ("prompt_inputs", "turn"),
    ("datasets", "turns"), ("datasets", "template_kwargs"), ("datasets", "sample_order"),
    ("datasets", "seed"), ("prompts", "rank"), ("datasets", "mixtures"),
    ("datasets", "generations"), ("prompt_inputs", "template_kwargs"),
    ("results", "sampling"),
    ("datasets", "tool_call_parser"),
    ("results", "kept"),
    ("datasets", "reasoning_opens"),
)
# Indexes on added columns, created with them (create_all makes them for a new table only).
ADDED_INDEXES = ("ix_prompt_inputs_conversation",)

results = sa.Table(
    "results",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("dataset", sa.String(100), nullable=False),
    sa.Column("sample_id", sa.String(200), nullable=False),
    sa.Column("rid", sa.String(200), nullable=False),
    sa.Column("prompt_tokens", sa.Integer, nullable=False),
    sa.Column("completion_tokens", sa.Integer, nullable=False),
    sa.Column("cached_tokens", sa.Integer, nullable=False, server_default="0"),
    sa.Column("reasoning_tokens", sa.Integer, nullable=False, server_default="0"),
    sa.Column("finish_reason", sa.String(16), nullable=False),
    sa.Column("finish_detail", sa.JSON),
    sa.Column("output_ids", TokenIds, nullable=False),
    sa.Column("output_text", sa.Text, nullable=False),
    sa.Column("e2e_latency_s", sa.Float),
    # The sampling_params sent with the request that made it; NULL for a result stored
    # before they were recorded (the dataset's sampling then).
    sa.Column("sampling", sa.JSON(none_as_null=True)),
    sa.Column("server", sa.String(500), nullable=False),
    sa.Column("model", sa.String(500), nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, default=utcnow),
    # Whether the exports keep it as an answer (common.kept); the "kept" budget basis
    # charges only these. NULL on rows stored before the column existed.
    sa.Column("kept", sa.Boolean),
    sa.UniqueConstraint("dataset", "sample_id", name="uq_results_dataset_sample"),
    sa.Index("ix_results_dataset_created", "dataset", "created_at"),
)

conversations = sa.Table(
    "conversations",
    metadata,
    sa.Column("dataset", sa.String(100), primary_key=True),
    sa.Column("conversation", sa.String(200), primary_key=True),
    # As read, the line's original answers of earlier turns included; no prompt holds them.
    sa.Column("messages", sa.JSON, nullable=False),
    sa.Column("tools", sa.JSON(none_as_null=True)),
    sa.Column("turns", sa.Integer, nullable=False),  # assistant turns to generate
    sa.Column("source", sa.String(600)),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, default=utcnow),
)
