"""Render conversations with the target model's own chat template and tokenize them.

The worker sends token ids, not text, to SGLang, so the ids built here *are* the prompt the
target model sees: they must equal ``apply_chat_template(..., tokenize=True,
add_generation_prompt=True)`` exactly. This sits on the producer's hot path, so the
template is compiled once and the rendered strings are tokenized in one Rust batch call.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import common
from common.errors import ConfigError

BUNDLED_TOKENIZER: Path = Path(common.__file__).parent / "assets" / "tokenizer"

Messages = Sequence[dict[str, str]]
# How long the hub may take to say whether a model id exists before it counts as away.
HUB_TIMEOUT_S = 10.0

# Reasoning openers a template may leave open at the end of the generation prompt, with
# the marker the model emits to close them.
_REASONING_MARKERS: dict[str, str] = {
    "<think>": "</think>",
    "<seed:think>": "</seed:think>",
    "◁think▷": "◁/think▷",
}
_PROBE: list[dict[str, str]] = [{"role": "user", "content": "Hello"}]
_PROBES: list[list[dict[str, str]]] = [
    _PROBE,
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ],
]


def _load_tokenizer(name: str) -> Any:
    # transformers is slow to import; only pay for it when a templater is built. datagen
    # needs only its tokenizers and chat templates, so its advice that PyTorch is missing
    # would send users to install a GPU stack for nothing.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers import AutoTokenizer

    if Path(name).is_dir():
        try:
            return AutoTokenizer.from_pretrained(name, local_files_only=True)
        except Exception as exc:
            raise ConfigError(
                f"tokenizer directory {name!r} holds no loadable tokenizer files ({exc})"
            ) from exc
    try:
        # A model id downloaded before loads from the cache, with or without a network.
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except Exception:  # not cached (or not complete): the hub decides below
        pass
    _check_hub(name)
    try:
        return AutoTokenizer.from_pretrained(name)
    except Exception as exc:
        raise ConfigError(
            f"tokenizer {name!r} not found: not a local directory and could not be loaded "
            f"as a model id ({type(exc).__name__}: {exc})"
        ) from exc


def _check_hub(name: str) -> None:
    """ConfigError at once when the hub cannot give ``name``: offline, unreachable, or no
    such model. transformers would retry each of its files for about 50 s first."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError

    where = f"tokenizer {name!r} not found: not a local directory"
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(f"{where}, not in the Hugging Face cache, and HF_HUB_OFFLINE is "
                          "set: give the tokenizer's directory")
    try:
        HfApi().model_info(name, timeout=HUB_TIMEOUT_S)
    except HFValidationError:
        raise ConfigError(f"{where} nor a model id (namespace/name)") from None
    except GatedRepoError:
        raise ConfigError(f"{where}, and model {name!r} on {constants.ENDPOINT} is gated: "
                          "accept its terms and log in (hf auth login)") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"{where}, and {constants.ENDPOINT} has no model {name!r} (or "
                          "it is private: log in with hf auth login)") from None
    except Exception as exc:  # the hub's client raises its transport's errors as they are
        raise ConfigError(f"{where}, not in the Hugging Face cache, and {constants.ENDPOINT} "
                          f"does not answer ({type(exc).__name__}: {exc}): give the "
                          "tokenizer's directory, or set HF_HUB_OFFLINE=1 to use the "
                          "cache only") from None


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


def _compiled_renderer(template: str, variables: dict[str, Any]) -> Callable[[Messages], str]:
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

    def render(messages: Messages) -> str:
        context = env.context_class(
            env, {**base, "messages": list(messages)}, compiled.name, compiled.blocks,
            globals=shared_globals,
        )
        try:
            return str(env.concat(compiled.root_render_func(context)))
        except Exception:
            env.handle_exception()
            raise

    return render


class ChatTemplater:
    """One target model's chat template and tokenizer, as the producer needs them."""

    def __init__(self, tokenizer: str, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        self.name = tokenizer
        self._kwargs: dict[str, Any] = dict(chat_template_kwargs or {})
        self._tok = _load_tokenizer(tokenizer)
        template = _chat_template(self._tok, tokenizer)
        self.template_hash = _template_hash(template, self._kwargs)
        self._render = self._pick_renderer(template)
        self._backend = self._rust_backend()
        self.reasoning_open, self.reasoning_close = self._detect_reasoning()
        self.eos_token_id: int | None = self._tok.eos_token_id
        # len() counts added tokens too, so every id the tokenizer can emit is below it.
        self.vocab_size: int = len(self._tok)

    def _public_render(self, messages: Messages) -> str:
        try:
            text = self._tok.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=True, **self._kwargs
            )
        except Exception as exc:
            raise ConfigError(f"chat template of {self.name} failed to render: {exc}") from exc
        return str(text)

    def _pick_renderer(self, template: str) -> Callable[[Messages], str]:
        variables = {
            "tools": None,
            "documents": None,
            "add_generation_prompt": True,
            **self._tok.special_tokens_map,
            **self._kwargs,
        }
        expected = [self._public_render(probe) for probe in _PROBES]
        try:
            fast = _compiled_renderer(template, variables)
            agrees = [fast(probe) for probe in _PROBES] == expected
        except Exception:
            agrees = False  # private helper gone or different: the public path still works
        return fast if agrees else self._public_render

    def _rust_backend(self) -> Any:
        backend = getattr(self._tok, "_tokenizer", None)
        if backend is None or not hasattr(backend, "encode_batch"):
            return None
        return backend

    def _detect_reasoning(self) -> tuple[str | None, str | None]:
        tail = self._public_render(_PROBE).rstrip()
        for opener, closer in _REASONING_MARKERS.items():
            if tail.endswith(opener):
                return opener, closer
        return None, None

    def render(self, messages: Messages) -> str:
        """The prompt text the target model sees for one conversation."""
        return self._render(messages)

    def encode_batch(self, conversations: Sequence[Messages]) -> list[list[int]]:
        """Token ids of each conversation's prompt, generation prompt included."""
        if not conversations:
            return []
        return self.tokenize([self._render(messages) for messages in conversations])

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

    def split_reasoning(self, text: str) -> tuple[str, str]:
        """(reasoning_content, content) of a completion generated after the prompt.

        Both parts are stripped, as SGLang's reasoning parser does: the whitespace around
        the markers is template formatting, not content. With no close marker the model
        was cut off while still reasoning, so there is no answer yet.
        """
        if self.reasoning_close is None:
            return "", text
        reasoning, found, content = text.partition(self.reasoning_close)
        if not found:
            return text.strip(), ""
        return reasoning.strip(), content.strip()
