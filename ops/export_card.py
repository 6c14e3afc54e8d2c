"""The dataset card ``datagen export`` writes beside its files: ``README.md``.

Its YAML front matter is what the Hugging Face Hub and ``datasets.load_dataset`` read: one
config per dataset naming its file (so the manifest is never taken for data), and a
default one: the only dataset's, or ``all`` of them when every file has the same columns
(files whose rows differ in their columns, a ``tools`` key in one dataset's only, cannot be
read as one table). The license is left for the publisher to choose. The body tells what
the data is and how it was made, per dataset, from SQL: the prompts in each state, the
results kept and how they finished, the model, template, tokenizer, sampling, budget and
close, and what the export left out and why.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from common.errors import ConfigError
from common.failures import STOPPED
from common.schema import results
from common.store import DatasetRow, Store
from ops.export_io import MANIFEST
from ops.export_record import REASONS
from ops.progress import prompt_counts

if TYPE_CHECKING:
    from ops.export import DatasetExport

CARD = "README.md"
# The card's first comment: a README.md without it is the user's, never overwritten.
MARK = "# datagen export writes this card anew at each export"
COMBINED = "all"
SIZES = ((1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"),
         (1_000_000, "100K<n<1M"), (10_000_000, "1M<n<10M"), (100_000_000, "10M<n<100M"))
# Why a closed dataset's queued prompts were never generated, by its close reason.
CLOSED_BEFORE = {
    "budget": "the budget closed the dataset first",
    "manual": "the dataset was closed by hand (datagen purge) first",
    STOPPED: "repeated failures stopped the dataset first (datagen retry sends them again)",
}
BASIS_WORDS = {"output": "output tokens", "total": "prompt + output tokens",
               "kept": "output tokens of kept samples"}
FINISH = {"stop": "stopped by the model", "length": "cut at max_new_tokens",
          "budget": "cut to fill the budget", "abort": "aborted"}


@dataclass(frozen=True)
class RunFacts:
    """One dataset's run as SQL holds it: its prompts by state (now), and its results up
    to the export's bound by finish reason and model."""

    prompts: dict[str, int]
    finish: Counter[str] = field(default_factory=Counter)
    models: Counter[str] = field(default_factory=Counter)

    @property
    def prompts_total(self) -> int:
        return sum(self.prompts.values())


def run_facts(store: Store, names: Iterable[str], upto: dict[str, int]) -> dict[str, RunFacts]:
    """Per dataset, its RunFacts: one GROUP BY over prompts, one per dataset over results."""
    states = prompt_counts(store.engine)
    facts = {}
    with store.engine.connect() as conn:
        for name in names:
            q = (sa.select(results.c.finish_reason, results.c.model, sa.func.count())
                 .where(results.c.dataset == name, results.c.id <= upto[name])
                 .group_by(results.c.finish_reason, results.c.model))
            fact = RunFacts(states.get(name, {}))
            for reason, model, n in conn.execute(q):
                fact.finish[reason] += int(n)
                fact.models[model] += int(n)
            facts[name] = fact
    return facts


def _q(value: str) -> str:
    """A YAML scalar: JSON's string syntax is YAML's double-quoted one."""
    return json.dumps(value, ensure_ascii=False)


def size_category(rows: int) -> str:
    return next((label for bound, label in SIZES if rows < bound), "n>100M")


@dataclass(frozen=True)
class Config:
    """One config of the front matter: a name and the files of its one split."""

    name: str
    files: tuple[str, ...]
    default: bool = False


def configs(stats: list[DatasetExport]) -> list[Config]:
    """One config per dataset with rows, and which is the default, if one can be."""
    filled = [s for s in stats if s.exported]
    found = [Config(s.name, (s.file,), default=len(filled) == 1) for s in filled]
    if len(filled) > 1 and COMBINED not in {s.name for s in stats} \
            and len({frozenset(s.columns) for s in filled}) == 1:
        found.insert(0, Config(COMBINED, tuple(s.file for s in filled), default=True))
    return found


def front_matter(stats: list[DatasetExport]) -> list[str]:
    found = configs(stats)
    lines = ["---", MARK,
             "# license: the publisher's choice; the model's license and the prompts' terms",
             "# apply (https://huggingface.co/docs/hub/repositories-licenses)",
             "task_categories:", "- text-generation",
             "tags:", "- synthetic", "- speculative-decoding", "- datagen",
             "size_categories:", f"- {size_category(sum(s.exported for s in stats))}",
             "configs:" if found else "configs: []"]
    for config in found:
        lines.append(f"- config_name: {_q(config.name)}")
        if config.default:
            lines.append("  default: true")
        lines += ["  data_files:", "  - split: train", "    path:"]
        lines += [f"    - {_q(p)}" for p in config.files]
    return [*lines, "---"]


def _sampling(sampling: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(sampling.items())) or "the server's defaults"


def _budget(ds: DatasetRow) -> str:
    basis = BASIS_WORDS[ds.budget.basis]
    return (f"{ds.budget.tokens:,} {basis} (basis `{ds.budget.basis}`), policy "
            f"`{ds.budget.policy}`")


def _state(ds: DatasetRow) -> str:
    if ds.state != "closed":
        return ds.state
    at = ds.closed_at.isoformat(timespec="seconds") if ds.closed_at else "an unknown time"
    used = f", {ds.used_at_close:,} tokens used at the close" if ds.used_at_close else ""
    return f"closed ({ds.close_reason or 'no reason recorded'}) at {at}{used}"


def _finish(finish: Counter[str]) -> str:
    return ", ".join(f"{n:,} {r}" + (f" ({FINISH[r]})" if r in FINISH else "")
                     for r, n in sorted(finish.items())) or "none"


def count_row(s: DatasetExport, fact: RunFacts) -> list[int]:
    """The counts table's figures for one dataset, in CARD_COUNTS' order."""
    p = fact.prompts
    return [s.exported, fact.prompts_total, s.results, p.get("failed", 0), p.get("skipped", 0),
            p.get("queued", 0), fact.finish["length"], fact.finish["budget"],
            sum(s.left_out.values())]


CARD_COUNTS = ("rows exported", "prompts", "kept", "failed", "skipped", "not generated",
               "cut at max_new_tokens", "cut at budget", "left out of the export")


def _table(header: Iterable[str], rows: Iterable[Iterable[object]]) -> list[str]:
    head = list(header)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(str(v) for v in row) + " |" for row in rows]


def counts_section(stats: list[DatasetExport], facts: dict[str, RunFacts]) -> list[str]:
    rows = [[f"`{s.name}`", *(f"{n:,}" for n in count_row(s, facts[s.name]))] for s in stats]
    return ["## Counts", "",
            "From SQL when the export ran. *kept*: results stored (up to the newest one "
            "when the dataset's export began); *not generated*: prompts still queued, never "
            "answered; *cut at budget*: the sample that crossed the budget, cut to fill it.",
            "", *_table(("dataset", *CARD_COUNTS), rows), ""]


def dataset_section(ds: DatasetRow, s: DatasetExport, fact: RunFacts) -> list[str]:
    models = ", ".join(f"`{m}` ({n:,})" for m, n in fact.models.most_common()) or "none yet"
    rows = [("file", f"`{s.file}`"), ("model", models), ("tokenizer", f"`{ds.tokenizer}`"),
            ("chat template hash", f"`{ds.template_hash}`"),
            ("sampling", _sampling(ds.sampling)),
            *((("drawn per sample", ds.mixtures.describe()),) if ds.mixtures else ()),
            *((("generations per prompt", str(ds.generations)),) if ds.generations > 1 else ()),
            ("max_seq_len", f"{ds.max_seq_len:,}"),
            ("budget", _budget(ds)), ("state", _state(ds)),
            ("finish reasons", _finish(fact.finish))]
    return [f"### {ds.name}", "", *_table(("", ""), rows), ""]


def _why_queued(ds: DatasetRow) -> str:
    if ds.state != "closed":
        return "the run had not reached them"
    return CLOSED_BEFORE.get(ds.close_reason or "", "the dataset was closed first")


def left_out_lines(ds: DatasetRow, s: DatasetExport, fact: RunFacts) -> list[str]:
    p, why = fact.prompts, []
    if p.get("queued"):
        why.append(f"{p['queued']:,} prompts not generated: {_why_queued(ds)}")
    if p.get("failed"):
        why.append(f"{p['failed']:,} prompts failed (each one's last error is in SQL, "
                   "`prompts.error`)")
    if p.get("skipped"):
        why.append(f"{p['skipped']:,} prompts skipped: the prompt left no room to generate "
                   f"within max_seq_len {ds.max_seq_len:,}")
    why += [f"{n:,} results left out of the file, {reason}: {REASONS[reason]}"
            for reason, n in sorted(s.left_out.items())]
    return [f"- `{ds.name}`: " + "; ".join(why or ["nothing"])]


def _ids_line(shared_lines: int) -> list[str]:
    """What the ids are, when some name their dataset (ops/export_ids.py)."""
    if not shared_lines:
        return []
    return [f"Ids are unique across the files: the {shared_lines:,} lines that more than one "
            "dataset holds (datasets made from one file) have their rows' ids written "
            "`<dataset>/<id>`; every other id is the sample id.", ""]


def card_text(fmt: str, created_at: str, datasets: list[DatasetRow],
              stats: list[DatasetExport], facts: dict[str, RunFacts],
              shared_lines: int = 0) -> str:
    by_name = {ds.name: ds for ds in datasets}
    default = next((c.name for c in configs(stats) if c.default), None)
    loading = (f'load_dataset("path/to/this/folder")  # the {default!r} config' if default
               else "# a config must be named: the files' columns differ")
    first = next((s.name for s in stats if s.exported), "NAME")
    lines = [*front_matter(stats), "", "# Generated responses", "",
             f"A model's responses to prompts, made with datagen and exported as `{fmt}` on "
             f"{created_at}: {sum(s.exported for s in stats):,} rows in {len(stats)} "
             f"datasets, one file each. `{MANIFEST}` (JSON) is the export's own record "
             "(`datagen validate` checks the files against SQL with it).", "",
             *_ids_line(shared_lines), "```python", "from datasets import load_dataset", "",
             loading, f'load_dataset("path/to/this/folder", "{first}")  # one dataset',
             "```", "", *counts_section(stats, facts), "## How each dataset was made", ""]
    for s in stats:
        lines += dataset_section(by_name[s.name], s, facts[s.name])
    lines += ["## What was left out, and why", ""]
    for s in stats:
        lines += left_out_lines(by_name[s.name], s, facts[s.name])
    lines += ["", "Results stored after a dataset's export began are not in its file "
              f"(`upto_result_id` in `{MANIFEST}`)."]
    return "\n".join(lines) + "\n"


def check_card_free(out: Path) -> None:
    """ConfigError if ``out`` holds a README.md that an export did not write."""
    path = out / CARD
    try:
        head = path.read_text(encoding="utf-8", errors="replace")[:200]
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(f"--out {out}: cannot read {path} ({exc.strerror or exc})") from None
    if MARK not in head:
        raise ConfigError(f"--out {out} holds a {CARD} that datagen export did not write; "
                          "export writes its dataset card there: move that file or export "
                          "to another folder")


def write_card(out: Path, store: Store, fmt: str, created_at: str,
               datasets: list[DatasetRow], stats: list[DatasetExport],
               shared_lines: int = 0) -> Path:
    facts = run_facts(store, [s.name for s in stats],
                      {s.name: s.upto_result_id for s in stats})
    path, temp = out / CARD, out / f".{CARD}.partial"
    temp.write_text(card_text(fmt, created_at, datasets, stats, facts, shared_lines),
                    encoding="utf-8")
    temp.replace(path)
    return path
