// What went wrong, in words a person understands, with what to do next. Codes are the
// API's `error.code` (HTTP errors) and the job's `error.code` (failed jobs).

const REQUEST = {
  offline: "The server cannot be reached. Check that stemq is running, then try again.",
  unauthorized: "That API key was not accepted. Check it for typos, or ask for a new one (stemq keys create).",
  forbidden: "This key is not allowed to do that. Ask an operator for a key with the right role.",
  too_large: "This file is too large to upload. Trim it, or send a compressed format (FLAC or MP3).",
  model_not_served: "No worker runs that model right now. Pick another model, or start a worker that serves it.",
  rate_limited: "Too many requests from this key.",
  too_many_in_flight: "This key already has as many jobs running as it may. Wait for one to finish.",
  insufficient_credits: "You are out of credits. Ask your operator to add credits, then try again.",
  payment_required: "You are out of credits. Ask your operator to add credits, then try again.",
  unavailable: "stemq is busy or restarting. Nothing was lost; try again in a moment.",
  no_store: "This server has nowhere to keep uploads. Ask its operator to configure a store.",
  not_found: "That job does not exist, or this key cannot see it.",
  upload_interrupted: "The upload stopped before the end. Try again.",
  key_in_query: "Keys are never sent in a link. Sign in with the key instead.",
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
  let words = REQUEST[err.code];
  if (!words) {
    if (err.status === 413) words = REQUEST.too_large;
    else if (err.status === 429) words = REQUEST.rate_limited;
    else if (err.status === 402) words = REQUEST.payment_required;
    else if (err.status >= 500) words = REQUEST.unavailable;
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
