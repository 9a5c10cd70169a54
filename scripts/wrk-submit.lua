-- wrk script for scripts/bench-http.sh: POST /v1/separations with a distinct body every
-- time (a new job each), so the ingress does its full work (validate, hash, publish).
local counter = 0
local tag = ""
local base = os.getenv("STEMQ_STORE_BASE") or "file:///tmp/store"
local auth = "Bearer " .. (os.getenv("STEMQ_API_KEY") or "")
-- STEMQ_WRK_PACE_MS: each connection waits this long after an answer before its next
-- request (wrk's delay()), so wrk offers about connections / (pace + latency) requests a
-- second instead of as many as the stack takes. Unset: no wait (saturation).
local pace = tonumber(os.getenv("STEMQ_WRK_PACE_MS") or "")

function init(args)
  math.randomseed(os.time() + tonumber(tostring({}):sub(8), 16) % 100000)
  tag = tostring(math.random(1, 1000000000))
end

function request()
  counter = counter + 1
  local body = string.format('{"audio_uri":"%s/uploads/local/wrk-%s-%d.wav","model":"dsp"}', base, tag, counter)
  return wrk.format("POST", "/v1/separations", { ["Content-Type"] = "application/json", ["Authorization"] = auth }, body)
end

if pace then
  function delay()
    return pace
  end
end

local statuses = {}
function response(status, headers, body)
  statuses[status] = (statuses[status] or 0) + 1
end
