"""Which stored samples are kept as answers: the one definition behind the ``kept`` budget
basis (what a worker charges) and the SpecForge export (what it leaves out).

A sample is *not kept* when it holds no complete answer a trainer can use:

  cut_at_budget        the ``exact`` policy cut it to fill the budget (finish "budget");
  cut_while_reasoning  the sample's prompt opened a reasoning block and the output never
                       closed it (typically finish "length"): no answer at all.

Whether a prompt opened one is the template's doing, with the arguments that sample was
rendered with: a drawn ``thinking=false`` may render a prompt that opens none where the
dataset's other draws do (``sample_closer``).

Failed and aborted samples are never stored, so they are never kept either. The checks
are on the output text as stored, the text the exports read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from common.draws import draw_key
from common.errors import ConfigError

if TYPE_CHECKING:
    from common.store import DatasetRow

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


def sample_closer(ds: DatasetRow, drawn: Mapping[str, Any] | None) -> str | None:
    """The marker closing the reasoning block of a sample of ``ds`` whose prompt was rendered
    with the template arguments ``drawn`` for it (common/draws.py): the opener the producer
    recorded for that draw, else the dataset's (a sample without a draw, or a dataset
    enqueued before openers were recorded per draw)."""
    opener = ds.reasoning_open
    if drawn and ds.reasoning_opens is not None:
        opener = ds.reasoning_opens.get(draw_key(drawn), opener)
    return reasoning_closer(opener)


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
