"""Which stored samples are kept as answers: the one definition behind the ``kept`` budget
basis (what a worker charges) and the SpecForge export (what it leaves out).

A sample is *not kept* when it holds no complete answer a trainer can use:

  cut_at_budget        the ``exact`` policy cut it to fill the budget (finish "budget");
  cut_while_reasoning  the dataset's template opened a reasoning block and the output
                       never closed it (typically finish "length"): no answer at all.

Failed and aborted samples are never stored, so they are never kept either. The checks
are on the output text as stored, the text the exports read.
"""

from __future__ import annotations

from common.errors import ConfigError

# Reasoning openers a template may leave open at the end of the generation prompt, with
# the marker the model emits to close them.
REASONING_MARKERS: dict[str, str] = {
    "<think>": "</think>",
    "<seed:think>": "</seed:think>",
    "◁think▷": "◁/think▷",
}
BUDGET_FINISH = "budget"  # finish_reason of the exact policy's cut sample


def reasoning_closer(opener: str | None) -> str | None:
    """The marker closing a reasoning block opened by ``opener``; None when none opened."""
    if opener is None:
        return None
    closer = REASONING_MARKERS.get(opener)
    if closer is None:
        raise ConfigError(f"reasoning opener {opener!r} has no known closer")
    return closer


def split_reasoning(text: str, closer: str | None) -> tuple[str, str, bool]:
    """(reasoning, answer, cut): both parts stripped, as SGLang's reasoning parser does;
    ``cut`` when a reasoning block was opened and the text never closes it."""
    if closer is None:
        return "", text, False
    reasoning, found, answer = text.partition(closer)
    if not found:
        return text.strip(), "", True
    return reasoning.strip(), answer.strip(), False


def left_out(finish_reason: str, text: str, closer: str | None) -> str | None:
    """Why a sample is not kept (a key of the exports' reasons), None when it is."""
    if finish_reason == BUDGET_FINISH:
        return "cut_at_budget"
    if closer is not None and closer not in text:
        return "cut_while_reasoning"
    return None


def is_kept(finish_reason: str, text: str, closer: str | None) -> bool:
    return left_out(finish_reason, text, closer) is None
