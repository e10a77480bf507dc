-- wrk script for the proposal figure (bench/proposals.py): one PATCH (a JSON merge patch)
-- per request, each to a resource of its own, so no two requests meet on one version.
-- args: [1] the path before the name, [2] the block's tag, [3] a file of run tokens, one a
-- line. Request n (one wrk thread: one counter) writes `<tag>l<lane>-<n>` with lane = n mod
-- the number of tokens, with the lane's token (whose run's write set is `<tag>l<lane>-*`),
-- If-Match "1" (the version every resource of the block was seeded at) and a unique
-- Idempotency-Key. Statuses are counted; done() prints `WRK_JSON {...}` for bench/wrk.py.

local threads = {}

function setup(thread)
  table.insert(threads, thread)
end

function init(args)
  path, tag = args[1], args[2]
  tokens = {}
  for line in io.lines(args[3]) do
    if line ~= "" then
      table.insert(tokens, line)
    end
  end
  n = 0
  statuses = {}
end

function request()
  local lane = n % #tokens
  local headers = {
    ["Authorization"] = "Bearer " .. tokens[lane + 1],
    ["Content-Type"] = "application/merge-patch+json",
    ["If-Match"] = '"1"',
    ["Idempotency-Key"] = "bench-" .. tag .. "-" .. n,
  }
  local name = tag .. "l" .. lane .. "-" .. n
  local body = '{"n": ' .. n .. ', "by": "bench"}'
  n = n + 1
  return wrk.format("PATCH", path .. name, headers, body)
end

function response(status, headers, body)
  statuses[status] = (statuses[status] or 0) + 1
end

function done(summary, latency, requests)
  local counts = {}
  for _, thread in ipairs(threads) do
    for code, count in pairs(thread:get("statuses")) do
      counts[code] = (counts[code] or 0) + count
    end
  end
  local parts = {}
  for code, count in pairs(counts) do
    table.insert(parts, string.format('"%d": %d', code, count))
  end
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {"requests": %d, "duration_us": %d, "p50_us": %d, "p99_us": %d, '
      .. '"socket_errors": %d, "timeouts": %d, "statuses": {%s}}\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.connect + e.read + e.write, e.timeout, table.concat(parts, ", ")))
end
