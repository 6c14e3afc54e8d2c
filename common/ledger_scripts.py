"""The Lua scripts: the only writers of a dataset's ledger.

Every key arrives through KEYS (built by common.keys); no key is spelled here. Each
script runs atomically in Redis, so however many workers race, a sample is charged once
and a dataset is closed once, by the charge that crosses its budget.

Shared layout: KEYS[1] ledger hash, KEYS[2] charged hash, KEYS[3] inflight hash,
KEYS[4..7] the queue's kombu priority lists, KEYS[8] the started set (rids of a drain
dataset whose first token came). A script that takes a rid out of the inflight hash takes
it out of the started set too, in the same step: no command of its own per request.
"""

from __future__ import annotations

KEYS_PER_DATASET = 8

# Closing = state, timestamps and a purge of every priority list of the queue, in the
# same atomic step as the decision. Returns the number of messages purged.
_CLOSE_FN = """
local function close(now, reason)
  local purged = 0
  for i = 4, 7 do
    purged = purged + redis.call('LLEN', KEYS[i])
  end
  redis.call('DEL', KEYS[4], KEYS[5], KEYS[6], KEYS[7])
  redis.call('HSET', KEYS[1], 'state', 'closed', 'closed_at', now,
             'close_reason', reason,
             'used_at_close', redis.call('HGET', KEYS[1], 'used') or '0')
  return purged
end
local function num(field)
  return tonumber(redis.call('HGET', KEYS[1], field) or '0') or 0
end
"""

# -- KEYS: ledger, charged, inflight, q0, q3, q6, q9, started
# -- ARGV: sample_id, rid, prompt_tokens, completion_tokens, kept, now
# Returns {status, kept_completion_tokens, used, crossed, purged}
#   status 1 = charged, 2 = duplicate (already charged: nothing changed),
#          0 = refused (closed under abort/exact, or no room left under exact).
# kept: 1 when the sample as generated is one the exports keep (common.kept). With the
# term kept_only (basis "kept") a sample not kept is charged 0 (recorded, so charged once)
# and never cut; under exact a kept sample that no longer fits is cut, which leaves it
# not kept: it is charged 0 and closes the dataset, so used never passes the budget.
CHARGE = (
    _CLOSE_FN
    + """
local sid, rid = ARGV[1], ARGV[2]
local prompt, completion, now = tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[6]
local kept = ARGV[5] == '1'
local expected = tonumber(redis.call('HGET', KEYS[3], rid) or '0')
if redis.call('HDEL', KEYS[3], rid) == 1 then
  redis.call('HINCRBY', KEYS[1], 'reserved', -expected)
end
redis.call('SREM', KEYS[8], rid)
local used = num('used')
local prev = redis.call('HGET', KEYS[2], sid)
if prev then
  return {2, completion, used, 0, 0}
end
local policy = redis.call('HGET', KEYS[1], 'policy') or 'drain'
local closed = redis.call('HGET', KEYS[1], 'state') == 'closed'
if closed and policy ~= 'drain' then
  return {0, 0, used, 0, 0}
end
local fixed = prompt * num('prompt_weight')
local budget = num('budget')
local kept_only = num('kept_only') == 1
local cut = false
if policy == 'exact' and budget > 0 and (kept or not kept_only) then
  local room = budget - used - fixed
  if room <= 0 then return {0, 0, used, 0, 0} end
  if completion > room then completion, cut = room, true end
end
local cost = fixed + completion
if kept_only and (cut or not kept) then cost = 0 end
redis.call('HSET', KEYS[2], sid, cost)
used = redis.call('HINCRBY', KEYS[1], 'used', cost)
redis.call('HINCRBY', KEYS[1], 'samples', 1)
redis.call('HINCRBY', KEYS[1], 'sumsq', cost * cost)
local crossed, purged = 0, 0
if (not closed) and budget > 0 and (used >= budget or cut) then
  crossed = 1
  purged = close(now, 'budget')
end
return {1, completion, used, crossed, purged}
"""
)

# -- KEYS: ledger, charged, inflight, q0, q3, q6, q9, started
# -- ARGV: sample_id, cost
# Re-prices a sample charged before a crash whose stored result turned out different.
RECHARGE = """
local prev = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
local cost = tonumber(ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], cost)
redis.call('HINCRBY', KEYS[1], 'sumsq', cost * cost - prev * prev)
return redis.call('HINCRBY', KEYS[1], 'used', cost - prev)
"""

# -- KEYS: ledger, charged, inflight, q0, q3, q6, q9, started
# -- ARGV: rid, max_new_tokens, default_expected_tokens
# Returns {status, expected}: 1 = admitted (rid now in flight), 0 = closed,
#   2 = wait: used + the expected output of requests in flight already reach the budget,
#   3 = unknown: the ledger has no terms (Redis lost them, or a ledger written before
#   prompt_weight was a term): reconcile from SQL first, which writes them.
# A request in flight is expected to cost the mean plus one standard deviation of the
# samples charged so far: outputs are long-tailed, and the requests still running when a
# budget is crossed are the long ones, so reserving only the mean lets drain overshoot.
# A request is always admitted when nothing is in flight, so a dataset whose requests
# finish short keeps moving. A rid already in flight is admitted as it stands: the same
# call sent again (redis-py retries a command whose answer a dropped connection lost)
# must not reserve its tokens twice.
ADMIT = (
    _CLOSE_FN
    + """
if redis.call('HGET', KEYS[1], 'state') == 'closed' then return {0, 0} end
local held = redis.call('HGET', KEYS[3], ARGV[1])
if held then return {1, tonumber(held)} end
if not redis.call('HGET', KEYS[1], 'prompt_weight') then return {3, 0} end
local used, budget, samples = num('used'), num('budget'), num('samples')
local expected = tonumber(ARGV[3])
if samples > 0 then
  local mean = used / samples
  local var = num('sumsq') / samples - mean * mean
  if var < 0 then var = 0 end
  expected = math.floor(mean + math.sqrt(var))
end
if num('prompt_weight') == 0 then
  expected = math.min(expected, tonumber(ARGV[2]))
end
if budget > 0 and redis.call('HLEN', KEYS[3]) > 0
   and used + num('reserved') + expected > budget then
  return {2, expected}
end
redis.call('HSET', KEYS[3], ARGV[1], expected)
redis.call('HINCRBY', KEYS[1], 'reserved', expected)
return {1, expected}
"""
)

# -- KEYS: ledger, charged, inflight, q0, q3, q6, q9, started
# -- ARGV: rid
# A request that ends without a charge (failure, retry, abort) frees its reservation.
RELEASE = """
local expected = tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0')
if redis.call('HDEL', KEYS[3], ARGV[1]) == 1 then
  redis.call('HINCRBY', KEYS[1], 'reserved', -expected)
end
redis.call('SREM', KEYS[8], ARGV[1])
return expected
"""

# -- KEYS: ledger, charged, inflight, q0, q3, q6, q9, started
# -- ARGV: budget, basis, policy, prompt_weight, kept_only, now
# Sets the dataset's terms; a dataset already at or over its new budget closes at once.
# prompt_weight (1 or 0: whether prompt tokens count) and kept_only (1 or 0: whether only
# kept samples are charged) come from common.budget, so the scripts do the budget's
# arithmetic without knowing what a basis means; 'basis' is kept for people reading the
# hash.
# Returns {closed_now, purged, used}.
CONFIGURE = (
    _CLOSE_FN
    + """
redis.call('HSET', KEYS[1], 'budget', ARGV[1], 'basis', ARGV[2], 'policy', ARGV[3],
           'prompt_weight', ARGV[4], 'kept_only', ARGV[5])
redis.call('HSETNX', KEYS[1], 'state', 'open')
redis.call('HSETNX', KEYS[1], 'used', 0)
local used, budget = num('used'), num('budget')
if redis.call('HGET', KEYS[1], 'state') ~= 'closed' and budget > 0 and used >= budget then
  return {1, close(ARGV[6], 'budget'), used}
end
return {0, 0, used}
"""
)

# -- KEYS: ledger, charged, inflight, q0, q3, q6, q9, started
# -- ARGV: now, reason
# Returns {closed_now, purged}; closing a closed dataset purges again but keeps its record.
CLOSE = (
    _CLOSE_FN
    + """
if redis.call('HGET', KEYS[1], 'state') == 'closed' then
  local purged = 0
  for i = 4, 7 do purged = purged + redis.call('LLEN', KEYS[i]) end
  redis.call('DEL', KEYS[4], KEYS[5], KEYS[6], KEYS[7])
  return {0, purged}
end
return {1, close(ARGV[1], ARGV[2])}
"""
)

# -- KEYS: ledger, charged, inflight, q0, q3, q6, q9, started
# -- ARGV: budget
# Reopens a closed dataset with a higher budget.
REOPEN = """
redis.call('HSET', KEYS[1], 'budget', ARGV[1], 'state', 'open')
redis.call('HDEL', KEYS[1], 'closed_at', 'close_reason', 'used_at_close')
return 1
"""

# -- KEYS: ledger, charged, inflight, q0, q3, q6, q9, started
# -- ARGV: sample_id_1, cost_1, sample_id_2, cost_2, ...
# Adds stored results the ledger does not know (SQL is the source of truth); charges it
# already holds are left alone, so this is safe while workers run. Returns tokens added.
ABSORB = """
local added, n, sumsq = 0, 0, 0
for i = 1, #ARGV, 2 do
  if redis.call('HSETNX', KEYS[2], ARGV[i], ARGV[i + 1]) == 1 then
    local cost = tonumber(ARGV[i + 1])
    added, n, sumsq = added + cost, n + 1, sumsq + cost * cost
  end
end
if n > 0 then
  redis.call('HINCRBY', KEYS[1], 'used', added)
  redis.call('HINCRBY', KEYS[1], 'samples', n)
  redis.call('HINCRBY', KEYS[1], 'sumsq', sumsq)
end
return added
"""

# The calls of one worker group in a single EVALSHA. The script's body becomes a function
# whose parameters shadow KEYS and ARGV, so it runs unchanged, once per call, in order.
# KEYS: the 8 keys of each dataset of the batch, one dataset after another.
# ARGV: width (arguments a call takes), then per call its dataset's 1-based position in
#   KEYS followed by its arguments. Returns the calls' replies in order.
# One command instead of one per call: the worker packs and parses one, and Redis looks
# the script up once. The batch is atomic as a whole, which decides nothing differently:
# the same calls pipelined ran in the same order, each atomically.
_BATCH_HEAD = """
local function one(KEYS, ARGV)
"""
_BATCH_END = """
end
"""
_BATCH_LOOP = f"""
local width, per = tonumber(ARGV[1]), {KEYS_PER_DATASET}
local replies = {{}}
for i = 2, #ARGV, width + 1 do
  local base = (tonumber(ARGV[i]) - 1) * per
  local keys, args = {{}}, {{}}
  for k = 1, per do keys[k] = KEYS[base + k] end
  for a = 1, width do args[a] = ARGV[i + a] end
  replies[#replies + 1] = one(keys, args)
end
return replies
"""


def batched(script: str) -> str:
    return _BATCH_HEAD + script + _BATCH_END + _BATCH_LOOP


# A batch that runs only while the Redis is paired with the caller's results database:
# KEYS end with the pairing key, ARGV with the caller's store id ('' to skip the check). A
# Redis paired with another database (emptied and taken by another run since the worker
# last looked) runs nothing and answers {'paired-elsewhere', its store id}. One paired with
# none runs the calls: an emptied Redis has no terms either, so ADMIT answers 3 and the
# worker rebuilds the ledger from SQL, which pairs it again.
_PAIRED_GUARD = """
local paired, mine = redis.call('GET', KEYS[#KEYS]), ARGV[#ARGV]
if paired and mine ~= '' and paired ~= mine then return {'paired-elsewhere', paired} end
ARGV[#ARGV] = nil
KEYS[#KEYS] = nil
"""
PAIRED_ELSEWHERE = "paired-elsewhere"


def batched_if_paired(script: str) -> str:
    return _BATCH_HEAD + script + _BATCH_END + _PAIRED_GUARD + _BATCH_LOOP


ADMIT_MANY = batched_if_paired(ADMIT)
CHARGE_MANY = batched_if_paired(CHARGE)
RECHARGE_IF_PAIRED = batched_if_paired(RECHARGE)
