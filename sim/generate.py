"""`POST|PUT /generate`: faults → validation → engine → JSON or SSE answer.

Every request that reaches this handler leaves exactly one request-log record, written in
a `finally` so that client disconnects (aiohttp cancels the handler) are recorded too and
always free their slot.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from aiohttp import web

from sim.config import NONSTREAM_STEP_S, STREAM_CHUNK_S
from sim.engine import SchedulerReject, Sequence
from sim.errors import SimHttpError, fault_body
from sim.faults import DISCONNECT, ERROR
from sim.reqlog import RequestRecord
from sim.responses import (
    SSE_DONE,
    build_output,
    drop_connection,
    json_response,
    rejection_output,
    sse_event,
    sse_single,
    start_sse,
)
from sim.state import SIM_KEY, SimState
from sim.validation import GenerateInput, parse_generate

log = logging.getLogger(__name__)


def _parse_body(raw: bytes) -> tuple[Any, str | None]:
    """JSON body, or the parse error text."""
    try:
        return json.loads(raw), None
    except (ValueError, UnicodeDecodeError) as exc:
        return None, f"JSON decode error: {exc}"


async def handle_generate(request: web.Request) -> web.StreamResponse:
    """Entry point of /generate; see the module docstring."""
    sim = request.app[SIM_KEY]
    arrived = time.time()
    raw = await request.read()
    body, parse_error = _parse_body(raw)
    record = RequestRecord.from_body(body, arrived)
    peer = request.transport.get_extra_info("peername") if request.transport else None
    record.peer = f"{peer[0]}:{peer[1]}" if peer else None
    sim.arrived += 1
    try:
        return await _serve(request, sim, body, parse_error, record)
    finally:
        sim.record_done(record)


async def _serve(
    request: web.Request, sim: SimState, body: Any, parse_error: str | None, record: RequestRecord
) -> web.StreamResponse:
    faults = sim.injector.faults
    if faults.is_down():
        record.finish(0, "disconnect", detail="down_for_s")
        return await drop_connection(request)
    if faults.latency_s > 0:
        await asyncio.sleep(faults.latency_s)
    fault = sim.injector.draw()
    if fault == DISCONNECT:
        record.finish(0, "disconnect", detail="injected disconnect")
        return await drop_connection(request)
    if fault == ERROR:
        status = faults.error_status
        record.finish(status, "error", detail="injected error")
        return json_response(fault_body(status), status)
    stream = isinstance(body, dict) and body.get("stream") is True
    try:
        if parse_error is not None:
            raise SimHttpError.bad_json(parse_error)
        req = parse_generate(body, sim.cfg)
        record.rid, record.max_new_tokens = req.rid, req.max_new_tokens
        return await _run(request, sim, req, record)
    except SimHttpError as err:
        record.finish(err.status, "error", detail=err.message)
        if stream and err.sse:
            record.status = 200
            return await sse_single(request, err.sse_event())
        return json_response(err.body, err.status)


async def _run(
    request: web.Request, sim: SimState, req: GenerateInput, record: RequestRecord
) -> web.StreamResponse:
    """Submit to the engine and answer; the slot is released whatever happens."""
    completion = sim.outputs.complete(req.input_ids, req.max_new_tokens, req.ignore_eos)
    try:
        seq = sim.engine.submit(req.rid, completion, req.input_ids)
    except SchedulerReject as rej:
        if not req.stream:
            raise rej.error from None
        record.finish(200, "error", detail=rej.error.message)
        chunk = rejection_output(req.rid, len(req.input_ids), rej.finish_reason)
        return await sse_single(request, chunk)
    try:
        if req.stream:
            return await _stream(request, sim, seq, record, req.stream_interval)
        return await _plain(sim, seq, record)
    finally:
        sim.engine.finish(seq)
        if record.detail == "client disconnected":
            record.completion_tokens = seq.count


def _finish_type(seq: Sequence) -> str:
    return str(seq.finish_reason()["type"])


async def _plain(sim: SimState, seq: Sequence, record: RequestRecord) -> web.Response:
    """Non-streaming: wait for the slot, decode to the end, answer once."""
    if await sim.engine.wait_admitted(seq):
        async for _ in sim.engine.decode(seq, NONSTREAM_STEP_S):
            pass
    reason = seq.finish_reason()
    out = build_output(sim.outputs, seq, (0, seq.count), reason, record.arrived_ts)
    record.finish(200, _finish_type(seq), seq.count)
    return json_response(out)


async def _stream(
    request: web.Request, sim: SimState, seq: Sequence, record: RequestRecord, interval: int
) -> web.StreamResponse:
    """Streaming: one SSE chunk per decode step, the final one with finish_reason."""
    resp = await start_sse(request)
    record.status = 200
    try:
        await _write_chunks(resp, sim, seq, record, interval)
    except ConnectionError:  # client left between two chunks: same as a disconnect
        log.debug("stream %s: client went away", seq.rid)
    return resp


def _due(count: int, sent: int, interval: int) -> bool:
    """Whether a chunk is due at ``count`` tokens: every step at interval 1; else the first
    token's and then every ``interval`` tokens (SGLang: ``len % interval == 1``)."""
    if count <= sent:
        return False
    return interval == 1 or sent == 0 or count - sent >= interval


async def _write_chunks(
    resp: web.StreamResponse, sim: SimState, seq: Sequence, record: RequestRecord,
    interval: int = 1,
) -> None:
    incremental = sim.cfg.incremental_streaming_output
    sent = 0
    if await sim.engine.wait_admitted(seq):
        async for count in sim.engine.decode(seq, STREAM_CHUNK_S):
            if count >= seq.target or seq.abort_message is not None \
                    or not _due(count, sent, interval):
                continue
            start = sent if incremental else 0
            chunk = build_output(sim.outputs, seq, (start, count), None, record.arrived_ts)
            await resp.write(sse_event(chunk))
            sent = count
    start = sent if incremental else 0
    reason = seq.finish_reason()
    final = build_output(sim.outputs, seq, (start, seq.count), reason, record.arrived_ts)
    await resp.write(sse_event(final))
    await resp.write(SSE_DONE)
    await resp.write_eof()
    record.finish(200, _finish_type(seq), seq.count)
