-- wrk script for the poll figures: a bearer token (args[1]), an optional If-None-Match
-- (args[2]), and a count of every status so non-2xx/3xx answers become errors in the report.
-- done() prints one line `WRK_JSON {...}` that bench/wrk.py reads.

local threads = {}

function setup(thread)
  table.insert(threads, thread)
end

function init(args)
  wrk.headers["Authorization"] = "Bearer " .. args[1]
  if args[2] ~= nil and args[2] ~= "" then
    wrk.headers["If-None-Match"] = args[2]
  end
  statuses = {}
end

function response(status, headers, body)
  statuses[status] = (statuses[status] or 0) + 1
end

function done(summary, latency, requests)
  local counts = {}
  for _, thread in ipairs(threads) do
    for code, n in pairs(thread:get("statuses")) do
      counts[code] = (counts[code] or 0) + n
    end
  end
  local parts = {}
  for code, n in pairs(counts) do
    table.insert(parts, string.format('"%d": %d', code, n))
  end
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {"requests": %d, "duration_us": %d, "p50_us": %d, "p99_us": %d, '
      .. '"socket_errors": %d, "timeouts": %d, "statuses": {%s}}\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.connect + e.read + e.write, e.timeout, table.concat(parts, ", ")))
end
