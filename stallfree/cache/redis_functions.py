"""The cluster tier's server-side code: one Redis function library, loaded by the admin user.

Why functions rather than ``EVAL``: a cache client that may send ``EVAL`` may run any Lua on the
server. A review showed what that costs (issue 36): an endless loop answers every client ``BUSY``
until an admin kills it, and ``string.rep`` of 1.5 GB took a 256 MB server to 5 GB of RSS. So the
servers we start load this library once, as the admin user, when they start; the data user's ACL
allows ``FCALL``/``FCALL_RO`` and never ``EVAL``, ``SCRIPT`` or ``FUNCTION``, so it can run these
functions and no other Lua. A server whose default user may do everything (one the user runs
unrestricted) gets the library from the first client that misses it.

The functions (Redis 7.0+):

- ``stallfree_admit_v1``: minio admission, exact and shared by all clients (KEYS: used counter,
  full flag, entries; ARGV: capacity (0: none), values). Per entry 1 stored, 0 present, -1 no room.
- ``stallfree_drop_v1``: delete entries and give their bytes back to the used counter.
- ``stallfree_sizes_v1``: the first half of the bounded read (KEYS: full flag, entries): the full
  flag, then each entry's size (0: absent), without sending a value. The client then ``MGET``s only
  the entries within its ``max_entry_bytes``, so a planted 120 MB value is never sent to a client
  that accepts 64 MiB, and a batch of misses costs one round trip, as before. (One ``FCALL`` that
  returned the values itself measured 0.56x ``MGET``'s throughput: Lua copies each value twice;
  ``benchmarks/bench_cluster_read.py``.) A value swapped for a bigger one between the two calls is
  still dropped on arrival, never decoded (``BaseCache.get_encoded_many``): only that race costs
  one download.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LIBRARY = "stallfree_v1"
ADMIT, DROP, SIZES = "stallfree_admit_v1", "stallfree_drop_v1", "stallfree_sizes_v1"

CODE = f"""#!lua name={LIBRARY}
local function admit(keys, args)
  -- every argument checked before the first write: a call that fails leaves nothing stored
  -- that the used counter does not count
  if #keys < 2 or #args ~= #keys - 1 then
    return redis.error_reply('ERR stallfree_admit_v1: wants the used and full keys, then one value per entry key')
  end
  local cap = tonumber(args[1])
  if cap == nil or cap ~= cap or cap < 0 or cap == math.huge then
    return redis.error_reply('ERR stallfree_admit_v1: capacity must be a number of bytes >= 0')
  end
  local used = tonumber(redis.call('GET', keys[1]) or '0')
  if used == nil or used ~= used then
    return redis.error_reply('ERR stallfree_admit_v1: the used counter is not a number')
  end
  local out = {{}}
  for i = 3, #keys do
    if redis.call('EXISTS', keys[i]) == 1 then
      out[#out + 1] = 0
    else
      local n = string.len(args[i - 1])
      if cap > 0 and used + n > cap then
        out[#out + 1] = -1
      else
        redis.call('SET', keys[i], args[i - 1])
        used = used + n
        out[#out + 1] = 1
      end
    end
  end
  redis.call('SET', keys[1], used)
  for i = 1, #out do
    if out[i] == -1 then redis.call('SET', keys[2], '1') break end
  end
  return out
end

local function drop(keys, args)
  local counter = redis.call('GET', keys[1])
  if counter and not string.match(counter, '^-?%d+$') then  -- DECRBY would fail after the DELs
    return redis.error_reply('ERR stallfree_drop_v1: the used counter is not an integer')
  end
  local freed = 0
  for i = 2, #keys do
    local n = redis.call('STRLEN', keys[i])
    if n > 0 then redis.call('DEL', keys[i]) freed = freed + n end
  end
  if freed > 0 and redis.call('EXISTS', keys[1]) == 1 then redis.call('DECRBY', keys[1], freed) end
  return freed
end

local function sizes(keys, args)
  if #keys < 1 then return redis.error_reply('ERR stallfree_sizes_v1: wants the full key first') end
  local out = {{redis.call('EXISTS', keys[1])}}
  for i = 2, #keys do out[i] = redis.call('STRLEN', keys[i]) end
  return out
end

redis.register_function('{ADMIT}', admit)
redis.register_function('{DROP}', drop)
redis.register_function{{function_name='{SIZES}', callback=sizes, flags={{'no-writes'}}}}
"""


class FunctionsMissing(RuntimeError):
    """The server lacks our library and this client may not load it (a restricted server that was
    started some other way, or restarted without ``stallfree cache serve``)."""


@dataclass(frozen=True)
class BoundedRead:
    """What ``get_bounded`` found: values (None: a miss), the sizes of the values it left on the
    server for being over the bound (position -> bytes), and the server's full flag."""

    values: list[bytes | None]
    oversized: dict[int, int]
    full: bool


def load(client: Any) -> None:
    """Load (or replace) the library; needs a user allowed ``FUNCTION LOAD`` (the admin)."""
    client.function_load(CODE, replace=True)


def ensure(client: Any) -> None:
    """Make sure the server has the library: present, or loaded now when this user may.

    Raises ``FunctionsMissing`` naming the fix when it is absent and this user may not load it."""
    import redis

    try:
        client.fcall_ro(SIZES, 1, b"sf/__full__")
        return
    except redis.ResponseError as exc:
        if "function not found" not in str(exc).lower():
            raise
    try:
        load(client)
    except redis.ResponseError as exc:
        raise FunctionsMissing(
            f"the server has no {LIBRARY} function library and this user may not load it ({exc}); "
            "start the server with `stallfree cache serve` (it loads the library as its admin user) "
            "or load it as an admin: stallfree.cache.redis_functions.load(admin_client)"
        ) from exc


def admit(client: Any, keys: list[bytes], args: list[Any]) -> list[int]:
    return [int(x) for x in client.fcall(ADMIT, len(keys), *keys, *args)]


def drop(client: Any, keys: list[bytes]) -> int:
    return int(client.fcall(DROP, len(keys), *keys))


def get_bounded(client: Any, full_key: bytes, keys: list[bytes], limit: int) -> BoundedRead:
    """Values of ``keys`` no larger than ``limit`` bytes: their sizes first, then only those."""
    reply = client.fcall_ro(SIZES, len(keys) + 1, full_key, *keys)
    sizes = [int(n) for n in reply[1:]]
    oversized = {pos: n for pos, n in enumerate(sizes) if n > limit}
    wanted = [pos for pos, n in enumerate(sizes) if 0 < n <= limit]
    values: list[bytes | None] = [None] * len(keys)
    if wanted:
        for pos, value in zip(wanted, client.mget([keys[p] for p in wanted]), strict=True):
            values[pos] = value
    return BoundedRead(values, oversized, bool(reply[0]))
