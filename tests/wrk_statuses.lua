-- wrk script for tests/deployload.py: GET wrk.path with a bearer token (the tokens are
-- the script arguments, used in turn), count every answer by status, and keep the wall
-- time (ms) of every answer >= 500 and the number of answers per 100 ms, so a test can
-- look at a time window (e.g. the first second after PostgreSQL answers again).
local ffi = require("ffi")
ffi.cdef [[
typedef struct { long tv_sec; long tv_usec; } airlock_timeval;
int gettimeofday(airlock_timeval *tv, void *tz);
]]
local tv = ffi.new("airlock_timeval")

local function now_ms()
  ffi.C.gettimeofday(tv, nil)
  return tonumber(tv.tv_sec) * 1000 + math.floor(tonumber(tv.tv_usec) / 1000)
end

local threads = {}

function setup(thread)
  table.insert(threads, thread)
end

function init(args)
  tokens = {}
  for i = 1, #args do tokens[i] = args[i] end
  turn = 0
  statuses = {}
  failures = {}
  nfailures = 0
  buckets = {}
end

function request()
  turn = turn % #tokens + 1
  return wrk.format("GET", wrk.path, { ["Authorization"] = "Bearer " .. tokens[turn] })
end

function response(status, headers, body)
  local key = tostring(status)
  statuses[key] = (statuses[key] or 0) + 1
  local t = now_ms()
  local bucket = tostring(math.floor(t / 100))
  buckets[bucket] = (buckets[bucket] or 0) + 1
  if status >= 500 and nfailures < 5000 then
    nfailures = nfailures + 1
    failures[nfailures] = status .. "@" .. t
  end
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("ERRORS connect=%d read=%d write=%d status=%d timeout=%d\n",
    e.connect, e.read, e.write, e.status, e.timeout))
  for _, thread in ipairs(threads) do
    for key, count in pairs(thread:get("statuses")) do
      io.write(string.format("STATUS %s %d\n", key, count))
    end
    for _, failure in ipairs(thread:get("failures")) do
      io.write("FAILURE " .. failure .. "\n")
    end
    for bucket, count in pairs(thread:get("buckets")) do
      io.write(string.format("BUCKET %s %d\n", bucket, count))
    end
  end
end
