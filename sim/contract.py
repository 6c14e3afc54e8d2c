"""SGLang 0.5.23's JSON contract check of a /generate body, with its exact error texts.

SGLang runs this check in the route, before anything else, and answers a violation with
HTTP 400 and `{"error": "<serde-style text>"}` (a *string*, unlike its other 400 bodies),
even for streaming requests. Clients that classify errors by body shape rely on that.
Unknown top-level keys are ignored; unknown `sampling_params` keys are rejected.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sim.errors import SimHttpError


def _unexpected(value: Any) -> str:
    """serde's `Unexpected` display of a JSON value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{'true' if value else 'false'}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f'string "{value}"'
    return "sequence" if isinstance(value, list) else "map"


def _invalid_type(value: Any, expected: str) -> SimHttpError:
    return SimHttpError.contract(f"invalid type: {_unexpected(value)}, expected {expected}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(value: Any, expected: str = "i64") -> None:
    if not _is_int(value):
        raise _invalid_type(value, expected)


def _float(value: Any) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise _invalid_type(value, "f64")


def _bool(value: Any) -> None:
    if not isinstance(value, bool):
        raise _invalid_type(value, "a boolean")


def _str(value: Any) -> None:
    if not isinstance(value, str):
        raise _invalid_type(value, "a string")


def _seq(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise _invalid_type(value, "a sequence")
    return value


def _str_or_list(value: Any) -> None:
    if isinstance(value, list):
        for item in value:
            _str(item)
    elif not isinstance(value, str):
        raise _invalid_type(value, "a value or an array of values for StringOrList")


def _int_list(value: Any) -> None:
    for item in _seq(value):
        _int(item)


def _float_map(value: Any) -> None:
    if not isinstance(value, dict):
        raise _invalid_type(value, "a map")
    for item in value.values():
        _float(item)


def _anything(value: Any) -> None:
    del value


#: Allowed sampling keys in the contract's declared order (the order of the error text),
#: plus `watermark`, which the spec's sampling-params table also lists.
SAMPLING_FIELDS: dict[str, Callable[[Any], None]] = {
    "max_new_tokens": _int,
    "stop": _str_or_list,
    "stop_token_ids": _int_list,
    "stop_regex": _str_or_list,
    "temperature": _float,
    "top_p": _float,
    "top_k": _int,
    "min_p": _float,
    "frequency_penalty": _float,
    "presence_penalty": _float,
    "repetition_penalty": _float,
    "min_new_tokens": _int,
    "n": _int,
    "json_schema": _str,
    "regex": _str,
    "ebnf": _str,
    "structural_tag": _str,
    "ignore_eos": _bool,
    "skip_special_tokens": _bool,
    "spaces_between_special_tokens": _bool,
    "no_stop_trim": _bool,
    "stream_interval": _int,
    "logit_bias": _float_map,
    "sampling_seed": _int,
    "custom_params": _anything,
    "beam_width": _int,
    "watermark": _anything,
}


def unknown_field_message(key: str) -> str:
    """serde's `unknown field` text for a sampling key."""
    listed = ", ".join(f"`{name}`" for name in SAMPLING_FIELDS)
    return f"unknown field `{key}`, expected one of {listed}"


def _sampling_params(value: Any) -> None:
    if not isinstance(value, dict):
        raise _invalid_type(value, "struct SamplingParams")
    for key, item in value.items():
        check = SAMPLING_FIELDS.get(key)
        if check is None:
            raise SimHttpError.contract(unknown_field_message(key))
        if item is not None:
            check(item)


def _sampling_or_list(value: Any) -> None:
    if isinstance(value, list):
        for item in value:
            _sampling_params(item)
    elif isinstance(value, dict):
        _sampling_params(value)
    else:
        raise _invalid_type(value, "a value or an array of values for SamplingParamsOrList")


def _ids(value: list[Any]) -> None:
    """Every element an int; the set-of-types test runs at C speed for long prompts."""
    if set(map(type, value)) <= {int}:
        return
    for item in value:
        _int(item, "i32")


def _token_ids_or_list(value: Any) -> None:
    """A flat id list, or (first element not a number) a batch of id lists."""
    if not isinstance(value, list):
        raise _invalid_type(value, "a value or an array of values for TokenIdsOrList")
    if not value or (isinstance(value[0], int | float) and not isinstance(value[0], bool)):
        _ids(value)
        return
    for row in value:
        _ids(_seq(row))


def _bool_or_list(value: Any) -> None:
    if isinstance(value, list):
        for item in value:
            _bool(item)
    elif not isinstance(value, bool):
        raise _invalid_type(value, "a value or an array of values for BoolOrList")


_TOP_LEVEL: dict[str, Callable[[Any], None]] = {
    "rid": _str_or_list,
    "text": _str_or_list,
    "input_ids": _token_ids_or_list,
    "stream": _bool,
    "sampling_params": _sampling_or_list,
    "return_logprob": _bool_or_list,
    "return_text_in_logprobs": _bool,
}


def check_contract(body: Any) -> None:
    """Raise SimHttpError (400, string error) if body violates the /generate contract."""
    if not isinstance(body, dict):
        raise _invalid_type(body, "struct GenerateRequest")
    for key, value in body.items():
        check = _TOP_LEVEL.get(key)
        if check is not None and value is not None:
            check(value)
