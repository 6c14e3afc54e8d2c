"""A conversation's next turn, built by the worker that stores the turn before it.

Why here: turn i+1's prompt is turn i's prompt, the model's own answer to it and the
line's next user message (or, after an answer that called tools, the model's own calls
parsed by the server and the line's tool results: workers/tool_turns.py), rendered by the
chat template and tokenized. The worker holding turn i's result has all of it at hand:
it builds turn i+1 in the step that stores turn i and inserts it in the same transaction
(ON CONFLICT DO NOTHING), so the next turn exists exactly when its predecessor is stored,
whatever is killed or redelivered, and no other process needs the tokenizer. Each
process loads a dataset's tokenizer once (checked against the template the producer used)
and keeps it.

The next turn is published once the transaction commits, into its dataset's queue ahead
of the new prompts waiting there (common/messages.py), so its prefix is still in the
server's prefix cache when it is sent. If the worker dies between the
commit and the publishing, the redelivered turn finds its sample stored and publishes
the next turn again; failing that, the workers' sweep publishes it, as any queued prompt
Redis lost.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from common.conversation import (
    Message,
    is_turn_id,
    next_turn,
    original_calls,
    own_answer,
    turn_id,
)
from common.conversation_store import TurnContext, turn_contexts, turn_state
from common.draws import seed_of
from common.errors import ConfigError
from common.ledger import Ledger
from common.publish import Publisher
from common.rows import NewPrompt, ResultRow, allowance
from common.sglang_client import SGLangClient
from common.store import DatasetRow, Store
from producer.template import ChatTemplater, dataset_templater
from workers.tool_turns import ToolsDiffer, parse_on_fleet, parse_text, tool_answer

log = logging.getLogger(__name__)
Kept = tuple[DatasetRow, ResultRow]


class NextTurns:
    """Builds the next turns of the conversation turns a worker stores."""

    def __init__(self, store: Store, trust_remote_code: bool,
                 client: SGLangClient | None = None) -> None:
        self.store, self.trust_remote_code = store, trust_remote_code
        self.client = client  # parses tool-calling turns (workers/tool_turns.py)
        self._templaters: dict[tuple[str, str], ChatTemplater] = {}
        self._lock = threading.Lock()

    def templater(self, ds: DatasetRow) -> ChatTemplater:
        """The dataset's chat templater, loaded once per process."""
        key = (ds.tokenizer, ds.template_hash)
        with self._lock:
            found = self._templaters.get(key)
            if found is None:
                found = dataset_templater(ds.name, ds.tokenizer, ds.template_kwargs,
                                          ds.template_hash, self.trust_remote_code)
                self._templaters[key] = found
            return found

    def build(self, kept: Sequence[Kept]) -> dict[tuple[str, str], NewPrompt]:
        """The next turn of each kept row that is a conversation's turn with one after it,
        by the row's key. A row cut to the budget (``exact``) gets none: its answer is not
        the model's whole answer; nor does one without an answer (cut off while still
        reasoning, or empty): no user replies to it, and SpecForge refuses an empty
        assistant turn. Its conversation ends there, partial."""
        # Only ids of a turn's form are looked up: a single-turn line (the default
        # dataset's every sample) costs its group no query.
        wanted = [(ds, row) for ds, row in kept
                  if ds.turns == "all" and row.finish_reason != "budget"
                  and is_turn_id(row.sample_id)]
        if not wanted:
            return {}
        contexts = turn_contexts(self.store, [row.key for _, row in wanted])
        made = {}
        for ds, row in wanted:
            context = contexts.get(row.key)
            if context is None or context.turn >= context.turns:
                continue
            following = self._next(ds, row, context)
            if following is not None:
                made[row.key] = following
        return made

    def _next(self, ds: DatasetRow, row: ResultRow, context: TurnContext) -> NewPrompt | None:
        turn = context.turn + 1
        try:
            drawn = ds.mixtures.template(seed_of(ds.order.seed), context.conversation)
            templater = self.templater(ds).variant(drawn)
            answer = self._answer(ds, row, context, templater)
            if answer is None:
                return None
            messages = next_turn(context.original, context.prompt, context.turn, answer)
            [input_ids] = templater.encode_batch([messages], [context.tools])
        except ToolsDiffer as exc:  # the conversation ends here, with the reason stored
            return self._row(ds, context, turn, [], [], "skipped", str(exc))
        except Exception as exc:  # the conversation ends here, with the reason stored
            log.warning("%s/%s: turn %d could not be built: %s", ds.name,
                        row.sample_id, turn, exc)
            return self._row(ds, context, turn, [], [], "failed",
                             f"turn {turn} could not be built: {exc}")
        max_new = int(ds.sampling.get("max_new_tokens", 0))
        state, max_new_tokens, error = allowance(len(input_ids), max_new, ds.max_seq_len)
        return self._row(ds, context, turn, messages, input_ids, state, error, max_new_tokens,
                         drawn or None)

    def _answer(self, ds: DatasetRow, row: ResultRow, context: TurnContext,
                templater: ChatTemplater) -> Message | None:
        """The model's answer as history: with its tool calls where the line's answer
        called tools; None for an answer with nothing in it."""
        reasoning = templater.reasoning_close is not None
        originals = original_calls(context.original, context.turn)
        if not originals:
            answer = own_answer(row.output_text, templater.split_reasoning, reasoning)
            return answer if str(answer["content"]).strip() else None
        client, parser = self.client, ds.tool_call_parser
        if client is None or not parser:
            raise ConfigError(f"dataset {ds.name} has no --tool-call-parser for its tool calls")
        text = parse_text(templater.decode_all, row.output_ids, row.finish_detail)
        parse = parse_on_fleet(lambda server, t, tools: client.parse_function_call(
            server, t, tools, parser), row.server, client.urls)
        return tool_answer(parse, text, context.tools, originals, templater.split_reasoning,
                           reasoning)

    @staticmethod
    def _row(ds: DatasetRow, context: TurnContext, turn: int, messages: list[dict[str, object]],
             input_ids: list[int], state: str, error: str | None,
             max_new_tokens: int = 0, drawn: dict[str, object] | None = None) -> NewPrompt:
        return NewPrompt(
            dataset=ds.name, sample_id=turn_id(context.conversation, turn), state=state,
            prompt_tokens=len(input_ids), max_new_tokens=max_new_tokens,
            source=context.source or "", messages=messages, input_ids=input_ids, error=error,
            tools=context.tools, conversation=context.conversation, turn=turn,
            rank=context.rank, template_kwargs=drawn)


def publish_next(publisher: Publisher, ledger: Ledger, ds: DatasetRow, sample_id: str) -> bool:
    """Publish a stored, queued next turn, unless its dataset has closed (no new turn
    starts then: it stays queued in SQL, and the conversation is partial unless the
    dataset is reopened). A publishing that fails is left to the workers' sweep; True if
    it was published."""
    try:
        if ledger.is_closed(ds.name):
            return False
        publisher.publish(ds.name, ds.stamp, [sample_id], ahead=True)
    except Exception as exc:  # Redis away: the turn is queued in SQL, the sweep sends it
        log.warning("%s/%s: not published (%s); the sweep will publish it", ds.name,
                    sample_id, exc)
        return False
    return True


def publish_stored_next(store: Store, publisher: Publisher, ledger: Ledger, ds: DatasetRow,
                        sample_id: str) -> bool:
    """For a turn found already stored (a redelivery): publish its next turn again if it
    is still queued, in case the worker that stored it died before publishing it. A copy
    already queued is harmless: the ledger charges a turn once and SQL keeps one result."""
    context = turn_contexts(store, [(ds.name, sample_id)]).get((ds.name, sample_id))
    if context is None or context.turn >= context.turns:
        return False
    if turn_state(store, ds.name, context.conversation, context.turn + 1) != "queued":
        return False
    return publish_next(publisher, ledger, ds, turn_id(context.conversation, context.turn + 1))
