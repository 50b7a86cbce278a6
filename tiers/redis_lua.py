"""The Redis tier's Lua scripts: the server-side steps that keep frames whole and counted.

Keys, for keyspace ``ks`` and a block key's 64-digit hex ``h``::

    kv:ks:{h}              manifest "version:nchunks:length"; present iff the frame is
    kv:ks:{h}:<i>          chunk i of the live frame, i = 0 .. nchunks-1
    kv:ks:{h}:s:<v>:<i>    chunk i of write v, staged with a TTL until published
    kv:{ks}:acct           hash: used (frame bytes), entries

The ``{h}`` hash tag keeps a frame's keys on one cluster slot (one script or MULTI covers
them) while frames spread over the masters.

Never torn: a writer stages chunks under a fresh random version; ``PUBLISH`` then renames
them over the live chunks and writes the manifest; ``DELETE`` drops manifest and chunks in
one script. A dead writer's staged chunks expire.

Accounting lives in Redis, so all users of a keyspace see the same numbers. Standalone,
``PUBLISH`` and ``DELETE`` update it atomically with the frame (``'acct'``). In a cluster
it sits on another slot: a put reserves its byte delta (``RESERVE``), then publishes with
compare-and-swap on the manifest (``'cas'``; undoing and retrying if another writer got
in); a delete drops the frame (``'bare'``), then gives its bytes back. Exact unless a
client dies or loses Redis between the two steps; then ``used`` reads high, never low.
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

from redis.exceptions import NoScriptError

from kvstore.wire.redis import frame_of

__all__ = ["Script", "LUA_FRAME_OF", "PUBLISH", "DELETE", "RESERVE", "frame_of"]


class Script:
    """A Lua script sent by its SHA (40 bytes), whole only when Redis lacks it.

    Sending the 2 KB body with every EVAL cost 15 us a put here, most of it client side.
    """

    def __init__(self, body: str) -> None:
        self.body = body.encode()
        self.sha = hashlib.sha1(self.body).hexdigest()

    def __call__(self, r: Any, keys: Sequence[str], *args: Any) -> Any:
        try:
            return r.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:  # a restarted or flushed Redis; EVAL caches it again
            return r.eval(self.body, len(keys), *keys, *args)


LUA_FRAME_OF = """
local function frame_of(manifest)  -- nchunks, length of a manifest; 0, 0 for none
  if not manifest then return 0, 0 end
  local n, len = string.match(manifest, '^%x+:(%d+):(%d+)$')
  return tonumber(n), tonumber(len)
end
"""

# No flags: Redis refuses the whole script up front when over maxmemory (no half puts).
PUBLISH = Script("#!lua\n" + LUA_FRAME_OF + """
-- Publish staged frames in order, stopping at the first that cannot be.
-- KEYS: [accounting hash], then per frame its manifest and its staged chunks.
-- ARGV: 'acct' capacity | 'cas' expected-old-manifest; then per frame manifest, nchunks, length.
-- Returns {frames published, 'ok' | 'full' | 'lost' | 'conflict', detail}.
local acct = ARGV[1] == 'acct'
local k, done = acct and 2 or 1, 0
for a = 3, #ARGV, 3 do
  local m, n, len = KEYS[k], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  for i = 1, n do
    if redis.call('EXISTS', KEYS[k + i]) == 0 then return {done, 'lost', ''} end
  end
  local old = redis.call('GET', m)
  local nold, lenold = frame_of(old)
  if acct then
    local used = tonumber(redis.call('HGET', KEYS[1], 'used') or '0')
    if len > lenold and used + len - lenold > tonumber(ARGV[2]) then
      return {done, 'full', tostring(used)}
    end
    redis.call('HINCRBY', KEYS[1], 'used', len - lenold)
    if not old then redis.call('HINCRBY', KEYS[1], 'entries', 1) end
  elseif (old or '') ~= ARGV[2] then
    return {done, 'conflict', old or ''}
  end
  for i = 1, n do  -- RENAME keeps the staging TTL, hence PERSIST
    redis.call('RENAME', KEYS[k + i], m .. ':' .. (i - 1))
    redis.call('PERSIST', m .. ':' .. (i - 1))
  end
  for i = n, nold - 1 do redis.call('DEL', m .. ':' .. i) end
  redis.call('SET', m, ARGV[a])
  k, done = k + 1 + n, done + 1
end
return {done, 'ok', ''}
""")

# allow-oom: freeing memory must work when Redis is full.
DELETE = Script("#!lua flags=allow-oom\n" + LUA_FRAME_OF + """
-- Delete frames, manifest and chunks in one step. KEYS: [accounting hash], manifests.
-- ARGV[1]: 'acct' (account here) | 'bare'. Returns each frame's length, -1 if absent.
local acct, out = ARGV[1] == 'acct', {}
for k = acct and 2 or 1, #KEYS do
  local old = redis.call('GET', KEYS[k])
  local n, len = frame_of(old)
  out[#out + 1] = old and len or -1
  if old then
    redis.call('DEL', KEYS[k])
    for i = 0, n - 1 do redis.call('DEL', KEYS[k] .. ':' .. i) end
    if acct then
      redis.call('HINCRBY', KEYS[1], 'used', 0 - len)  -- not -len: Lua prints -0
      redis.call('HINCRBY', KEYS[1], 'entries', -1)
    end
  end
end
return out
""")

RESERVE = Script("""#!lua flags=allow-oom
-- Cluster accounting: add ARGV[1] bytes, ARGV[2] entries unless bytes pass capacity ARGV[3].
local d = tonumber(ARGV[1])
local used = tonumber(redis.call('HGET', KEYS[1], 'used') or '0')
if d > 0 and used + d > tonumber(ARGV[3]) then return 0 end
redis.call('HINCRBY', KEYS[1], 'used', d)
redis.call('HINCRBY', KEYS[1], 'entries', ARGV[2])
return 1
""")
