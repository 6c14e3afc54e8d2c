"""Validation of a /generate body, in SGLang's order and with SGLang's messages.

Order (as in 0.5.23): JSON contract (route) → input presence (GenerateReqInput) →
empty ids and context-length checks (tokenizer manager) → `SamplingParams.verify()`.
Duplicate rids and the scheduler's input-length limit are checked later by the engine.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from typing import Any

from sim.config import SimConfig
from sim.contract import check_contract
from sim.errors import SimHttpError

DEFAULT_MAX_NEW_TOKENS = 128
BATCH_REFUSAL = "batch requests are not supported by the simulator"
TEXT_REFUSAL = "the simulator accepts input_ids only"
MISSING_INPUT = "Either text, input_ids or input_embeds should be provided."
EMPTY_INPUT = "input_ids cannot be empty."


@dataclass
class GenerateInput:
    """A validated single /generate request."""

    rid: str
    input_ids: list[int]
    #: Effective cap after SGLang's scheduler clamp (ctx - prompt - 1).
    max_new_tokens: int
    stream: bool
    ignore_eos: bool
    #: Chunk cadence of a stream (``sampling_params.stream_interval``; the server's 1).
    stream_interval: int = 1


def _refuse_unsupported(body: dict[str, Any]) -> None:
    """Batch forms and text prompts are outside what the simulator models."""
    ids = body.get("input_ids")
    sampling = body.get("sampling_params")
    if (
        (isinstance(ids, list) and ids and isinstance(ids[0], list))
        or isinstance(body.get("rid"), list)
        or isinstance(sampling, list)
        or (isinstance(sampling, dict) and (sampling.get("n") or 1) > 1)
    ):
        raise SimHttpError.refusal(BATCH_REFUSAL)
    if ids is None and (body.get("text") is not None or body.get("input_embeds") is not None):
        raise SimHttpError.refusal(TEXT_REFUSAL)


def _check_lengths(prompt_len: int, max_new: int | None, context: int) -> None:
    """The tokenizer manager's context-length checks."""
    if prompt_len >= context:
        raise SimHttpError.request(
            f"The input ({prompt_len} tokens) is longer than the model's "
            f"context length ({context} tokens)."
        )
    if max_new is not None and prompt_len + max_new > context:
        raise SimHttpError.request(
            f"Requested token count exceeds the model's maximum context length of {context} "
            f"tokens. You requested a total of {prompt_len + max_new} tokens: {prompt_len} "
            f"tokens from the input messages and {max_new} tokens for the completion. Please "
            "reduce the number of tokens in the input messages or the completion to fit within "
            "the limit."
        )


def _num(params: dict[str, Any], key: str, default: float) -> float:
    value = params.get(key)
    return default if value is None else float(value)


def _verify_sampling(params: dict[str, Any]) -> None:
    """`SamplingParams.verify()` of 0.5.23: same checks, same order, same texts."""
    temperature = _num(params, "temperature", 1.0)
    top_p = _num(params, "top_p", 1.0)
    min_p = _num(params, "min_p", 0.0)
    top_k = params.get("top_k")
    if not math.isfinite(temperature) or temperature < 0.0:
        raise SimHttpError.request(
            f"temperature must be a non-negative finite number, got {temperature}."
        )
    if not 0.0 < top_p <= 1.0:
        raise SimHttpError.request(f"top_p must be in (0, 1], got {top_p}.")
    if not 0.0 <= min_p <= 1.0:
        raise SimHttpError.request(f"min_p must be in [0, 1], got {min_p}.")
    greedy = temperature < 1e-6  # SGLang then forces top_k = 1
    if top_k is not None and top_k != -1 and top_k < 1 and not greedy:
        raise SimHttpError.request(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    _verify_penalties(params)


def _verify_penalties(params: dict[str, Any]) -> None:
    for key in ("frequency_penalty", "presence_penalty"):
        value = _num(params, key, 0.0)
        if not -2.0 <= value <= 2.0:
            raise SimHttpError.request(f"{key} must be in [-2, 2], got {value}.")
    repetition = _num(params, "repetition_penalty", 1.0)
    if not 0.0 < repetition <= 2.0:
        raise SimHttpError.request(
            f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {repetition}."
        )
    min_new = int(params.get("min_new_tokens") or 0)
    if min_new < 0:
        raise SimHttpError.request(f"min_new_tokens must be in [0, max_new_tokens], got {min_new}.")
    max_new = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if max_new is not None and max_new < 0:
        raise SimHttpError.request(f"max_new_tokens must be at least 0, got {max_new}.")
    if max_new is not None and min_new > max_new:
        raise SimHttpError.request(
            f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {min_new}."
        )


def parse_generate(body: Any, cfg: SimConfig) -> GenerateInput:
    """Validate a parsed JSON body; raise SimHttpError with SGLang's answer on failure."""
    check_contract(body)
    _refuse_unsupported(body)
    ids = body.get("input_ids")
    if ids is None:
        raise SimHttpError.request(MISSING_INPUT)
    if not ids:
        raise SimHttpError.request(EMPTY_INPUT)
    params: dict[str, Any] = body.get("sampling_params") or {}
    sent_max = params.get("max_new_tokens")
    _check_lengths(len(ids), sent_max, cfg.context_length)
    _verify_sampling(params)
    room = cfg.context_length - len(ids) - 1
    requested = DEFAULT_MAX_NEW_TOKENS if "max_new_tokens" not in params else sent_max
    max_new = room if requested is None else min(requested, room)
    return GenerateInput(
        rid=body.get("rid") or uuid.uuid4().hex,
        input_ids=ids,
        max_new_tokens=max(0, max_new),
        stream=bool(body.get("stream")),
        ignore_eos=bool(params.get("ignore_eos")),
        stream_interval=max(1, int(params.get("stream_interval") or 1)),
    )
