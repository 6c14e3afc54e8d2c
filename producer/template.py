"""Render conversations with the target model's own chat template and tokenize them.

The worker sends token ids, not text, to SGLang, so the ids built here *are* the prompt the
target model sees: they must equal ``apply_chat_template(messages, tools=...,
tokenize=True, add_generation_prompt=True)`` exactly. This sits on the producer's hot path,
so the template is compiled once and the rendered strings are tokenized in one Rust batch
call; both shortcuts are checked against that public call on probe conversations (tools
and tool calls among them) when the templater is built, and dropped where they disagree.

A tokenizer whose class is Python code beside its files (``auto_map`` in
``tokenizer_config.json``, as Kimi K2 ships it) is loaded only when the caller trusts the
folder's code (``--trust-remote-code``): loading it runs that code.
"""

from __future__ import annotations

import copy
import hashlib
import json
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import common
from common.draws import draw_key
from common.errors import ConfigError
from common.kept import REASONING_MARKERS, split_reasoning
from common.tokenizer_files import load_tokenizer

BUNDLED_TOKENIZER: Path = Path(common.__file__).parent / "assets" / "tokenizer"

Messages = Sequence[dict[str, Any]]
Tools = Sequence[dict[str, Any]] | None
Renderer = Callable[[Messages, Tools], str]

_PROBE: list[dict[str, Any]] = [{"role": "user", "content": "Hello"}]
# A tool schema with its keys out of order, so a class that rewrites tools before rendering
# (sorting them, say) shows on the probes.
_PROBE_TOOLS: list[dict[str, Any]] = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "required": ["city"],
                       "properties": {"city": {"type": "string"}}},
        "description": "Weather of a city.",
    },
}]
_PROBE_CALL: list[dict[str, Any]] = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "reasoning_content": "Two cities: two calls.",
     "tool_calls": [
         {"id": "call_1", "type": "function",
          "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
         {"id": "call_2", "type": "function",
          "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
     ]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "name": "get_weather", "content": "rain"},
]
# (messages, tools); every probe the public path renders must render alike on the fast one.
_PROBES: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = [
    (_PROBE, None),
    ([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ], None),
    (_PROBE, _PROBE_TOOLS),
    (_PROBE_CALL, _PROBE_TOOLS),
]
def _listed(tools: Tools) -> list[dict[str, Any]] | None:
    return None if tools is None else list(tools)


def _chat_template(tokenizer: Any, name: str) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"tokenizer at {name} has no chat template")
    try:
        template = tokenizer.get_chat_template()
    except ValueError as exc:
        raise ConfigError(f"tokenizer at {name}: unusable chat template ({exc})") from exc
    if not isinstance(template, str):
        raise ConfigError(f"tokenizer at {name} has no chat template")
    return template


def _template_hash(template: str, kwargs: dict[str, Any]) -> str:
    try:
        frozen = json.dumps(kwargs, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"chat_template_kwargs must be JSON values: {exc}") from exc
    return hashlib.sha256(f"{template}\0{frozen}".encode()).hexdigest()


def _compiled_renderer(template: str, variables: dict[str, Any]) -> Renderer:
    """Render with the very Jinja environment transformers uses, compiled once.

    ``apply_chat_template`` re-validates and deep-copies every call, which costs more than
    the rendering itself. Its environment (sandbox, filters, globals, the ``generation``
    tag) is private API, so callers check the result against the public path and fall
    back to it when they disagree or the helper is gone.
    """
    from transformers.utils.chat_template_utils import _compile_jinja_template

    compiled = _compile_jinja_template(template)
    env: Any = compiled.environment
    # Template.render copies the template's globals (a ChainMap, slow to walk) into a new
    # context twice a call, which costs more than rendering a short conversation; this is
    # its body with that copy made once.
    shared_globals = dict(compiled.globals)
    base = {**shared_globals, **variables}

    def render(messages: Messages, tools: Tools = None) -> str:
        context = env.context_class(
            env, {**base, "messages": list(messages), "tools": tools}, compiled.name,
            compiled.blocks, globals=shared_globals,
        )
        try:
            return str(env.concat(compiled.root_render_func(context)))
        except Exception:
            env.handle_exception()
            raise

    return render


class ChatTemplater:
    """One target model's chat template and tokenizer, as the producer needs them."""

    def __init__(self, tokenizer: str, chat_template_kwargs: dict[str, Any] | None = None,
                 trust_remote_code: bool = False) -> None:
        self.name = tokenizer
        self._kwargs: dict[str, Any] = dict(chat_template_kwargs or {})
        self._tok = load_tokenizer(tokenizer, trust_remote_code)
        self._variants: dict[str, ChatTemplater] = {}
        self._variants_lock = threading.Lock()
        self._prepare()

    def _prepare(self) -> None:
        """The renderer and tokenizing shortcuts for this templater's kwargs, each checked
        against the public path."""
        template = _chat_template(self._tok, self.name)
        self.template_hash = _template_hash(template, self._kwargs)
        probes = self._probe_texts()
        self._render = self._pick_renderer(template, probes)
        self._backend = self._rust_backend()
        self._check_ids(probes)
        self.reasoning_open, self.reasoning_close = self._detect_reasoning()
        self.eos_token_id: int | None = self._tok.eos_token_id
        # len() counts added tokens too, so every id the tokenizer can emit is below it.
        self.vocab_size: int = len(self._tok)

    def _public_render(self, messages: Messages, tools: Tools = None) -> str:
        try:
            text = self._tok.apply_chat_template(
                list(messages), tools=_listed(tools), tokenize=False,
                add_generation_prompt=True, **self._kwargs
            )
        except Exception as exc:
            raise ConfigError(f"chat template of {self.name} failed to render: {exc}") from exc
        return str(text)

    def _probe_texts(self) -> list[str | None]:
        """The public path's text of each probe; None for a probe with tools that the
        template cannot render (it takes no tool calls): such lines fail on either path."""
        texts: list[str | None] = []
        for messages, tools in _PROBES:
            try:
                texts.append(self._public_render(messages, tools))
            except ConfigError:
                if tools is None:
                    raise
                texts.append(None)
        return texts

    def _pick_renderer(self, template: str, expected: list[str | None]) -> Renderer:
        variables = {
            "tools": None,
            "documents": None,
            "add_generation_prompt": True,
            **self._tok.special_tokens_map,
            **self._kwargs,
        }
        try:
            fast = _compiled_renderer(template, variables)
            agrees = all(fast(messages, tools) == text
                         for (messages, tools), text in zip(_PROBES, expected, strict=True)
                         if text is not None)
        except Exception:
            agrees = False  # private helper gone or different: the public path still works
        return fast if agrees else self._public_render

    def _check_ids(self, expected: list[str | None]) -> None:
        """The batch tokenizing gives ``apply_chat_template(..., tokenize=True)``'s ids on
        every probe, or its Rust shortcut is dropped; a tokenizer whose ids even its own
        text does not give back is refused (the ids are the prompt the model sees)."""
        probes = [p for p, text in zip(_PROBES, expected, strict=True) if text is not None]
        texts = [self._render(messages, tools) for messages, tools in probes]
        want = [self._public_ids(messages, tools) for messages, tools in probes]
        if self._backend is not None and self._tokenize(texts) != want:
            self._backend = None
        if self._tokenize(texts) != want:
            raise ConfigError(
                f"tokenizer {self.name}: its rendered prompt does not tokenize to the ids "
                "apply_chat_template(..., tokenize=True) gives, so datagen cannot build them")

    def _public_ids(self, messages: Messages, tools: Tools) -> list[int]:
        out = self._tok.apply_chat_template(
            list(messages), tools=_listed(tools), tokenize=True, add_generation_prompt=True,
            return_dict=False, **self._kwargs)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def _rust_backend(self) -> Any:
        backend = getattr(self._tok, "_tokenizer", None)
        if backend is None or not hasattr(backend, "encode_batch"):
            return None
        return backend

    def _detect_reasoning(self) -> tuple[str | None, str | None]:
        tail = self._public_render(_PROBE).rstrip()
        for opener, closer in REASONING_MARKERS.items():
            if tail.endswith(opener):
                return opener, closer
        return None, None

    def variant(self, extra: dict[str, Any]) -> ChatTemplater:
        """This templater with ``extra`` template arguments over its own (a draw of a
        mixture, common/draws.py): the tokenizer is shared, the renderer made and checked
        again once per distinct ``extra``, then kept."""
        if not extra:
            return self
        key = draw_key(extra)
        found = self._variants.get(key)
        if found is not None:
            return found
        with self._variants_lock:
            found = self._variants.get(key)
            if found is None:
                found = copy.copy(self)
                found._kwargs = {**self._kwargs, **extra}
                found._variants, found._variants_lock = {}, threading.Lock()
                found._prepare()
                self._variants[key] = found
            return found

    def reasoning_opens(self, draws: Sequence[dict[str, Any]]) -> dict[str, str | None] | None:
        """The reasoning opener each draw's variant leaves open, by ``draw_key``; None
        without draws. A drawn argument may turn reasoning off (``thinking=false``)."""
        if not draws:
            return None
        return {draw_key(d): self.variant(d).reasoning_open for d in draws}

    @property
    def kwargs(self) -> dict[str, Any]:
        """The chat template's kwargs (``--chat-template-kwargs``)."""
        return dict(self._kwargs)

    def render(self, messages: Messages, tools: Tools = None) -> str:
        """The prompt text the target model sees for one conversation and its tools."""
        return self._render(messages, tools)

    def encode_batch(self, conversations: Sequence[Messages],
                     tools: Sequence[Tools] | None = None) -> list[list[int]]:
        """Token ids of each conversation's prompt (with its tools, ``tools[i]``),
        generation prompt included."""
        if not conversations:
            return []
        each = tools if tools is not None else [None] * len(conversations)
        return self.tokenize([self._render(messages, t)
                              for messages, t in zip(conversations, each, strict=True)])

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of rendered prompts (``render``'s output), in one batch call."""
        if not texts:
            return []
        return self._tokenize(list(texts))

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        if self._backend is None:
            return [list(ids) for ids in self._tok(texts, add_special_tokens=False)["input_ids"]]
        # encode_batch_fast skips character offsets, which nothing here needs.
        encode = getattr(self._backend, "encode_batch_fast", self._backend.encode_batch)
        return [encoding.ids for encoding in encode(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def decode_all(self, ids: Sequence[int]) -> str:
        """Text of ids with special tokens kept: tool-call markers often are special."""
        return str(self._tok.decode(list(ids), skip_special_tokens=False))

    def text_decoder(self) -> Callable[[Sequence[int]], str]:
        """``decode_all`` at its fastest: the Rust backend's own decode where there is one
        (no clean-up of spaces, so rendered text comes back as rendered), for callers that
        decode a few ids at a time over a whole prompt."""
        backend = self._backend
        if backend is None:
            return self.decode_all
        return lambda ids: str(backend.decode(list(ids), skip_special_tokens=False))

    def split_reasoning(self, text: str) -> tuple[str, str]:
        """(reasoning_content, content) of a completion generated after the prompt.

        Both parts are stripped, as SGLang's reasoning parser does: the whitespace around
        the markers is template formatting, not content. With no close marker the model
        was cut off while still reasoning, so there is no answer yet.
        """
        reasoning, content, _cut = split_reasoning(text, self.reasoning_close)
        return reasoning, content


def dataset_templater(name: str, tokenizer: str, kwargs: dict[str, Any] | None,
                      template_hash: str, trust_remote_code: bool) -> ChatTemplater:
    """The templater a dataset's prompts were made with, or ConfigError when the tokenizer
    found at ``tokenizer`` now renders with another template (or kwargs)."""
    found = ChatTemplater(tokenizer, kwargs, trust_remote_code)
    if found.template_hash != template_hash:
        raise ConfigError(f"dataset {name}: the tokenizer at {tokenizer} has another chat "
                          "template (or kwargs) than the one its prompts were made with")
    return found
