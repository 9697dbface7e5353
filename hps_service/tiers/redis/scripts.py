"""The Lua scripts of the Redis Cluster tier (versioned put, deletes, tombstone purge) and their EVALSHA framing.

Each script runs on one partition hash (KEYS[1]), so a partition's keys are written atomically in one call.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

#: Shared head of the scripts: ``cmp`` orders two versions (the first 8 bytes, int64 little-endian, of a row
#: or tombstone) byte-wise from the most significant byte with the sign bit flipped, so negatives and values
#: beyond 2^53 compare exactly; ``count_tombstones`` adjusts the partition's ``#tombstones`` field.
_LUA_HEAD = """
local function cmp(stored, offered)
  for i = 8, 1, -1 do
    local a = string.byte(stored, i)
    local b = string.byte(offered, i)
    if i == 8 then a = (a + 128) % 256; b = (b + 128) % 256 end
    if a ~= b then if a < b then return -1 else return 1 end end
  end
  return 0
end
local function count_tombstones(h, delta)
  if delta ~= 0 and redis.call('HINCRBY', h, '#tombstones', delta) <= 0 then
    redis.call('HDEL', h, '#tombstones')
  end
end
local h = KEYS[1]
local out = {}
"""

#: Writes each offered row unless the stored row has a newer version or a tombstone is at or above the offered
#: one; returns one '1'/'0' per field.
PUT_IF_NOT_OLDER_LUA = (
    _LUA_HEAD
    + """
local revived = 0
for i = 1, #ARGV, 2 do
  local cur = redis.call('HGET', h, ARGV[i])
  local ok = (not cur) or #cur < 8
  if not ok then
    local order = cmp(cur, ARGV[i + 1])
    if #cur == 8 then ok = order < 0 else ok = order <= 0 end
  end
  if ok then
    redis.call('HSET', h, ARGV[i], ARGV[i + 1])
    if cur and #cur == 8 then revived = revived + 1 end
    out[#out + 1] = '1'
  else
    out[#out + 1] = '0'
  end
end
count_tombstones(h, -revived)
return table.concat(out)
"""
)

#: Versioned delete: (field, 8-byte version) pairs. A row not newer than the delete, or an absent key, becomes
#: a tombstone at the delete's version; an older tombstone is raised. Returns '1' per live row removed, else '0'.
DELETE_VERSIONED_LUA = (
    _LUA_HEAD
    + """
local added = 0
for i = 1, #ARGV, 2 do
  local cur = redis.call('HGET', h, ARGV[i])
  if (not cur) or #cur < 8 then
    redis.call('HSET', h, ARGV[i], ARGV[i + 1])
    added = added + 1
    out[#out + 1] = '0'
  elseif #cur == 8 then
    if cmp(cur, ARGV[i + 1]) < 0 then redis.call('HSET', h, ARGV[i], ARGV[i + 1]) end
    out[#out + 1] = '0'
  elseif cmp(cur, ARGV[i + 1]) <= 0 then
    redis.call('HSET', h, ARGV[i], ARGV[i + 1])
    added = added + 1
    out[#out + 1] = '1'
  else
    out[#out + 1] = '0'
  end
end
count_tombstones(h, added)
return table.concat(out)
"""
)

#: Unversioned delete: removes rows and tombstones of the given fields; returns the number of live rows removed.
DELETE_LUA = (
    _LUA_HEAD
    + """
local live, tombstones = 0, 0
for i = 1, #ARGV do
  local cur = redis.call('HGET', h, ARGV[i])
  if cur then
    redis.call('HDEL', h, ARGV[i])
    if #cur == 8 then tombstones = tombstones + 1 else live = live + 1 end
  end
end
count_tombstones(h, -tombstones)
return live
"""
)

#: Removes the partition's tombstones older than ARGV[1] (8-byte version) among the fields of one HSCAN page
#: (ARGV[2] = cursor, ARGV[3] = page size); returns {next cursor, tombstones removed}.
PURGE_LUA = (
    _LUA_HEAD
    + """
local page = redis.call('HSCAN', h, ARGV[2], 'COUNT', ARGV[3])
local fields = page[2]
local purged = 0
for i = 1, #fields, 2 do
  local v = fields[i + 1]
  if #fields[i] == 8 and #v == 8 and cmp(v, ARGV[1]) < 0 then
    redis.call('HDEL', h, fields[i])
    purged = purged + 1
  end
end
count_tombstones(h, -purged)
return {page[1], purged}
"""
)

#: The field of each partition hash that counts its tombstones (never an 8-byte key).
TOMBSTONE_COUNT_FIELD = b"#tombstones"


@dataclass(frozen=True, slots=True)
class Script:
    """A Lua script and its SHA1, for EVALSHA with an EVAL fallback."""

    source: bytes
    sha: bytes

    @classmethod
    def of(cls, source: str) -> Script:
        """The script of Lua ``source``."""
        return cls(source.encode(), hashlib.sha1(source.encode()).hexdigest().encode())

    def evalsha_head(self) -> bytes:
        """``EVALSHA <sha> 1`` as RESP bulk strings (the array header and the key follow per command)."""
        return b"$7\r\nEVALSHA\r\n$40\r\n%s\r\n$1\r\n1\r\n" % self.sha

    def eval_head(self) -> bytes:
        """``EVAL <source> 1`` as RESP bulk strings: the fallback where a node lost its script cache."""
        return b"$4\r\nEVAL\r\n$%d\r\n%s\r\n$1\r\n1\r\n" % (len(self.source), self.source)
