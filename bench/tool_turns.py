"""The producer's rate and worker CPU per turn on tool-calling conversations against
plain ones.

Both sets are 10-turn conversations on the remote-code test tokenizer (the one whose
format the simulator's tool calls and ``/parse_function_call`` speak, a tokenizer class
that is Python code), first enqueued alone (lines/s of ``datagen enqueue``, ``--turns
last`` and ``--turns all``, the tokenizer loaded beforehand), then run through one
worker process against the simulator:

* plain: user and assistant turns alternating;
* tools: one user message whose ``<<call search>>`` directives make the model call
  ``search`` in each of 9 rounds, as the line does; every turn after the first follows a
  tool result, and 9 of the 10 are parsed by the server (one HTTP call each) before the
  next is built, the line's tool result spliced after the model's own call.

    python -m bench.tool_turns [--quick] [--dbs sqlite,postgresql]
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from bench.harness import WORKDIR, bench_settings, fresh_db, fresh_redis
from bench.turns import TURNS, WorkerLeg, enqueue_turns, pct, turn_args, worker_leg
from ops.build_remote_tokenizer import write as write_tokenizer

SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}}}}


def _plain(i: int) -> dict[str, object]:
    messages: list[dict[str, object]] = []
    for t in range(TURNS):
        messages += [{"role": "user", "content": f"Question {t} of chat {i}, in short?"},
                     {"role": "assistant", "content": f"Answer {t}."}]
    return {"id": f"plain-{i:04d}", "messages": messages}


def _agent(i: int) -> dict[str, object]:
    rounds = TURNS - 1
    messages: list[dict[str, object]] = [
        {"role": "user", "content": f"Task {i}. " + "<<call search>>" * rounds}]
    for t in range(rounds):
        call_id = f"c{i}_{t}"
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": call_id, "type": "function",
                "function": {"name": "search", "arguments": json.dumps({"query": f"q{t}"})}}]},
            {"role": "tool", "tool_call_id": call_id, "name": "search",
             "content": f"result {t} of task {i}"}]
    messages.append({"role": "assistant", "content": "Done."})
    return {"id": f"agent-{i:04d}", "tools": [SEARCH], "messages": messages}


def _write(folder: Path, name: str, lines: list[dict[str, object]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


def _line(kind: str, name: str, leg: WorkerLeg) -> str:
    return (f"[{kind}] {name}: {leg.cpu_ms:.2f} ms worker CPU per request "
            f"({leg.requests} requests), turn i stored -> i+1 at the server p50 "
            f"{1000 * statistics.median(leg.gaps):.1f} ms, p99 "
            f"{1000 * pct(leg.gaps, 0.99):.1f} ms")


def producer_rate(kind: str, path: Path, turns: str, tokenizer: Path,
                  parser: str | None) -> float:
    """Lines/s of one file enqueued alone on the remote-code tokenizer."""
    fresh_redis()
    settings = bench_settings(fresh_db(kind, "tool_producer"), "http://127.0.0.1:1")
    settings = settings.replace(tokenizer=str(tokenizer), trust_remote_code=True)
    return enqueue_turns(settings, path, turns, parser=parser)


def main(argv: list[str] | None = None) -> int:
    args = turn_args("python -m bench.tool_turns", __doc__, argv)
    tokenizer = WORKDIR / "tmp" / "remote_tokenizer"
    write_tokenizer(tokenizer)
    conversations = 12 if args.quick else 48
    lines = 2000 if args.quick else 10000
    folder = WORKDIR / "tmp" / "tool_turns"
    plain = _write(folder, "plain", [_plain(i) for i in range(conversations)])
    agents = _write(folder, "agents", [_agent(i) for i in range(conversations)])
    many_plain = _write(folder, "many_plain", [_plain(i) for i in range(lines)])
    many_agents = _write(folder, "many_agents", [_agent(i) for i in range(lines)])
    for kind in args.dbs.split(","):
        for turns in ("last", "all"):
            chats = producer_rate(kind, many_plain, turns, tokenizer, None)
            tooled = producer_rate(kind, many_agents, turns, tokenizer, "datagen")
            print(f"[{kind}] producer, {lines:,} lines of {TURNS}-turn conversations on the "
                  f"remote-code tokenizer, --turns {turns}: plain chats {chats:,.0f} lines/s, "
                  f"tool-using agents {tooled:,.0f} lines/s")
        flat = worker_leg(kind, "plain", plain, "all", 64, code_tokenizer=tokenizer)
        tools = worker_leg(kind, "agents", agents, "all", 64, code_tokenizer=tokenizer,
                           parser="datagen")
        print(_line(kind, f"plain turns of {TURNS}-turn chats", flat))
        print(_line(kind, f"tool turns of {TURNS}-turn agents", tools))
        print(f"[{kind}] ratio tool/plain worker CPU per request "
              f"{tools.cpu_ms / flat.cpu_ms:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
