"""The message pop's Redis cost: µs of Redis CPU per message taken, by queues consumed.

A worker takes its messages with one script call (``POP_RECORDED``) over the lists of
every queue it consumes, and it consumes every known dataset's queue, finished ones
included. Here one queue of many holds messages and the others are empty, as in a long
run where most datasets are done; the script is called until the queue is empty with a
batch room of 16 (a worker at full rate), 4, and 1 (a freed slot at a real server's
pace). Redis's own count (``INFO commandstats``, usec of EVALSHA) over the messages taken;
that count is the whole server's, so nothing else should run scripts on it meanwhile.

    python -m ops.bench.pop [--quick] [--baseline DIR]

``--baseline DIR`` runs, interleaved with the current script, the one in another
checkout's ``common/ledger_scripts.py`` (e.g. ``git archive HEAD | tar -x -C DIR``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from typing import Any

import redis

from common.ledger_scripts import POP_RECORDED
from ops.bench.harness import fresh_redis
from ops.bench.report import Summary, emit, table

ROOMS = (16, 4, 1)
QUEUES = (1, 11, 50, 200)
BODY = "x" * 300


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ops.bench.pop", description=__doc__)
    p.add_argument("--quick", action="store_true", help="500 messages a case, 1 rep")
    p.add_argument("--messages", type=int, help="messages a case (default 4000)")
    p.add_argument("--reps", type=int, help="default 5")
    p.add_argument("--baseline", type=Path, help="a checkout whose pop script to compare with")
    args = p.parse_args(argv)
    args.messages = args.messages or (500 if args.quick else 4000)
    args.reps = args.reps or (1 if args.quick else 5)
    return args


def baseline_script(tree: Path) -> str:
    path = tree / "common" / "ledger_scripts.py"
    spec = importlib.util.spec_from_file_location("baseline_ledger_scripts", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"no ledger_scripts.py under {tree}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.POP_RECORDED)


def usec_per_message(client: redis.Redis, script: Any, queues: int, room: int,
                     messages: int) -> float:
    client.flushdb()
    # In the middle of the key list: kombu's cycle moves a busy queue around.
    busy = f"q{queues // 2}"
    payloads = [json.dumps({"body": BODY, "properties": {
        "delivery_tag": f"t{i}", "delivery_info": {"exchange": "", "routing_key": busy}}})
        for i in range(messages)]
    for i in range(0, messages, 1000):
        client.lpush(busy, *payloads[i:i + 1000])
    keys = ["unacked-index", "unacked", "unreadable", *(f"q{q}" for q in range(queues))]
    client.config_resetstat()
    taken = 0
    while taken < messages:
        popped, _ = script(keys=keys, args=[1.0, room])
        if not popped:
            raise RuntimeError(f"the pop took nothing with {messages - taken} queued")
        taken += len(popped) // 2
    usec = client.info("commandstats")["cmdstat_evalsha"]["usec"]
    return float(usec) / messages


def run(args: argparse.Namespace) -> dict[str, Any]:
    client = fresh_redis()
    scripts = {"current": client.register_script(POP_RECORDED)}
    if args.baseline:
        scripts["baseline"] = client.register_script(baseline_script(args.baseline))
    found: dict[str, list[float]] = {}
    for room in ROOMS:
        for queues in QUEUES:
            for _ in range(args.reps):
                for name, script in scripts.items():  # interleaved, rep by rep
                    found.setdefault(f"{name}, room {room}, {queues} queues", []).append(
                        usec_per_message(client, script, queues, room, args.messages))
    client.flushdb()
    us = {k: Summary.of(v) for k, v in found.items()}
    rows = []
    for room in ROOMS:
        for queues in QUEUES:
            cur = us[f"current, room {room}, {queues} queues"]
            row: list[Any] = [room, queues, cur.fmt(1)]
            if args.baseline:
                base = us[f"baseline, room {room}, {queues} queues"]
                row += [base.fmt(1), f"{cur.median / base.median:.3f}"]
            rows.append(row)
    header = ["batch room", "queues consumed", "current µs/message"]
    if args.baseline:
        header += ["baseline µs/message", "current / baseline"]
    table(f"the pop's Redis CPU per message, one busy queue among the others, "
          f"{args.messages} messages, {args.reps} reps (median [min-max])", header, rows)
    return {"messages": args.messages, "reps": args.reps, "usec_per_message": us}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    emit("pop", args, run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
