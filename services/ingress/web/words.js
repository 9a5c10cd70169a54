// What went wrong, in words a person understands, with what to do next. Codes are the
// API's `error.code` (HTTP errors) and the job's `error.code` (failed jobs).

// BEGIN ErrorCode (generated from services/ingress/src/error_code.rs; do not edit)
const API_ERRORS = {
  bad_request: { status: 400 },
  key_in_query: { status: 400, words: "Keys are never sent in a link. Sign in with the key instead." },
  upload_interrupted: { status: 400, words: "The upload stopped before the end. Try again." },
  unauthorized: { status: 401, words: "That API key was not accepted. Check it for typos, or ask for a new one (stemq keys create)." },
  insufficient_credits: { status: 402, words: "You are out of credits. Ask your operator to add credits, then try again." },
  forbidden: { status: 403, words: "This key is not allowed to do that. Ask an operator for a key with the right role." },
  not_found: { status: 404, words: "That job does not exist, or this key cannot see it." },
  method_not_allowed: { status: 405 },
  request_timeout: { status: 408 },
  conflict: { status: 409 },
  not_ready: { status: 409 },
  too_large: { status: 413, words: "This file is too large to upload. Trim it, or send a compressed format (FLAC or MP3)." },
  unsupported_media_type: { status: 415 },
  invalid_request: { status: 422 },
  model_not_served: { status: 422, words: "No worker runs that model right now. Pick another model, or start a worker that serves it." },
  empty_upload: { status: 422 },
  rate_limited: { status: 429, words: "Too many requests from this key." },
  too_many_in_flight: { status: 429, words: "This key already has as many jobs running as it may. Wait for one to finish." },
  internal: { status: 500 },
  unavailable: { status: 503, words: "stemq is busy or restarting. Nothing was lost; try again in a moment." },
  no_store: { status: 503, words: "This server has nowhere to keep uploads. Ask its operator to configure a store." },
};
// END ErrorCode

// What the page itself runs into, beside the API's codes.
const PAGE = {
  offline: "The server cannot be reached. Check that stemq is running, then try again.",
};

const JOB = {
  invalid_audio: "This file is not audio stemq can read. Try a WAV, FLAC, MP3, M4A, Opus, Ogg, WebM or AIFF file.",
  corrupt_audio: "This file is damaged. Export it again and upload the new copy.",
  unsupported_codec: "This file's audio format is not supported (the details name it). Convert it to WAV, FLAC or M4A.",
  empty_audio: "This file has no sound in it.",
  too_long: "This song is too long for this server. Trim it and try again.",
  input_too_large: "This file is too large for this server. Trim it, or send a compressed format.",
  input_not_found: "The song could not be found at that address. Check the link.",
  input_not_allowed: "This server may not fetch audio from that address.",
  input_fetch: "The song could not be downloaded from that address. Check the link, then retry.",
  model_unavailable: "The model is not installed on the worker. Pick another model.",
  out_of_memory: "The song did not fit in the worker's memory. Try a shorter song or a smaller model.",
  over_memory_budget: "The song did not fit in the worker's memory. Try a shorter song or a smaller model.",
  time_limit: "The job took longer than its time limit.",
  cancelled: "The job was cancelled.",
  insufficient_credits: "You ran out of credits for this song. Ask your operator to add credits, then retry.",
  max_deliveries: "The job failed on every attempt. An operator can look at it and replay it.",
  crash_loop: "The job stopped its worker on every attempt. An operator can look at it.",
};

// A sentence for an ApiError (HTTP) or a job's error ({code, message}).
export function sayRequest(err) {
  let words = PAGE[err.code] || API_ERRORS[err.code]?.words;
  if (!words) {
    if (err.status === 413) words = API_ERRORS.too_large.words;
    else if (err.status === 429) words = API_ERRORS.rate_limited.words;
    else if (err.status === 402) words = API_ERRORS.insufficient_credits.words;
    else if (err.status >= 500) words = API_ERRORS.unavailable.words;
    else if (err.status === 422) words = `This request was refused: ${err.message}`;
    else words = err.message || `Something went wrong (HTTP ${err.status}).`;
  }
  if (err.status === 429 && err.retryAfter) words += ` Try again in ${err.retryAfter} s.`;
  else if (err.status === 429) words += " Try again in a little while.";
  return words;
}

export function sayJob(error) {
  if (!error) return "";
  return JOB[error.code] || error.message || error.code;
}

export function sayStatus(view) {
  switch (view.status) {
    case "queued": return view.waiting ? `Waiting: ${view.waiting}` : "Queued";
    case "running": return "Separating";
    case "succeeded": return "Done";
    case "failed": return "Failed";
    case "dead_lettered": return "Failed on every attempt";
    case "rejected": return "Refused";
    case "cancelled": return "Cancelled";
    case "expired": return "Expired before it could start";
    default: return view.status;
  }
}
