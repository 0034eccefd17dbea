-- wrk script of scripts/bench --server: POSTs WRK_BODY (JSON) to the URL, stops after
-- WRK_REQUESTS responses (run wrk with -t1: the count is per thread), then prints one line:
-- "WRK requests <n> errors <n> duration_us <n> p50_us <n> p99_us <n>".
-- wrk's main thread sleeps for -d whatever the threads do; the SIGINT the script sends itself
-- at the count ends that sleep as Ctrl-C would (wrk then joins, sums up and calls done()).
local ffi = require("ffi")
ffi.cdef("int getpid(void); int kill(int pid, int sig);")
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = os.getenv("WRK_BODY")
local limit = tonumber(os.getenv("WRK_REQUESTS"))
local seen = 0

function response(status, headers, body)
  seen = seen + 1
  if seen >= limit then
    wrk.thread:stop()
    ffi.C.kill(ffi.C.getpid(), 2)
  end
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("WRK requests %d errors %d duration_us %d p50_us %d p99_us %d\n",
    summary.requests, e.connect + e.read + e.write + e.status + e.timeout, summary.duration,
    latency:percentile(50), latency:percentile(99)))
end
