-- POST a fixed JSON body (file in WRK_BODY_FILE) with an optional bearer key (WRK_AUTH), and print
-- the run's numbers as one JSON line prefixed "WRK_JSON " for bench/wrk.py to read.
local f = assert(io.open(os.getenv("WRK_BODY_FILE"), "rb"))
wrk.method = "POST"
wrk.body = f:read("*a")
f:close()
wrk.headers["Content-Type"] = "application/json"
local auth = os.getenv("WRK_AUTH")
if auth ~= nil and auth ~= "" then
  wrk.headers["Authorization"] = "Bearer " .. auth
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {"requests":%d,"duration_us":%d,"errors":%d,"p50_us":%d,"p99_us":%d}\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.status + e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
