"""The ``datagen`` command: one entry point, each subcommand in its own module."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from common.budget import BASES
from common.errors import (
    ConfigError,
    DatagenError,
    InputError,
    ServiceUnavailable,
    UnknownDatasetError,
)
from common.sampling_rules import add_sampling_flags
from common.settings import Settings
from ops.argtypes import Parser, add_quiet_flag, whole, whole_or_auto


def _add_enqueue(sub: argparse._SubParsersAction) -> None:
    from common.order import MAX_SEED, ORDERS
    from producer.generations import MAX_GENERATIONS
    from producer.plan import DEFAULT_SAMPLING

    p = sub.add_parser("enqueue", help="template, store and enqueue prompt files")
    p.add_argument("paths", nargs="*", help="JSONL files or folders of *.jsonl")
    p.add_argument("--manifest", help="TOML file: per dataset its files, budget, policy, ... "
                   "(default: none; the datasets are the PATHs' files)")
    p.add_argument("--tokenizer", help="tokenizer directory or model id (default: "
                   "DATAGEN_TOKENIZER, else the bundled test tokenizer)")
    p.add_argument("--trust-remote-code", action="store_true", default=None,
                   help="load a tokenizer whose class is Python code in its folder, which "
                        "runs that code (default: DATAGEN_TRUST_REMOTE_CODE, off)")
    p.add_argument("--max-seq-len", type=whole(2), default=32768,
                   help="prompt + output limit in tokens (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=whole(1), default=16384,
                   help="output cap of one request, in tokens (default: %(default)s)")
    add_sampling_flags(p, defaults=DEFAULT_SAMPLING)
    p.add_argument("--chat-template-kwargs", default="{}",
                   help='JSON object for the chat template, e.g. {"thinking": true} '
                   "(default: %(default)s)")
    p.add_argument("--budget-tokens", default=None, help="tokens per dataset, counted on "
                   "--budget-basis, e.g. 10000000, 10M or 500k (default: "
                   "DATAGEN_DEFAULT_BUDGET_TOKENS, 10M)")
    p.add_argument("--budget-basis", choices=BASES, default="output",
                   help="output: completion tokens count; total: prompt + completion; "
                   "kept: completion tokens of the samples the exports keep (not those "
                   "cut while reasoning or cut to the budget) (default: %(default)s)")
    p.add_argument("--policy", choices=("drain", "abort", "exact"), default="drain",
                   help="requests in flight when a dataset closes: drain keeps them, abort "
                   "drops them, exact cuts to the budget (default: %(default)s)")
    p.add_argument("--turns", choices=("last", "all"), default=None,
                   help="all: regenerate every assistant turn in order, each after the "
                   "model's own earlier answers; last: regenerate each conversation's last "
                   "answer after the line's earlier ones (default: the dataset's stored "
                   "mode, else all)")
    p.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="SGLang's --tool-call-parser name (kimi_k2, qwen25, deepseekv3, glm, "
                   "...): with --turns all, a turn whose original called tools is parsed by "
                   "the server with it, and the line's tool results follow the model's own "
                   "calls when they match (default: the dataset's stored one, else none)")
    add_quiet_flag(p)
    p.add_argument("--order", choices=ORDERS, default=None,
                   help="publishing order of each dataset's prompts: shuffle (seeded random, "
                   "so a budget keeps a uniform random subset) or file (the head of the file "
                   "first) (default: the dataset's stored order, else shuffle)")
    p.add_argument("--seed", type=whole(0, MAX_SEED), default=None,
                   help="seed of the shuffle and of the mixtures' draws (default: the "
                   "dataset's stored seed, else DATAGEN_DEFAULT_SEED, 0)")
    p.add_argument("--mix", action="append", metavar="KEY=VALUE:WEIGHT,...",
                   help="draw KEY per sample from weighted choices, e.g. "
                   "temperature=0.6:1,0.8:1,1.0:1 or reasoning_effort=low:4,medium:4,high:2; "
                   "KEY is a sampling parameter or else a chat template argument; repeatable "
                   "(default: the dataset's stored mixes, else none)")
    p.add_argument("--generations", type=whole(1, MAX_GENERATIONS), default=None,
                   help="independent samples of each prompt, ids <id>_gen0, <id>_gen1, ... "
                   "when more than 1 (default: the dataset's stored number, else 1)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="datagen",
        description="Regenerate a model's responses per dataset under exact token budgets.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_enqueue(sub)
    w = sub.add_parser("worker", help="run a Celery worker (threads pool)")
    w.add_argument("--concurrency", "-c", type=whole_or_auto(1),
                   help="requests in flight, or auto: sized by the servers' loads "
                   "(default: DATAGEN_CONCURRENCY, auto)")
    w.add_argument("--loglevel", default="INFO", type=str.upper,
                   choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
                   help="(default: %(default)s)")
    w.add_argument("--hostname", "-n", help="worker name (default datagen@<host>)")
    sub.add_parser("sim", help="run the SGLang-compatible simulator (datagen sim --help)")
    sub.add_parser("healthcheck", help="exit 0 when healthy: worker | sglang [--wait S] | http URL")
    st = sub.add_parser("status", help="per-dataset progress from Redis and SQL")
    st.add_argument("--json", action="store_true")
    st.add_argument("--watch", action="store_true", help="redraw every 2 s until Ctrl-C")
    pu = sub.add_parser("purge", help="close a dataset now: purge its queue, revoke, abort")
    pu.add_argument("name")
    ro = sub.add_parser("reopen", help="raise a closed dataset's budget and enqueue the rest")
    ro.add_argument("name")
    ro.add_argument("--budget-tokens", required=True)
    from ops.export import add_export_parser
    from ops.plan import add_plan_parser
    from ops.report import add_report_parser
    from ops.retry import add_retry_parser
    from ops.validate import add_validate_parser

    add_export_parser(sub)
    add_validate_parser(sub)
    add_plan_parser(sub)
    add_retry_parser(sub)
    add_report_parser(sub)
    d = sub.add_parser("demo", help="the whole job on embedded defaults: simulator, SQLite")
    d.add_argument("--workers", type=whole(1), default=1, help="(default: %(default)s)")
    d.add_argument("--concurrency", type=whole(1), default=32, help="(default: %(default)s)")
    return parser


def dispatch(args: argparse.Namespace, settings: Settings) -> int:
    if args.command == "enqueue":
        from producer.command import run_enqueue

        return run_enqueue(args, settings)
    if args.command == "worker":
        from workers.command import run_worker

        return run_worker(args, settings)
    if args.command == "status":
        from ops.status import run_status

        return run_status(args, settings)
    if args.command == "plan":
        from ops.plan import run_plan

        return run_plan(args, settings)
    if args.command == "export":
        from ops.export import run_export

        return run_export(args, settings)
    if args.command == "validate":
        from ops.validate import run_validate

        return run_validate(args, settings)
    if args.command == "report":
        from ops.report import run_report

        return run_report(args, settings)
    if args.command == "retry":
        from ops.retry import run_retry

        return run_retry(args, settings)
    if args.command in ("purge", "reopen"):
        from ops import admin

        return admin.run_purge(args, settings) if args.command == "purge" else \
            admin.run_reopen(args, settings)
    from ops.demo import run_demo

    return run_demo(args, settings)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sim"]:
        # These own their flags; argparse's REMAINDER would reject a leading --flag.
        from sim import main as sim_main

        return sim_main(argv[1:])
    if argv[:1] == ["healthcheck"]:
        from ops.healthcheck import main as healthcheck_main

        return healthcheck_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return dispatch(args, Settings.from_env())
    except UnknownDatasetError as exc:
        print(f"datagen {args.command}: {exc}", file=sys.stderr)
        return 2
    except (ConfigError, InputError) as exc:
        print(f"datagen {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ServiceUnavailable as exc:
        print(f"datagen {args.command}: {exc}", file=sys.stderr)
        return 3
    except DatagenError as exc:
        print(f"datagen {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
