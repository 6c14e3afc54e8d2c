"""What SQL knows of conversations regenerated turn by turn: a stored turn's context for
building the next, the turns waiting, and how many conversations are complete or partial.

A conversation's state is read from its turns, never stored apart, so it cannot drift:

  complete     every turn has a result;
  in progress  not complete, a turn queued and its dataset open;
  partial      some turns stored, no turn left to run (its dataset closed, or a turn
               failed or had no room under max_seq_len);
  not started  no turn stored and none left to run.

``tools_differ`` counts, among the partial ones, those that ended because the model's tool
calls were not the line's (workers/tool_turns.py): their next turn is skipped with an
error beginning ``TOOLS_DIFFER``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from common.conversation import TOOLS_DIFFER
from common.schema import conversations, prompt_inputs, prompts, results
from common.store import Store, by_keys, kept_completion_tokens, key_params


@dataclass(frozen=True)
class TurnContext:
    """A stored turn of a conversation, with what building its successor needs."""

    dataset: str
    sample_id: str
    conversation: str
    turn: int
    turns: int  # the conversation's turns in all
    prompt: list[dict[str, Any]]  # this turn's prompt messages (own earlier answers)
    tools: list[dict[str, Any]] | None
    original: list[dict[str, Any]]  # the conversation as read
    source: str | None
    # The turn's place in the publishing order, which its successor takes: a republished
    # conversation stays where its first turn was (NULL for a prompt from before ranks).
    rank: int | None = None


@dataclass(frozen=True)
class ConversationCounts:
    total: int = 0
    complete: int = 0
    in_progress: int = 0
    partial: int = 0
    not_started: int = 0
    tools_differ: int = 0  # partial: the model's tool calls were not the line's


def turn_contexts(store: Store, keys: Sequence[tuple[str, str]]
                  ) -> dict[tuple[str, str], TurnContext]:
    """The turns among (dataset, sample_id) keys, by key; a prompt of its own is absent."""
    if not keys:
        return {}
    unique = list(dict.fromkeys(keys))
    q = sa.select(
        prompt_inputs.c.dataset, prompt_inputs.c.sample_id, prompt_inputs.c.conversation,
        prompt_inputs.c.turn, conversations.c.turns, prompt_inputs.c.messages.label("prompt"),
        prompt_inputs.c.tools, conversations.c.messages.label("original"),
        conversations.c.source, prompts.c.rank,
    ).join(conversations, sa.and_(conversations.c.dataset == prompt_inputs.c.dataset,
                                  conversations.c.conversation == prompt_inputs.c.conversation)
           ).join(prompts, sa.and_(prompts.c.dataset == prompt_inputs.c.dataset,
                                   prompts.c.sample_id == prompt_inputs.c.sample_id)
                  ).where(by_keys(prompt_inputs, len(unique)))
    with store.engine.connect() as conn:
        return {(r.dataset, r.sample_id): TurnContext(**r._mapping)
                for r in conn.execute(q, key_params(unique))}


def turn_state(store: Store, dataset: str, conversation: str, turn: int) -> str | None:
    """The state of a conversation's turn, None if it has no prompt yet."""
    q = sa.select(prompts.c.state).join(
        prompt_inputs, sa.and_(prompt_inputs.c.dataset == prompts.c.dataset,
                               prompt_inputs.c.sample_id == prompts.c.sample_id),
    ).where(prompt_inputs.c.dataset == dataset, prompt_inputs.c.conversation == conversation,
            prompt_inputs.c.turn == turn)
    with store.engine.connect() as conn:
        state = conn.scalar(q)
    return None if state is None else str(state)


def queued_later_turns(store: Store, dataset: str) -> list[str]:
    """Sample ids of the dataset's queued turns after the first: no prompt file lists them."""
    q = sa.select(prompts.c.sample_id).join(
        prompt_inputs, sa.and_(prompt_inputs.c.dataset == prompts.c.dataset,
                               prompt_inputs.c.sample_id == prompts.c.sample_id),
    ).where(prompts.c.dataset == dataset, prompts.c.state == "queued",
            prompt_inputs.c.turn > 1)
    with store.engine.connect() as conn:
        return list(conn.scalars(q))


def _turns_stored() -> sa.FromClause:
    """Each conversation's turns, with their prompt and, once stored, their result."""
    return conversations.join(prompt_inputs, sa.and_(
        prompt_inputs.c.dataset == conversations.c.dataset,
        prompt_inputs.c.conversation == conversations.c.conversation),
    ).join(prompts, sa.and_(prompts.c.dataset == prompt_inputs.c.dataset,
                            prompts.c.sample_id == prompt_inputs.c.sample_id),
    ).outerjoin(results, sa.and_(results.c.dataset == prompt_inputs.c.dataset,
                                 results.c.sample_id == prompt_inputs.c.sample_id))


def conversation_counts(store: Store, dataset: str, closed: bool) -> ConversationCounts:
    """How many of the dataset's conversations are in each state (module docstring)."""
    per = sa.select(
        conversations.c.turns,
        sa.func.count(results.c.id).label("stored"),
        sa.func.sum(sa.case((prompts.c.state == "queued", 1), else_=0)).label("pending"),
        sa.func.sum(sa.case((prompts.c.error.like(f"{TOOLS_DIFFER}%"), 1), else_=0)
                    ).label("differ"),
    ).select_from(_turns_stored()).where(conversations.c.dataset == dataset).group_by(
        conversations.c.conversation, conversations.c.turns).subquery()
    complete = per.c.stored >= per.c.turns
    running = sa.false() if closed else sa.and_(sa.not_(complete), per.c.pending > 0)

    def count(condition: sa.ColumnElement[bool]) -> sa.ColumnElement[int]:
        return sa.func.coalesce(sa.func.sum(sa.case((condition, 1), else_=0)), 0)

    q = sa.select(
        sa.func.count(), count(complete), count(running),
        count(sa.and_(sa.not_(complete), sa.not_(running), per.c.stored > 0)),
        count(per.c.differ > 0),
    ).select_from(per)
    with store.engine.connect() as conn:
        total, done, going, partial, differ = (int(n) for n in conn.execute(q).one())
    return ConversationCounts(total, done, going, partial, total - done - going - partial,
                              differ)


@dataclass(frozen=True)
class ConversationTokens:
    """A dataset's stored turns summed by conversation state, for planning in
    conversations: the complete ones give the tokens a conversation takes; the stored
    turns of the others are spent on conversations still to finish."""

    complete: int = 0
    complete_prompt_tokens: int = 0
    complete_completion_tokens: int = 0
    open_prompt_tokens: int = 0
    open_completion_tokens: int = 0
    complete_kept_tokens: int = 0  # completions of the kept turns (common.kept)
    open_kept_tokens: int = 0
    conversations: int = 0
    turns: int = 0  # assistant turns of all the conversations


@dataclass(frozen=True)
class SingleTurns:
    """A --turns all dataset's lines of a single turn: prompts of their own, no
    conversation (``producer/turns.py``), counted and summed like samples."""

    prompts: int = 0
    done: int = 0
    queued: int = 0
    prompt_tokens: int = 0  # of their results
    completion_tokens: int = 0
    kept_completion_tokens: int = 0  # of their kept results (common.kept)


def conversation_tokens(store: Store, dataset: str) -> ConversationTokens:
    """Token sums of the dataset's stored turns, complete conversations apart."""
    per = sa.select(
        conversations.c.turns,
        sa.func.count(results.c.id).label("stored"),
        sa.func.coalesce(sa.func.sum(results.c.prompt_tokens), 0).label("prompt"),
        sa.func.coalesce(sa.func.sum(results.c.completion_tokens), 0).label("completion"),
        sa.func.coalesce(sa.func.sum(kept_completion_tokens()), 0).label("kept"),
    ).select_from(_turns_stored()).where(conversations.c.dataset == dataset).group_by(
        conversations.c.conversation, conversations.c.turns).subquery()
    complete = per.c.stored >= per.c.turns

    def total(column: sa.ColumnElement[Any], when: sa.ColumnElement[bool]
              ) -> sa.ColumnElement[int]:
        return sa.func.coalesce(sa.func.sum(sa.case((when, column), else_=0)), 0)

    q = sa.select(
        total(sa.literal(1), complete), total(per.c.prompt, complete),
        total(per.c.completion, complete), total(per.c.prompt, sa.not_(complete)),
        total(per.c.completion, sa.not_(complete)), total(per.c.kept, complete),
        total(per.c.kept, sa.not_(complete)), sa.func.count(),
        sa.func.coalesce(sa.func.sum(per.c.turns), 0),
    ).select_from(per)
    with store.engine.connect() as conn:
        return ConversationTokens(*(int(n) for n in conn.execute(q).one()))


def single_turns(store: Store, dataset: str) -> SingleTurns:
    """The dataset's prompts outside any conversation, with their results' tokens."""
    def count(state: str) -> sa.ColumnElement[int]:
        return sa.func.coalesce(sa.func.sum(sa.case((prompts.c.state == state, 1), else_=0)), 0)

    q = sa.select(
        sa.func.count(), count("done"), count("queued"),
        sa.func.coalesce(sa.func.sum(results.c.prompt_tokens), 0),
        sa.func.coalesce(sa.func.sum(results.c.completion_tokens), 0),
        sa.func.coalesce(sa.func.sum(kept_completion_tokens()), 0),
    ).select_from(
        prompts.join(prompt_inputs, sa.and_(prompt_inputs.c.dataset == prompts.c.dataset,
                                            prompt_inputs.c.sample_id == prompts.c.sample_id))
        .outerjoin(results, sa.and_(results.c.dataset == prompts.c.dataset,
                                    results.c.sample_id == prompts.c.sample_id))
    ).where(prompts.c.dataset == dataset, prompt_inputs.c.conversation.is_(None))
    with store.engine.connect() as conn:
        return SingleTurns(*(int(n) for n in conn.execute(q).one()))


def latest_turns(store: Store, dataset: str, upto_id: int, parsed_calls: bool = False
                 ) -> dict[str, int]:
    """Each conversation's last turn with a result, among results up to ``upto_id``.

    ``parsed_calls``: the last whose answer is stored whole, leaving out a turn whose tool
    calls were not the line's (its successor skipped, ``TOOLS_DIFFER``): its calls ended
    the conversation unparsed into history, so they are nowhere as calls."""
    q = sa.select(prompt_inputs.c.conversation, sa.func.max(prompt_inputs.c.turn)).join(
        results, sa.and_(results.c.dataset == prompt_inputs.c.dataset,
                         results.c.sample_id == prompt_inputs.c.sample_id),
    ).where(results.c.dataset == dataset, results.c.id <= upto_id,
            prompt_inputs.c.conversation.is_not(None)).group_by(prompt_inputs.c.conversation)
    if parsed_calls:
        nxt, nxt_p = prompt_inputs.alias("next_inputs"), prompts.alias("next_prompts")
        q = q.outerjoin(nxt, sa.and_(nxt.c.dataset == prompt_inputs.c.dataset,
                                     nxt.c.conversation == prompt_inputs.c.conversation,
                                     nxt.c.turn == prompt_inputs.c.turn + 1)
                        ).outerjoin(nxt_p, sa.and_(nxt_p.c.dataset == nxt.c.dataset,
                                                   nxt_p.c.sample_id == nxt.c.sample_id)
                                    ).where(sa.or_(nxt_p.c.error.is_(None),
                                                   sa.not_(nxt_p.c.error.like(
                                                       f"{TOOLS_DIFFER}%"))))
    with store.engine.connect() as conn:
        return {conversation: int(turn) for conversation, turn in conn.execute(q)}
