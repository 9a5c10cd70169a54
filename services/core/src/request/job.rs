//! The request document as a client sends it ([`JobRequest`]), its validation, and its
//! canonical form ([`NormalizedRequest`]), whose hash is the job id.
//!
//! Validation names the offending field for every bad value: each field is first read
//! alone against the request type, so serde's own message (which for the options enums
//! lists the accepted values from the enum) is reported under that field's name; then
//! [`JobRequest::normalize`] checks what types cannot say (ranges, combinations).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::{
    ClipMode, Encoding, JobId, Model, OtherMethod, OutputFormat, Priority, RequestError, ANONYMOUS,
    DEFAULT_MP3_BITRATE, DEFAULT_MP3_PRESET, MAX_METADATA_BYTES, MAX_RUNTIME_S, MAX_SHIFTS, MAX_URI_LEN, MP3_BITRATES,
    MP3_PRESETS,
};

/// Where and which job events a client wants to be told about (delivered by the relay).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Webhook {
    /// The receiver's URL.
    #[schemars(regex(pattern = r"\S"))]
    pub url: String,
    /// Event classes to deliver: `started`, `progress`, `completed`. Default
    /// `["completed"]`.
    #[serde(default = "default_webhook_events")]
    #[schemars(with = "Vec<WebhookEvent>")]
    pub events: Vec<String>,
}

/// An event class a webhook may ask for (the schema of [`Webhook::events`], whose values
/// [`JobRequest::normalize`] checks).
#[derive(JsonSchema)]
#[serde(rename_all = "snake_case")]
#[allow(dead_code)]
enum WebhookEvent {
    /// The job started running.
    Started,
    /// Progress while it runs.
    Progress,
    /// It ended, whatever the outcome.
    Completed,
}

fn default_webhook_events() -> Vec<String> {
    vec!["completed".to_string()]
}

/// The schema of `two_stems`: a stem some model produces, or null.
fn two_stems_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let mut values: Vec<Value> = Vec::new();
    for stem in Model::ALL.iter().flat_map(|m| m.sources().iter().copied()) {
        if !values.contains(&Value::from(stem)) {
            values.push(Value::from(stem));
        }
    }
    values.push(Value::Null);
    schemars::json_schema!({"type": ["string", "null"], "enum": values})
}

/// The schema of `mp3_bitrate`: one of the bit rates, or null.
fn mp3_bitrate_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let mut values: Vec<Value> = MP3_BITRATES.iter().map(|b| Value::from(*b)).collect();
    values.push(Value::Null);
    schemars::json_schema!({"type": ["integer", "null"], "enum": values})
}

/// What [`JobRequest::normalize`] checks across fields, as schema rules (`allOf` of
/// `if`/`then`): each model's own stems and longest segment, `other_method` only with
/// `two_stems`, no float samples in FLAC, only 16-bit samples in MP3, and the MP3
/// options only with MP3 (or at their defaults).
fn request_rules(schema: &mut schemars::Schema) {
    let mut rules: Vec<Value> = Vec::new();
    for m in Model::ALL.iter().copied() {
        let mut stems: Vec<Value> = m.sources().iter().map(|s| Value::from(*s)).collect();
        stems.push(Value::Null);
        let mut then = serde_json::json!({"properties": {"two_stems": {"enum": stems}}});
        if let Some(max) = m.max_segment() {
            then["properties"]["segment"] = serde_json::json!({"maximum": max});
        }
        // A request without `model` is for the default model.
        let when = if m == Model::Htdemucs {
            let other = serde_json::json!({"not": {"enum": [m.as_str(), null]}});
            serde_json::json!({"not": {"required": ["model"], "properties": {"model": other}}})
        } else {
            serde_json::json!({"required": ["model"], "properties": {"model": {"const": m.as_str()}}})
        };
        rules.push(serde_json::json!({"if": when, "then": then}));
    }
    rules.push(serde_json::json!({
        "if": {"required": ["other_method"], "properties": {"other_method": {"enum": ["minus", "none"]}}},
        "then": {"required": ["two_stems"], "properties": {"two_stems": {"type": "string"}}}
    }));
    rules.push(serde_json::json!({
        "if": {"required": ["output_format"], "properties": {"output_format": {"const": "flac"}}},
        "then": {"properties": {"encoding": {"not": {"const": "f32"}}}}
    }));
    rules.push(serde_json::json!({
        "if": {"required": ["output_format"], "properties": {"output_format": {"const": "mp3"}}},
        "then": {"properties": {"encoding": {"enum": ["s16", null]}}},
        "else": {"properties": {"mp3_bitrate": {"enum": [DEFAULT_MP3_BITRATE, null]},
                                "mp3_preset": {"enum": [DEFAULT_MP3_PRESET, null]}}}
    }));
    schema.insert("allOf".into(), Value::Array(rules));
}

/// A separation request as a client sends it (`POST /v1/separations`, the NATS submit
/// endpoint, or inside a raw `JobRequested` event).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(transform = request_rules)]
pub struct JobRequest {
    /// The input audio: an upload of the caller (`upload:<sha256>.<ext>` as
    /// `POST /v1/uploads` answers it, which the submit resolves, or its URI in one of the
    /// configured stores), or, where the operator allows external audio, an `https://`
    /// URL of an allowed public host.
    #[schemars(length(min = 1, max = MAX_URI_LEN), regex(pattern = r"^[A-Za-z][A-Za-z0-9+.\-]*:\S+$"))]
    #[schemars(example = &"upload:5d41402abc4b2a76b9719d911017c592c5b8e8a7f1c2b3d4e5f60718293a4b5c.wav")]
    pub audio_uri: String,
    /// The model to run; default `htdemucs`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<Model>,
    /// Produce only this stem and its complement (`no_<stem>`, or `minus_<stem>` with
    /// `other_method` `minus`, as Demucs names them): one of the model's sources.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "two_stems_schema")]
    pub two_stems: Option<String>,
    /// With `two_stems`: how the complement is made, `add` (default: `no_<stem>`, the sum
    /// of the other stems), `minus` (`minus_<stem>`, the mixture minus the stem) or
    /// `none` (not written).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub other_method: Option<OtherMethod>,
    /// Container of the stems: `wav` (default), `flac` or `mp3`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_format: Option<OutputFormat>,
    /// With `output_format` `mp3`: the constant bit rate in kbit/s, one of 32, 40, 48, 56,
    /// 64, 80, 96, 112, 128, 160, 192, 224, 256, 320; default 320 (Demucs's
    /// `--mp3-bitrate`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "mp3_bitrate_schema")]
    pub mp3_bitrate: Option<u32>,
    /// With `output_format` `mp3`: the encoder preset, 2 (best quality, the default) to 7
    /// (fastest) (Demucs's `--mp3-preset`, LAME's quality).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = *MP3_PRESETS.start(), max = *MP3_PRESETS.end()))]
    pub mp3_preset: Option<u32>,
    /// Sample encoding: `s16` (default), `s24`, `f32` (WAV only; MP3 takes only `s16`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encoding: Option<Encoding>,
    /// Clipping: `rescale` (default), `clamp`, `none`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clip_mode: Option<ClipMode>,
    /// Segment length in seconds; default the model's own (7.8 s for HTDemucs, which is
    /// also the most it takes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("exclusiveMinimum" = 0.0))]
    pub segment: Option<f64>,
    /// Overlap between segments, in [0, 1); default 0.25.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0), extend("exclusiveMaximum" = 1.0))]
    pub overlap: Option<f64>,
    /// Number of random shifts averaged (test-time augmentation); default 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(max = MAX_SHIFTS))]
    pub shifts: Option<u32>,
    /// Where to send notifications. Not part of the job id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub webhook: Option<Webhook>,
    /// Free JSON kept with the job (an object of at most 16 KiB). Not part of the job id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<Map<String, Value>>")]
    pub metadata: Option<Value>,
    /// RFC 3339 deadline: a job not started by then becomes `expired` and never runs.
    /// Not part of the job id (it does not change the output).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_before: Option<chrono::DateTime<chrono::Utc>>,
    /// Time limit of one attempt in seconds (1 to 86400); the worker's own hard limit
    /// still applies (the smaller wins). Not part of the job id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = MAX_RUNTIME_S))]
    pub max_runtime: Option<u64>,
    /// Lane: `interactive` (the HTTP default, or the API key's own default) or `batch`,
    /// which runs only when no interactive job of the same model waits. Not part of the
    /// job id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<Priority>,
}

/// The canonical form of a request: what the output depends on, with defaults filled
/// in. Its JCS serialisation hashes to the job id.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NormalizedRequest {
    /// The input audio URI, as given (an `upload:` name given to the submit APIs is
    /// stored as the URI of the upload in the store).
    pub audio_uri: String,
    /// The model.
    pub model: Model,
    /// The one stem asked for, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub two_stems: Option<String>,
    /// How the complement is made; absent means `add` (and always absent without
    /// `two_stems`, where it changes nothing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub other_method: Option<OtherMethod>,
    /// Container of the stems.
    pub output_format: OutputFormat,
    /// The MP3 bit rate in kbit/s: present exactly when `output_format` is `mp3` (the
    /// default written out), so the canonical form of other requests is unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mp3_bitrate: Option<u32>,
    /// The MP3 encoder preset: present exactly when `output_format` is `mp3`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mp3_preset: Option<u32>,
    /// Sample encoding.
    pub encoding: Encoding,
    /// Clipping.
    pub clip_mode: ClipMode,
    /// Segment length in seconds; absent means the model's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub segment: Option<f64>,
    /// Overlap between segments.
    pub overlap: f64,
    /// Random shifts.
    pub shifts: u32,
    /// Who asked (API key owner / tenant).
    pub owner: String,
    /// The job this one re-runs (`stemq dlq replay`, retry): part of the key, so a
    /// re-run gets a new id, and re-running the same job twice gets the same one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_of: Option<JobId>,
}

impl JobRequest {
    /// Parses and validates a request body, naming the offending field on error.
    pub fn from_slice(body: &[u8]) -> Result<JobRequest, RequestError> {
        let value: Value =
            serde_json::from_slice(body).map_err(|e| RequestError::new("body", format!("not valid JSON: {e}")))?;
        JobRequest::from_value(value)
    }

    /// Validates a parsed JSON document as a request.
    pub fn from_value(value: Value) -> Result<JobRequest, RequestError> {
        let Value::Object(map) = value else {
            return Err(RequestError::new("body", "expected a JSON object"));
        };
        if !map.contains_key("audio_uri") {
            return Err(RequestError::new("audio_uri", "is required"));
        }
        // Field by field, so the error names the field; serde's message says what the
        // field's type accepts (unknown fields are refused here too, by
        // `deny_unknown_fields`, with the known ones listed).
        for (field, value) in &map {
            check_field(field, value)?;
        }
        let req: JobRequest =
            serde_json::from_value(Value::Object(map)).map_err(|e| RequestError::new("body", e.to_string()))?;
        req.normalize(ANONYMOUS)?;
        Ok(req)
    }

    /// The model asked for, or the default.
    pub fn model(&self) -> Model {
        self.model.unwrap_or(Model::Htdemucs)
    }

    /// Validates the request and returns its canonical form for `owner`.
    pub fn normalize(&self, owner: &str) -> Result<NormalizedRequest, RequestError> {
        let model = self.model();
        let uri = self.audio_uri.trim();
        if uri.is_empty() {
            return Err(RequestError::new("audio_uri", "must not be empty"));
        }
        if uri.len() > MAX_URI_LEN {
            return Err(RequestError::new("audio_uri", format!("longer than {MAX_URI_LEN} bytes")));
        }
        if uri != self.audio_uri {
            return Err(RequestError::new("audio_uri", "must not start or end with whitespace"));
        }
        if let Err(e) = url::Url::parse(uri) {
            return Err(RequestError::new("audio_uri", format!("not an absolute URI: {e}")));
        }
        if let Some(stem) = &self.two_stems {
            if !model.sources().contains(&stem.as_str()) {
                return Err(RequestError::new(
                    "two_stems",
                    format!("`{stem}` is not a source of {model}; expected one of {}", model.sources().join(", ")),
                ));
            }
        }
        let other_method = match (&self.two_stems, self.other_method) {
            (None, Some(m)) if m != OtherMethod::Add => {
                return Err(RequestError::new("other_method", "only applies with `two_stems`"));
            }
            (Some(_), Some(m)) if m != OtherMethod::Add => Some(m),
            // The default is left out of the canonical form, so ids of requests that
            // never named it do not change.
            _ => None,
        };
        let segment = match self.segment {
            None => None,
            Some(s) if !s.is_finite() || s <= 0.0 => {
                return Err(RequestError::new("segment", "must be a positive number of seconds"));
            }
            Some(s) => match model.max_segment() {
                Some(max) if s > max => {
                    return Err(RequestError::new(
                        "segment",
                        format!("{s} s is longer than {model} was trained on ({max} s)"),
                    ));
                }
                // An explicit default is the default.
                Some(max) if s == max => None,
                _ => Some(s),
            },
        };
        let overlap = self.overlap.unwrap_or(0.25);
        if !(0.0..1.0).contains(&overlap) {
            return Err(RequestError::new("overlap", "must be in [0, 1)"));
        }
        let output_format = self.output_format.unwrap_or_default();
        let encoding = self.encoding.unwrap_or_default();
        if encoding == Encoding::F32 && output_format == OutputFormat::Flac {
            return Err(RequestError::new("encoding", "FLAC has no float encoding; use s16 or s24, or wav"));
        }
        let (mp3_bitrate, mp3_preset) = if output_format == OutputFormat::Mp3 {
            if encoding != Encoding::S16 {
                return Err(RequestError::new(
                    "encoding",
                    "MP3 has no choice of sample encoding; leave `encoding` out (or s16), or use wav or flac",
                ));
            }
            let bitrate = self.mp3_bitrate.unwrap_or(DEFAULT_MP3_BITRATE);
            if !MP3_BITRATES.contains(&bitrate) {
                let list = MP3_BITRATES.iter().map(|b| b.to_string()).collect::<Vec<_>>().join(", ");
                return Err(RequestError::new("mp3_bitrate", format!("{bitrate} is not one of {list} (kbit/s)")));
            }
            let preset = self.mp3_preset.unwrap_or(DEFAULT_MP3_PRESET);
            if !MP3_PRESETS.contains(&preset) {
                return Err(RequestError::new(
                    "mp3_preset",
                    format!(
                        "must be {} (best quality) to {} (fastest), not {preset}",
                        MP3_PRESETS.start(),
                        MP3_PRESETS.end()
                    ),
                ));
            }
            // Written out with their defaults: MP3 requests are new, so no earlier id
            // depends on their absence.
            (Some(bitrate), Some(preset))
        } else {
            // As with `other_method`: a default that changes nothing is harmless, any
            // other value asks for something this format does not do.
            for (field, value, default) in [
                ("mp3_bitrate", self.mp3_bitrate, DEFAULT_MP3_BITRATE),
                ("mp3_preset", self.mp3_preset, DEFAULT_MP3_PRESET),
            ] {
                if value.is_some_and(|v| v != default) {
                    return Err(RequestError::new(field, "only applies with `output_format` mp3"));
                }
            }
            (None, None)
        };
        let shifts = self.shifts.unwrap_or(0);
        if shifts > MAX_SHIFTS {
            return Err(RequestError::new("shifts", format!("at most {MAX_SHIFTS}")));
        }
        if let Some(w) = &self.webhook {
            if w.url.trim().is_empty() {
                return Err(RequestError::new("webhook", "`url` must not be empty"));
            }
            for e in &w.events {
                if !["started", "progress", "completed"].contains(&e.as_str()) {
                    return Err(RequestError::new(
                        "webhook",
                        format!("unknown event `{e}`; expected started, progress or completed"),
                    ));
                }
            }
        }
        if let Some(m) = &self.metadata {
            if !m.is_object() {
                return Err(RequestError::new("metadata", "must be a JSON object"));
            }
            if serde_json::to_vec(m).map(|v| v.len()).unwrap_or(usize::MAX) > MAX_METADATA_BYTES {
                return Err(RequestError::new("metadata", format!("larger than {MAX_METADATA_BYTES} bytes")));
            }
        }
        if let Some(m) = self.max_runtime {
            if m == 0 || m > MAX_RUNTIME_S {
                return Err(RequestError::new("max_runtime", format!("must be between 1 and {MAX_RUNTIME_S} seconds")));
            }
        }
        if owner.is_empty() {
            return Err(RequestError::new("owner", "must not be empty"));
        }
        Ok(NormalizedRequest {
            audio_uri: self.audio_uri.clone(),
            model,
            two_stems: self.two_stems.clone(),
            other_method,
            output_format,
            mp3_bitrate,
            mp3_preset,
            encoding,
            clip_mode: self.clip_mode.unwrap_or_default(),
            segment,
            overlap,
            shifts,
            owner: owner.to_string(),
            retry_of: None,
        })
    }
}

/// Reads `field` alone (beside a placeholder `audio_uri`) as a [`JobRequest`], so a
/// type error, an unknown enum value or an unknown field is reported under its name.
fn check_field(field: &str, value: &Value) -> Result<(), RequestError> {
    // chrono's own message ("input contains invalid characters") does not say what a
    // timestamp should look like.
    if let ("start_before", Value::String(s)) = (field, value) {
        if let Err(e) = chrono::DateTime::parse_from_rfc3339(s) {
            return Err(RequestError::new(field, format!("not an RFC 3339 timestamp: {e}")));
        }
    }
    let mut one = Map::new();
    one.insert("audio_uri".into(), Value::String(String::new()));
    one.insert(field.into(), value.clone());
    serde_json::from_value::<JobRequest>(Value::Object(one))
        .map(drop)
        .map_err(|e| RequestError::new(field, e.to_string()))
}

impl NormalizedRequest {
    /// The RFC 8785 canonical JSON of this request: the bytes that are hashed.
    pub fn canonical_json(&self) -> Vec<u8> {
        super::canonical::to_vec(self).expect("a normalized request always serialises")
    }

    /// The job id: lowercase hex SHA-256 of [`Self::canonical_json`].
    pub fn job_id(&self) -> JobId {
        JobId::of_canonical(&self.canonical_json())
    }

    /// Checks a recorded request (with the parts of its `requested` event that are not
    /// in the id) as the ingress would have: valid, and exactly in normalised form.
    ///
    /// A worker calls this on every delivery, since a raw publisher bypasses the
    /// ingress. The error names the offending field; a request that is valid but not as
    /// [`JobRequest::normalize`] would have written it is refused under `request`.
    pub fn revalidate(
        &self,
        webhook: Option<&Webhook>,
        metadata: Option<&Value>,
        max_runtime: Option<u64>,
    ) -> Result<(), RequestError> {
        let NormalizedRequest {
            audio_uri,
            model,
            two_stems,
            other_method,
            output_format,
            mp3_bitrate,
            mp3_preset,
            encoding,
            clip_mode,
            segment,
            overlap,
            shifts,
            owner,
            retry_of,
        } = self;
        let as_sent = JobRequest {
            audio_uri: audio_uri.clone(),
            model: Some(*model),
            two_stems: two_stems.clone(),
            other_method: *other_method,
            output_format: Some(*output_format),
            mp3_bitrate: *mp3_bitrate,
            mp3_preset: *mp3_preset,
            encoding: Some(*encoding),
            clip_mode: Some(*clip_mode),
            segment: *segment,
            overlap: Some(*overlap),
            shifts: Some(*shifts),
            webhook: webhook.cloned(),
            metadata: metadata.cloned(),
            // Checked against the clock at submit only; a recorded deadline may have
            // passed since (the worker then records `expired`).
            start_before: None,
            max_runtime,
            priority: None,
        };
        let mut normalised = as_sent.normalize(owner)?;
        normalised.retry_of = retry_of.clone();
        if &normalised != self {
            return Err(RequestError::new(
                "request",
                "not in normalised form (defaults must be written out as the ingress does)",
            ));
        }
        Ok(())
    }

    /// The stems this request produces, in order. With `two_stems`, the complement is
    /// named as Demucs names it: `no_<stem>` for `add`, `minus_<stem>` for `minus`.
    ///
    /// Jobs that ran before `minus_` was adopted stored their complement as
    /// `no_<stem>`: their views and manifests keep that name (they are facts), and
    /// nothing recomputes an old job's names from its request.
    pub fn stems(&self) -> Vec<String> {
        match (&self.two_stems, self.other_method) {
            (Some(s), Some(OtherMethod::None)) => vec![s.clone()],
            (Some(s), Some(OtherMethod::Minus)) => vec![s.clone(), format!("minus_{s}")],
            (Some(s), _) => vec![s.clone(), format!("no_{s}")],
            (None, _) => self.model.sources().iter().map(|s| s.to_string()).collect(),
        }
    }
}

/// Helper for building request documents in tests and tools.
pub fn request_json(audio_uri: &str) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("audio_uri".into(), Value::String(audio_uri.into()));
    m
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn normalized(v: Value) -> NormalizedRequest {
        JobRequest::from_value(v).unwrap().normalize(ANONYMOUS).unwrap()
    }

    #[test]
    fn given_a_normalised_request_when_revalidated_then_it_passes() {
        let n = normalized(json!({"audio_uri": "file:///a.wav", "two_stems": "vocals", "other_method": "minus"}));
        let hook = Webhook { url: "https://example.com/h".into(), events: vec!["completed".into()] };
        assert_eq!(n.revalidate(Some(&hook), Some(&json!({"k": 1})), Some(60)), Ok(()));
        let mut retry = n.clone();
        retry.retry_of = Some(n.job_id());
        assert_eq!(retry.revalidate(None, None, None), Ok(()));
    }

    #[test]
    fn given_an_invalid_part_when_revalidated_then_the_field_is_named() {
        let n = normalized(json!({"audio_uri": "file:///a.wav"}));
        let mut bad = n.clone();
        bad.audio_uri = " file:///a.wav ".into();
        assert_eq!(bad.revalidate(None, None, None).unwrap_err().field, "audio_uri");
        bad = n.clone();
        bad.overlap = 1.5;
        assert_eq!(bad.revalidate(None, None, None).unwrap_err().field, "overlap");
        assert_eq!(n.revalidate(None, Some(&json!([1])), None).unwrap_err().field, "metadata");
        assert_eq!(n.revalidate(None, None, Some(0)).unwrap_err().field, "max_runtime");
        bad = n.clone();
        bad.owner = String::new();
        assert_eq!(bad.revalidate(None, None, None).unwrap_err().field, "owner");
    }

    #[test]
    fn given_a_valid_but_unnormalised_request_when_revalidated_then_it_is_refused() {
        let mut n = normalized(json!({"audio_uri": "file:///a.wav"}));
        // The model's own segment length is the default, written as absent.
        n.segment = n.model.max_segment();
        assert!(n.segment.is_some());
        let e = n.revalidate(None, None, None).unwrap_err();
        assert_eq!(e.field, "request", "{e}");
    }

    fn id_of(v: Value) -> JobId {
        JobRequest::from_value(v).unwrap().normalize(ANONYMOUS).unwrap().job_id()
    }

    #[test]
    fn key_order_whitespace_and_explicit_defaults_share_an_id() {
        let a = id_of(json!({"audio_uri": "file:///a.wav", "model": "htdemucs"}));
        let b: Value = serde_json::from_str(
            r#"{ "overlap" : 0.25, "shifts": 0,  "output_format":"wav", "segment": 7.8, "encoding": "s16", "clip_mode": "rescale",
                 "model":"htdemucs", "audio_uri":"file:///a.wav" }"#,
        )
        .unwrap();
        assert_eq!(a, id_of(b));
        assert_eq!(a, id_of(json!({"audio_uri": "file:///a.wav"})));
        // webhook, metadata and the deadlines are not part of the key
        assert_eq!(
            a,
            id_of(json!({"audio_uri": "file:///a.wav", "metadata": {"x": 1},
                         "webhook": {"url": "https://example.com/h"},
                         "start_before": "2030-01-01T00:00:00Z", "max_runtime": 60}))
        );
    }

    #[test]
    fn what_the_output_depends_on_changes_the_id() {
        let base = id_of(json!({"audio_uri": "file:///a.wav"}));
        for v in [
            json!({"audio_uri": "file:///b.wav"}),
            json!({"audio_uri": "file:///a.wav", "model": "htdemucs_ft"}),
            json!({"audio_uri": "file:///a.wav", "two_stems": "vocals"}),
            json!({"audio_uri": "file:///a.wav", "output_format": "flac"}),
            json!({"audio_uri": "file:///a.wav", "output_format": "mp3"}),
            json!({"audio_uri": "file:///a.wav", "encoding": "s24"}),
            json!({"audio_uri": "file:///a.wav", "clip_mode": "clamp"}),
            json!({"audio_uri": "file:///a.wav", "segment": 6.0}),
            json!({"audio_uri": "file:///a.wav", "overlap": 0.5}),
            json!({"audio_uri": "file:///a.wav", "shifts": 1}),
        ] {
            assert_ne!(base, id_of(v.clone()), "{v}");
        }
        let req = JobRequest::from_value(json!({"audio_uri": "file:///a.wav"})).unwrap();
        assert_ne!(req.normalize("alice").unwrap().job_id(), req.normalize("bob").unwrap().job_id());
    }

    #[test]
    fn canonical_json_is_jcs() {
        let req = JobRequest::from_value(json!({"audio_uri": "file:///a.wav", "segment": 5.0})).unwrap();
        let n = req.normalize(ANONYMOUS).unwrap();
        assert_eq!(
            String::from_utf8(n.canonical_json()).unwrap(),
            r#"{"audio_uri":"file:///a.wav","clip_mode":"rescale","encoding":"s16","model":"htdemucs","output_format":"wav","overlap":0.25,"owner":"anonymous","segment":5,"shifts":0}"#
        );
        // The documented example in docs/job-id.md.
        assert_eq!(n.job_id().as_str(), "542ebe90ff7f7b97334d77cb5a4d19f44862779d40f2a7724461aa270fbef4d0");
    }

    #[test]
    fn invalid_requests_name_the_field() {
        let cases = [
            (json!([1]), "body"),
            (json!({}), "audio_uri"),
            (json!({"audio_uri": ""}), "audio_uri"),
            (json!({"audio_uri": 3}), "audio_uri"),
            (json!({"audio_uri": "not a uri"}), "audio_uri"),
            (json!({"audio_uri": "file:///a", "model": "spleeter"}), "model"),
            (json!({"audio_uri": "file:///a", "two_stems": "guitar"}), "two_stems"),
            (json!({"audio_uri": "file:///a", "model": "htdemucs_6s", "two_stems": "kazoo"}), "two_stems"),
            (json!({"audio_uri": "file:///a", "segment": 9.0}), "segment"),
            (json!({"audio_uri": "file:///a", "segment": -1}), "segment"),
            (json!({"audio_uri": "file:///a", "overlap": 1.0}), "overlap"),
            (json!({"audio_uri": "file:///a", "shifts": -1}), "shifts"),
            (json!({"audio_uri": "file:///a", "shifts": 99}), "shifts"),
            (json!({"audio_uri": "file:///a", "output_format": "ogg"}), "output_format"),
            (json!({"audio_uri": "file:///a", "output_format": "mp3", "mp3_bitrate": 300}), "mp3_bitrate"),
            (json!({"audio_uri": "file:///a", "output_format": "mp3", "mp3_bitrate": -1}), "mp3_bitrate"),
            (json!({"audio_uri": "file:///a", "output_format": "mp3", "mp3_bitrate": "320k"}), "mp3_bitrate"),
            (json!({"audio_uri": "file:///a", "output_format": "mp3", "mp3_preset": 1}), "mp3_preset"),
            (json!({"audio_uri": "file:///a", "output_format": "mp3", "mp3_preset": 8}), "mp3_preset"),
            (json!({"audio_uri": "file:///a", "output_format": "mp3", "encoding": "s24"}), "encoding"),
            (json!({"audio_uri": "file:///a", "output_format": "mp3", "encoding": "f32"}), "encoding"),
            (json!({"audio_uri": "file:///a", "mp3_bitrate": 192}), "mp3_bitrate"),
            (json!({"audio_uri": "file:///a", "output_format": "flac", "mp3_preset": 7}), "mp3_preset"),
            (json!({"audio_uri": "file:///a", "metadata": [1]}), "metadata"),
            (json!({"audio_uri": "file:///a", "webhook": {"url": "https://x", "events": ["x"]}}), "webhook"),
            (json!({"audio_uri": "file:///a", "colour": "red"}), "colour"),
            (json!({"audio_uri": "file:///a", "start_before": "tomorrow"}), "start_before"),
            (json!({"audio_uri": "file:///a", "start_before": 5}), "start_before"),
            (json!({"audio_uri": "file:///a", "max_runtime": 0}), "max_runtime"),
            (json!({"audio_uri": "file:///a", "max_runtime": -3}), "max_runtime"),
            (json!({"audio_uri": "file:///a", "max_runtime": 90000}), "max_runtime"),
            (json!({"audio_uri": "file:///a", "shifts": 1u64 << 32}), "shifts"),
            (json!({"audio_uri": "file:///a", "segment": "long"}), "segment"),
            (json!({"audio_uri": "file:///a", "two_stems": 3}), "two_stems"),
            (json!({"audio_uri": "file:///a", "webhook": {"url": "https://x", "colour": 1}}), "webhook"),
            (json!({"audio_uri": "file:///a", "encoding": 16}), "encoding"),
            (json!({"audio_uri": "file:///a", "encoding": "f32", "output_format": "flac"}), "encoding"),
        ];
        for (v, field) in cases {
            let err = JobRequest::from_value(v.clone()).expect_err(&v.to_string());
            assert_eq!(err.field, field, "{v}: {err}");
        }
        assert!(JobRequest::from_value(
            json!({"audio_uri": "file:///a", "model": "htdemucs_6s", "two_stems": "guitar"})
        )
        .is_ok());
    }

    /// Every enum-valued field refuses an unknown value under its own name, listing the
    /// accepted values the enum itself has.
    #[test]
    fn bad_enum_values_name_their_field_and_the_accepted_values() {
        let fields = [
            ("model", Model::ALL.iter().map(|v| v.as_str()).collect::<Vec<_>>()),
            ("output_format", OutputFormat::ALL.iter().map(|v| v.as_str()).collect::<Vec<_>>()),
            ("encoding", Encoding::ALL.iter().map(|v| v.as_str()).collect::<Vec<_>>()),
            ("clip_mode", ClipMode::ALL.iter().map(|v| v.as_str()).collect::<Vec<_>>()),
            ("other_method", OtherMethod::ALL.iter().map(|v| v.as_str()).collect::<Vec<_>>()),
        ];
        for (field, accepted) in fields {
            let mut v = json!({"audio_uri": "file:///a", "two_stems": "vocals"});
            v[field] = json!("s32");
            let err = JobRequest::from_value(v.clone()).expect_err(&v.to_string());
            assert_eq!(err.field, field, "{v}: {err}");
            assert!(err.message.contains("`s32`"), "{field}: {}", err.message);
            for name in accepted {
                assert!(err.message.contains(&format!("`{name}`")), "{field}: `{name}` missing from {}", err.message);
            }
        }
        // And through the body parser the ingress uses.
        let err = JobRequest::from_slice(br#"{"audio_uri": "file:///a", "encoding": "s32"}"#).unwrap_err();
        assert_eq!(err.field, "encoding");
    }

    #[test]
    fn null_options_are_absent() {
        let plain = id_of(json!({"audio_uri": "file:///a.wav"}));
        for field in [
            "model",
            "output_format",
            "encoding",
            "clip_mode",
            "other_method",
            "segment",
            "shifts",
            "mp3_bitrate",
            "mp3_preset",
        ] {
            let mut v = json!({"audio_uri": "file:///a.wav"});
            v[field] = Value::Null;
            assert_eq!(id_of(v), plain, "{field}");
        }
    }

    #[test]
    fn a_bad_start_before_says_what_a_timestamp_looks_like() {
        let ok = json!({"audio_uri": "file:///a", "start_before": "2030-01-01T00:00:00Z"});
        assert!(JobRequest::from_value(ok).is_ok());
        let err = JobRequest::from_value(json!({"audio_uri": "file:///a", "start_before": "tomorrow"})).unwrap_err();
        assert_eq!(err.field, "start_before");
        assert!(err.message.contains("RFC 3339"), "{}", err.message);
    }

    #[test]
    fn stems_follow_model_and_two_stems() {
        let r = JobRequest::from_value(json!({"audio_uri": "file:///a", "two_stems": "vocals"})).unwrap();
        assert_eq!(r.normalize(ANONYMOUS).unwrap().stems(), ["vocals", "no_vocals"]);
        let r = JobRequest::from_value(json!({"audio_uri": "file:///a", "model": "htdemucs_6s"})).unwrap();
        assert_eq!(r.normalize(ANONYMOUS).unwrap().stems().len(), 6);
        let r = JobRequest::from_value(json!({"audio_uri": "file:///a", "two_stems": "drums", "other_method": "none"}))
            .unwrap();
        assert_eq!(r.normalize(ANONYMOUS).unwrap().stems(), ["drums"]);
    }

    /// demucs 4.1.0's `separate.py` names the complement `no_<stem>` for
    /// `--other-method add` and `minus_<stem>` for `--other-method minus`.
    #[test]
    fn the_complement_is_named_as_demucs_names_it() {
        let two = |m: &str| {
            let v = json!({"audio_uri": "file:///a", "two_stems": "bass", "other_method": m});
            JobRequest::from_value(v).unwrap().normalize(ANONYMOUS).unwrap().stems()
        };
        assert_eq!(two("add"), ["bass", "no_bass"]);
        assert_eq!(two("minus"), ["bass", "minus_bass"]);
        assert_eq!(two("none"), ["bass"]);
    }

    #[test]
    fn mp3_options_are_written_out_for_mp3_and_absent_otherwise() {
        // The defaults are written out, in the canonical form and so in the id.
        let mp3 = normalized(json!({"audio_uri": "file:///a.wav", "output_format": "mp3"}));
        assert_eq!((mp3.mp3_bitrate, mp3.mp3_preset), (Some(320), Some(2)));
        assert_eq!(
            String::from_utf8(mp3.canonical_json()).unwrap(),
            r#"{"audio_uri":"file:///a.wav","clip_mode":"rescale","encoding":"s16","model":"htdemucs","mp3_bitrate":320,"mp3_preset":2,"output_format":"mp3","overlap":0.25,"owner":"anonymous","shifts":0}"#
        );
        // Pinned, as docs/job-id.md shows it.
        assert_eq!(mp3.job_id().as_str(), "aa6a936346a382c894b2a911ccf98916f8f819450885ac82e1154abd577801cd");
        let explicit = json!({"audio_uri": "file:///a.wav", "output_format": "mp3", "mp3_bitrate": 320,
                              "mp3_preset": 2, "encoding": "s16"});
        assert_eq!(id_of(explicit), mp3.job_id());
        // Each option changes the output, so the id.
        for v in [
            json!({"audio_uri": "file:///a.wav", "output_format": "mp3", "mp3_bitrate": 192}),
            json!({"audio_uri": "file:///a.wav", "output_format": "mp3", "mp3_preset": 7}),
        ] {
            assert_ne!(id_of(v.clone()), mp3.job_id(), "{v}");
        }
        assert_eq!(mp3.revalidate(None, None, None), Ok(()));
        // Other formats: absent, so ids of requests from before MP3 stay as they were
        // (the pinned example of `canonical_json_is_jcs` is one), and an explicit
        // default is harmless.
        let wav = normalized(json!({"audio_uri": "file:///a.wav", "mp3_bitrate": 320, "mp3_preset": 2}));
        assert_eq!((wav.mp3_bitrate, wav.mp3_preset), (None, None));
        assert_eq!(wav.job_id(), id_of(json!({"audio_uri": "file:///a.wav"})));
        assert!(!String::from_utf8(wav.canonical_json()).unwrap().contains("mp3"));
        // A recorded request must hold them exactly when the format is MP3.
        let mut bad = wav.clone();
        bad.mp3_bitrate = Some(320);
        assert_eq!(bad.revalidate(None, None, None).unwrap_err().field, "request");
        let mut bad = mp3.clone();
        bad.mp3_preset = None;
        assert_eq!(bad.revalidate(None, None, None).unwrap_err().field, "request");
        let mut bad = mp3;
        bad.mp3_bitrate = Some(300);
        assert_eq!(bad.revalidate(None, None, None).unwrap_err().field, "mp3_bitrate");
    }

    #[test]
    fn other_method_is_part_of_the_key_except_its_default() {
        let two = |m: Option<&str>| {
            let mut v = json!({"audio_uri": "file:///a.wav", "two_stems": "vocals"});
            if let Some(m) = m {
                v["other_method"] = json!(m);
            }
            id_of(v)
        };
        assert_eq!(two(None), two(Some("add")));
        assert_ne!(two(None), two(Some("minus")));
        assert_ne!(two(Some("minus")), two(Some("none")));
        // Without two_stems the default is harmless, anything else is refused.
        assert_eq!(
            id_of(json!({"audio_uri": "file:///a.wav"})),
            id_of(json!({"audio_uri": "file:///a.wav", "other_method": "add"}))
        );
        let e = JobRequest::from_value(json!({"audio_uri": "file:///a.wav", "other_method": "minus"})).unwrap_err();
        assert_eq!(e.field, "other_method");
        let e =
            JobRequest::from_value(json!({"audio_uri": "file:///a.wav", "two_stems": "vocals", "other_method": "x"}))
                .unwrap_err();
        assert_eq!(e.field, "other_method");
        assert!(e.message.contains("`add`, `minus`, `none`"), "{}", e.message);
    }
}
