"""Where the model's own earlier answers sit in a conversation's last prompt ids.

A speculators row of a whole conversation (``--rows conversation``) is its last stored
turn's prompt ids and completion. That prompt is the chat template's rendering of the
conversation with the model's own earlier answers (common/conversation.py), so those
answers are in its ids, as the template renders history: a template that drops earlier
reasoning drops it, one that strips whitespace strips it. They are not the earlier
completions' ids (the text is tokenized again, in context), so they are found in the
prompt itself:

1. the prompt is rendered twice, as stored and with each own answer's ``content`` and
   ``reasoning_content`` replaced by a marker; the text around the markers is the
   template's, the same in both, so each marker's place gives where that piece of the
   answer starts in the real text, and the text that follows gives where it ends (the
   piece as written, or stripped, whichever the real text holds);
2. the prompt ids are decoded a few ids at a time (the way servers stream text), giving
   each token's place in that text; the rendered text must tokenize to the stored ids
   and decode back to itself, or the row is not built;
3. a token is masked 1 when its text lies wholly inside a piece of an own answer, and 0
   otherwise: role markers, the template's separators, tool calls as the template
   renders them (its own text from the parsed calls), a token straddling a boundary,
   and every system, user and tool message.

The assistant messages before the first user message were written by the line, not the
model (they stay in every prompt as read), and are masked 0.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from common.store import DatasetRow
from producer.template import ChatTemplater, dataset_templater

Message = dict[str, Any]
Span = tuple[int, int]  # [start, end) in characters of the rendered prompt
Render = Callable[[list[Message]], str]
Decode = Callable[[Sequence[int]], str]

_MARKER = "[[datagen-own-answer-{}]]"
_MARKER_RE = re.compile(r"\[\[datagen-own-answer-(\d+)\]\]")
PIECES = ("reasoning_content", "content")


class SpanError(ValueError):
    """The own answers cannot be placed exactly in the prompt ids: the row is not built."""


def own_answers(messages: Sequence[Message]) -> list[int]:
    """Indexes of the model's own answers: every assistant message after the first user
    message (the model's, under ``--turns all``; the line's answers are never copied)."""
    seen_user, found = False, []
    for i, message in enumerate(messages):
        if message.get("role") == "user":
            seen_user = True
        elif message.get("role") == "assistant" and seen_user:
            found.append(i)
    return found


def _marked(messages: Sequence[Message]) -> tuple[list[Message], list[str]]:
    """The messages with each non-empty piece of an own answer replaced by a marker, and
    the pieces by marker number."""
    out: list[Message] = [dict(m) for m in messages]
    pieces: list[str] = []
    for i in own_answers(messages):
        for key in PIECES:
            value = out[i].get(key)
            if isinstance(value, str) and value:
                out[i][key] = _MARKER.format(len(pieces))
                pieces.append(value)
    return out, pieces


def _renderings(piece: str) -> list[str]:
    """How a template may write a piece, longest first: as is, or stripped."""
    return sorted({piece, piece.strip(), piece.lstrip(), piece.rstrip()}, key=len, reverse=True)


def piece_spans(render: Render, messages: Sequence[Message]) -> tuple[str, list[Span]]:
    """The rendered prompt and where each own answer piece it holds sits in it."""
    text = render(list(messages))
    marked, pieces = _marked(messages)
    if not pieces:
        return text, []
    template = render(marked)
    if _MARKER_RE.search(text):
        raise SpanError("the conversation's own text holds datagen's answer marker")
    parts = _MARKER_RE.split(template)  # literal, number, literal, number, ..., literal
    spans, at = [], 0
    for k in range(0, len(parts) - 1, 2):
        literal, piece, after = parts[k], pieces[int(parts[k + 1])], parts[k + 2]
        if not text.startswith(literal, at):
            raise SpanError(f"the template's text differs around own answer piece {k // 2}")
        at += len(literal)
        written = next((w for w in _renderings(piece) if text.startswith(w + after, at)),
                       None)
        if written is None:
            raise SpanError(f"own answer piece {k // 2} is rendered in a way not found")
        spans.append((at, at + len(written)))
        at += len(written)
    if text[at:] != parts[-1]:
        raise SpanError("the template's text differs after the last own answer")
    return text, spans


def token_ends(ids: Sequence[int], decode: Decode, text: str) -> list[int]:
    """The end, in characters of ``text``, of what each id adds when decoded in order.

    Ids are decoded a few at a time, from the previous completed character on, as
    servers stream text: an id that ends inside a multi-byte character adds nothing
    until the id completing it. SpanError unless the whole decodes back to ``text``.
    """
    ends: list[int] = []
    pieces: list[str] = []
    prefix_at = read_at = length = 0
    for i in range(len(ids)):
        prefix = decode(ids[prefix_at:read_at])
        full = decode(ids[prefix_at:i + 1])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            pieces.append(full[len(prefix):])
            length += len(full) - len(prefix)
            prefix_at, read_at = read_at, i + 1
        ends.append(length)
    if ids and read_at < len(ids):  # text that really ends in U+FFFD: the last id's
        rest = decode(ids[prefix_at:])[len(decode(ids[prefix_at:read_at])):]
        pieces.append(rest)
        ends[-1] = length + len(rest)
    if "".join(pieces) != text:
        raise SpanError("the prompt ids do not decode back to the rendered prompt")
    return ends


def mask_of(ends: Sequence[int], spans: Sequence[Span]) -> list[int]:
    """1 for each token whose text lies inside a span; an id adding no text takes the
    mask of the id that completes its character."""
    mask = [0] * len(ends)
    pending: list[int] = []  # ids that added nothing yet
    start = 0
    for i, end in enumerate(ends):
        if end == start:
            pending.append(i)
            continue
        inside = int(any(a <= start and end <= b for a, b in spans))
        for j in [*pending, i]:
            mask[j] = inside
        pending.clear()
        start = end
    return mask


class ConversationMasks:
    """The prompt masks of one dataset's conversation rows; its templater (the one its
    prompts were made with) is loaded on the first row that needs it."""

    def __init__(self, ds: DatasetRow, trust_remote_code: bool) -> None:
        self.ds, self.trust_remote_code = ds, trust_remote_code
        self._templater: ChatTemplater | None = None

    def templater(self, kwargs: dict[str, Any] | None) -> ChatTemplater:
        if self._templater is None:
            ds = self.ds
            self._templater = dataset_templater(ds.name, ds.tokenizer, ds.template_kwargs,
                                                ds.template_hash, self.trust_remote_code)
        return self._templater.variant(kwargs or {})

    def prompt_mask(self, messages: list[Message], tools: list[Message] | None,
                    input_ids: list[int], kwargs: dict[str, Any] | None) -> list[int]:
        """1 on the prompt's own answer tokens, 0 elsewhere; SpanError if they cannot be
        placed exactly."""
        templater = self.templater(kwargs)
        text, spans = piece_spans(lambda m: templater.render(m, tools), messages)
        if templater.tokenize([text])[0] != input_ids:
            raise SpanError("the prompt rendered now does not tokenize to the stored ids")
        return mask_of(token_ends(input_ids, templater.text_decoder(), text), spans)
