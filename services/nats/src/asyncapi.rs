//! The AsyncAPI 3.0 document of stemq's NATS side: what another service may publish,
//! read and watch, served at `/asyncapi.json` and checked in as `schemas/asyncapi.json`.
//!
//! This module owns how the NATS contract is described; it writes down nothing the code
//! already says. Each channel's address is made by the subject functions
//! ([`crate::request_subject`], [`crate::job_subject`], the batch log's) for sample
//! values, whose tokens then become the channel's parameters; its stream is the one whose
//! subjects (`nats/streams/`) match it; the message schemas are schemars' schemas of the
//! event, request and view types (JSON Schema draft-07, the dialect AsyncAPI schemas
//! build on), each event type's payload being the CloudEvents envelope with that type's
//! `type` and `data`; and who may publish, subscribe to or read each channel is worked
//! out from the permissions of `nats/users.json` ([`crate::users`]). The submit
//! endpoint's reply schema comes from the ingress, whose answer types it is
//! (`stemq_ingress::asyncapi`, which also checks the checked-in copy). What is said here
//! by hand: which event types go on which subject, and what the headers mean.

use schemars::generate::{SchemaGenerator, SchemaSettings};
use schemars::JsonSchema;
use serde_json::{json, Map, Value};
use stemq_core::batch::{BatchEvent, BatchId};
use stemq_core::event::Event;
use stemq_core::request::{owner_token, JobId, JobRequest, Model, Priority};
use stemq_core::view::JobView;

use crate::batch_log::{batch_subject, member_subject, BatchSubject, Membership};
use crate::users::{roles, User};
use crate::{
    job_subject, request_subject, stream_configs, unrouted_request_subject, Settings, SubjectKind, JOBS_BUCKET,
    SUBMIT_SUBJECT,
};

/// Where the message schemas go (`#/components/schemas/<name>`).
const DEFS: &str = "/components/schemas";

/// The sample values the subject functions are called with; each one's token in a
/// subject is a channel parameter.
struct Samples {
    job: JobId,
    batch: BatchId,
    owner: &'static str,
}

impl Samples {
    fn new() -> Samples {
        Samples {
            job: JobId::parse(&"0".repeat(64)).expect("a job id"),
            batch: BatchId::parse(&"1".repeat(64)).expect("a batch id"),
            owner: "ownerToken",
        }
    }

    /// (token in a sample subject, parameter name) for every parameter.
    fn tokens(&self) -> Vec<(String, &'static str)> {
        vec![
            (self.job.to_string(), "jobId"),
            (self.batch.to_string(), "batchId"),
            (owner_token(self.owner), "ownerToken"),
            (Model::ALL[0].to_string(), "model"),
            (Priority::ALL[0].to_string(), "lane"),
        ]
    }
}

/// A channel parameter: what it is and, where the code has a closed list, its values.
fn parameter(name: &str) -> Value {
    match name {
        "jobId" => json!({
            "description": "The job id: the lowercase hex SHA-256 of the JCS form of the normalised request \
                (64 hex digits; see docs/events.md, \"Job id\").",
            "examples": ["0".repeat(64)],
        }),
        "batchId" => json!({
            "description": "The batch id (64 lowercase hex digits).",
            "examples": ["1".repeat(64)],
        }),
        "ownerToken" => json!({
            "description": "The owner's token: the owner itself when it is 1 to 64 ASCII letters, digits, `-`, `_` \
                or `=` and does not start with `h-`, else `h-` and the lowercase hex SHA-256 of the owner \
                (docs/events.md, \"Owner tokens\"). A `publisher` user may publish only with its own.",
            "examples": [owner_token("acme"), owner_token("a.b")],
        }),
        "model" => json!({
            "description": "The request's model: the pool that runs it.",
            "enum": Model::ALL.iter().map(|m| m.to_string()).collect::<Vec<_>>(),
        }),
        "lane" => json!({
            "description": "The request's `priority` (`interactive` when it has none): the lane of its pool.",
            "enum": Priority::ALL.iter().map(|p| p.to_string()).collect::<Vec<_>>(),
        }),
        other => panic!("no parameter {other}"),
    }
}

/// What a channel's messages carry in their headers.
#[derive(Clone, Copy)]
enum Headers {
    /// A job's request: recorded once.
    Request,
    /// A job's terminal event: the first one wins.
    Outcome,
    /// Any other job event.
    Event,
    /// A batch's submission round: written after the round before it.
    BatchRound,
    /// A batch's one end.
    BatchEnd,
    /// A batch's webhook attempt.
    BatchDelivery,
    /// A batch membership, once per pair.
    Membership,
    /// A KV entry (stemq's own headers are none).
    None,
    /// The submit endpoint's request.
    Submit,
}

fn header(description: &str) -> Value {
    json!({"type": "string", "description": description})
}

impl Headers {
    fn schema(self) -> Option<Value> {
        let content_type = |t: &str| json!({"type": "string", "const": t, "description": "The body's media type."});
        let trace = header("W3C trace context of the request that caused the event; optional.");
        let (props, required): (Vec<(&str, Value)>, Vec<&str>) = match self {
            Headers::Request => (
                vec![
                    ("Content-Type", content_type("application/cloudevents+json")),
                    ("Nats-Msg-Id", header("The job id: the server drops a duplicate within its window.")),
                    (
                        "Nats-Expected-Last-Subject-Sequence",
                        json!({"type": "string", "const": "0",
                               "description": "`0`: the server refuses the request when the subject named by the \
                                   next header already holds one (\"wrong last sequence\": the job exists, which \
                                   is success)."}),
                    ),
                    (
                        "Nats-Expected-Last-Subject-Sequence-Subject",
                        header(
                            "`stemq.jobs.<job id>.requested.<owner token>.>`: the expectation holds over every \
                            request subject of the job and owner, in either lane.",
                        ),
                    ),
                    ("traceparent", trace),
                ],
                vec!["Nats-Msg-Id", "Nats-Expected-Last-Subject-Sequence"],
            ),
            Headers::Outcome => (
                vec![
                    ("Content-Type", content_type("application/cloudevents+json")),
                    ("Nats-Msg-Id", header("`<job id>.outcome`.")),
                    (
                        "Nats-Expected-Last-Subject-Sequence",
                        json!({"type": "string", "const": "0",
                               "description": "`0`: only the first terminal event of a job is stored."}),
                    ),
                    ("traceparent", trace),
                ],
                vec!["Nats-Msg-Id", "Nats-Expected-Last-Subject-Sequence"],
            ),
            Headers::Event => (
                vec![
                    ("Content-Type", content_type("application/cloudevents+json")),
                    ("Nats-Msg-Id", header("Set where a retried publish must not be recorded twice.")),
                    ("traceparent", trace),
                ],
                vec![],
            ),
            Headers::BatchRound => (
                vec![
                    ("Content-Type", content_type("application/cloudevents+json")),
                    ("Nats-Msg-Id", header("Unique per round.")),
                    (
                        "Nats-Expected-Last-Subject-Sequence",
                        header("The sequence of the round before (`0` for the first): rounds never cross."),
                    ),
                ],
                vec!["Nats-Msg-Id", "Nats-Expected-Last-Subject-Sequence"],
            ),
            Headers::BatchEnd => (
                vec![
                    ("Content-Type", content_type("application/cloudevents+json")),
                    ("Nats-Msg-Id", header("`<batch id>.ended`.")),
                    (
                        "Nats-Expected-Last-Subject-Sequence",
                        json!({"type": "string", "const": "0", "description": "`0`: a batch ends once."}),
                    ),
                ],
                vec!["Nats-Msg-Id", "Nats-Expected-Last-Subject-Sequence"],
            ),
            Headers::BatchDelivery => (
                vec![
                    ("Content-Type", content_type("application/cloudevents+json")),
                    ("Nats-Msg-Id", header("Unique per attempt.")),
                ],
                vec!["Nats-Msg-Id"],
            ),
            Headers::Membership => (
                vec![
                    ("Content-Type", content_type("application/json")),
                    ("Nats-Msg-Id", header("`<job id>.<batch id>`.")),
                ],
                vec!["Nats-Msg-Id"],
            ),
            Headers::None => return None,
            Headers::Submit => (
                vec![
                    (
                        "Authorization",
                        header(
                            "`Bearer sk_<key id>_<secret>`: an API key of the `submit` role or better (the \
                            same key as over HTTP; the job's owner is the key's).",
                        ),
                    ),
                    ("traceparent", header("W3C trace context; optional.")),
                ],
                vec![],
            ),
        };
        let properties: Map<String, Value> = props.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        Some(json!({"type": "object", "required": required, "properties": properties}))
    }
}

/// One channel: a subject family.
struct Channel {
    /// The channel's key.
    id: &'static str,
    /// A subject of the family, made by the code for the sample values.
    subject: String,
    /// Where it is stored (`None`: not stored, or found from `nats/streams/`).
    stream: Option<String>,
    description: &'static str,
    /// The messages: event types (`io.stemq.…`) or message keys.
    messages: Vec<&'static str>,
    headers: Headers,
    /// A request-reply channel: the reply's message key.
    reply: Option<&'static str>,
}

const REQUESTED: &str = "io.stemq.job.requested.v1";

/// Every channel, in the order the document lists them.
fn channels(s: &Samples) -> Vec<Channel> {
    let job = |id, kind, description, messages: Vec<&'static str>, headers| Channel {
        id,
        subject: job_subject(&s.job, kind),
        stream: None,
        description,
        messages,
        headers,
        reply: None,
    };
    let batch = |id, kind, description, messages: Vec<&'static str>, headers| Channel {
        id,
        subject: batch_subject(&s.batch, kind),
        stream: None,
        description,
        messages,
        headers,
        reply: None,
    };
    let kv_subject = format!("$KV.{JOBS_BUCKET}.{}", crate::view_key(Some(s.owner), &s.job));
    vec![
        Channel {
            id: "jobRequested",
            subject: request_subject(&s.job, s.owner, Model::ALL[0], Priority::ALL[0]),
            stream: None,
            description: "A job's request, routed to the pool of its model and lane (the consumer \
                `workers-<model>-<lane>`). One per job: publish it with the headers below. The event's `id` and \
                `subject` are the job id, `data.request` is the normalised request, its `owner` has the subject's \
                token, and its model and priority are the subject's; a request that breaks any of these is dropped \
                (never run), an invalid one is rejected. Where other services submit.",
            messages: vec![REQUESTED],
            headers: Headers::Request,
            reply: None,
        },
        Channel {
            id: "jobRequestedUnrouted",
            subject: unrouted_request_subject(&s.job, s.owner),
            stream: None,
            description: "A job's request without a route: still accepted from a publisher and read; the \
                ingress's router publishes it again on its routed subject (a hop more than `jobRequested`).",
            messages: vec![REQUESTED],
            headers: Headers::Request,
            reply: None,
        },
        job(
            "jobRequestedUntokened",
            SubjectKind::Requested,
            "A job's request as recorded before owner tokens: read and routed like the unrouted form; only the \
             `operator` may publish here.",
            vec![REQUESTED],
            Headers::Request,
        ),
        job(
            "jobStarted",
            SubjectKind::Started,
            "A worker took the job (one per delivery).",
            vec!["io.stemq.job.started.v1"],
            Headers::Event,
        ),
        job(
            "jobFailed",
            SubjectKind::Failed,
            "An attempt failed transiently (it is retried).",
            vec!["io.stemq.job.failed.v1"],
            Headers::Event,
        ),
        job(
            "jobOutcome",
            SubjectKind::Outcome,
            "The job's one terminal event: the server keeps the first and refuses any other. Read the first \
             message on the subject, never the latest.",
            vec![
                "io.stemq.job.succeeded.v1",
                "io.stemq.job.failed.v1",
                "io.stemq.job.dead_lettered.v1",
                "io.stemq.job.rejected.v1",
                "io.stemq.job.cancelled.v1",
                "io.stemq.job.expired.v1",
            ],
            Headers::Outcome,
        ),
        job(
            "jobRetried",
            SubjectKind::Retried,
            "The link from a finished job to the job that re-ran it.",
            vec!["io.stemq.job.retried.v1"],
            Headers::Event,
        ),
        job(
            "jobCancelRequested",
            SubjectKind::CancelRequested,
            "A cancel request; workers also listen here (a plain subscription) while they run the job.",
            vec!["io.stemq.job.cancel_requested.v1"],
            Headers::Event,
        ),
        job(
            "jobDelivery",
            SubjectKind::Delivery,
            "The relay's webhook delivery attempts, one per HTTP attempt.",
            vec!["io.stemq.job.delivery_attempted.v1"],
            Headers::Event,
        ),
        job(
            "jobDeliveryReplay",
            SubjectKind::DeliveryReplay,
            "Requests to send one webhook delivery again.",
            vec!["io.stemq.job.delivery_replay_requested.v1"],
            Headers::Event,
        ),
        job(
            "jobProgress",
            SubjectKind::Progress,
            "A running job's latest progress; the stream keeps one message per job (compacted).",
            vec!["io.stemq.job.progress.v1"],
            Headers::Event,
        ),
        Channel {
            id: "jobView",
            subject: kv_subject.clone(),
            stream: Some(format!("KV_{JOBS_BUCKET}")),
            description: "The put subject of a job's entry in the status view bucket (key = the owner's token and \
                the job id, value = the view, the document `GET /v1/separations/{id}` answers): every new revision \
                arrives here. To watch a job, subscribe, then get the current value (`jobViewGet`); stop at a \
                terminal status. The owner's `reader` and `publisher` users may read only their owner's keys; views \
                written before keys carried owners (or whose owner is unknown) are under the job id alone, for \
                `status-reader`.",
            messages: vec!["job.view"],
            headers: Headers::None,
            reply: None,
        },
        Channel {
            id: "jobViewGet",
            subject: format!("$JS.API.DIRECT.GET.KV_{JOBS_BUCKET}.{kv_subject}"),
            stream: None,
            description: "A direct get of a job's current view (what a NATS client's KV `get` sends, or a plain \
                request with an empty body): the reply is the view, or a 404 status header when the job is not \
                projected yet.",
            messages: vec!["empty"],
            headers: Headers::None,
            reply: Some("job.view"),
        },
        batch(
            "batchSubmitted",
            BatchSubject::Submitted,
            "A batch's submission rounds, each its whole state; the latest is the batch.",
            vec!["io.stemq.batch.submitted.v1"],
            Headers::BatchRound,
        ),
        batch(
            "batchEnded",
            BatchSubject::Ended,
            "The batch's end: its final view, once.",
            vec!["io.stemq.batch.ended.v1"],
            Headers::BatchEnd,
        ),
        batch(
            "batchDelivery",
            BatchSubject::Delivery,
            "Attempts at the batch's webhook.",
            vec!["io.stemq.batch.delivery_attempted.v1"],
            Headers::BatchDelivery,
        ),
        Channel {
            id: "batchJob",
            subject: member_subject(&s.job, &s.batch),
            stream: None,
            description: "Batch `batchId` holds job `jobId`; one message per pair, recorded before the round \
                that submits the job.",
            messages: vec!["batch.job"],
            headers: Headers::Membership,
            reply: None,
        },
        Channel {
            id: "submit",
            subject: SUBMIT_SUBJECT.to_string(),
            stream: None,
            description: "The request-reply submit endpoint (ingress instances share the queue group `ingress`): \
                the body of `POST /v1/separations`, an API key in the `Authorization` header; the reply is that \
                route's answer with `http_status`.",
            messages: vec!["submit.request"],
            headers: Headers::Submit,
            reply: Some("submit.reply"),
        },
    ]
}

/// A NATS subject pattern (`*`, `>`) matches `subject`.
fn matches(pattern: &str, subject: &str) -> bool {
    let (p, s): (Vec<&str>, Vec<&str>) = (pattern.split('.').collect(), subject.split('.').collect());
    for (i, t) in p.iter().enumerate() {
        if *t == ">" {
            return s.len() > i;
        }
        if i >= s.len() || (*t != "*" && *t != s[i]) {
            return false;
        }
    }
    p.len() == s.len()
}

/// Who may do what with a subject, from `nats/users.json`.
struct Access {
    /// May publish on it.
    publish: Vec<String>,
    /// May subscribe to it (a plain subscription).
    subscribe: Vec<String>,
    /// May read its stream (a direct get, a consumer or a message get by sequence).
    read: Vec<String>,
}

fn access(subject: &str, stream: Option<&str>, s: &Samples) -> Access {
    let mut a = Access { publish: vec![], subscribe: vec![], read: vec![] };
    for role in roles().expect("nats/users.json is valid") {
        let user = if role.per_owner { User::of_owner(&role.user, s.owner) } else { User::of_role(&role.user) };
        let name = if role.per_owner { format!("{}-{{ownerToken}}", role.user) } else { role.user.clone() };
        let Some(p) = user.permissions().expect("a known role") else {
            a.publish.push(name.clone());
            a.subscribe.push(name.clone());
            a.read.push(name);
            continue;
        };
        let any = |list: &[String], subject: &str| {
            list.iter().any(|allow| matches(allow.split_whitespace().next().unwrap_or_default(), subject))
        };
        if any(&p.publish.allow, subject) {
            a.publish.push(name.clone());
        }
        if any(&p.subscribe.allow, subject) {
            a.subscribe.push(name.clone());
        }
        if let Some(stream) = stream {
            let reads = [
                format!("$JS.API.DIRECT.GET.{stream}"),
                format!("$JS.API.DIRECT.GET.{stream}.{subject}"),
                format!("$JS.API.STREAM.MSG.GET.{stream}"),
                format!("$JS.API.CONSUMER.MSG.NEXT.{stream}.any"),
            ];
            if reads.iter().any(|r| any(&p.publish.allow, r)) {
                a.read.push(name);
            }
        }
    }
    a
}

/// The stream whose subjects (`nats/streams/`) take `subject`.
fn stream_of(subject: &str) -> Option<String> {
    stream_configs(&Settings::default())
        .expect("nats/streams is valid")
        .into_iter()
        .find(|c| c.subjects.iter().any(|p| matches(p, subject)))
        .map(|c| c.name)
}

/// `subject` with each sample token replaced by its `{parameter}`, and the parameters.
fn address(subject: &str, s: &Samples) -> (String, Vec<&'static str>) {
    let tokens = s.tokens();
    let mut params = Vec::new();
    let out: Vec<String> = subject
        .split('.')
        .map(|t| match tokens.iter().find(|(sample, _)| sample == t) {
            Some((_, name)) => {
                params.push(*name);
                format!("{{{name}}}")
            }
            None => t.to_string(),
        })
        .collect();
    (out.join("."), params)
}

/// The `oneOf` variants of an envelope type's schema as (event type, data schema), and
/// the envelope's own properties and required fields.
fn variants(def: &Value) -> (Vec<(String, Value)>, Map<String, Value>, Vec<Value>) {
    let types = def["oneOf"]
        .as_array()
        .expect("an event schema is one of its types")
        .iter()
        .map(|v| {
            let t = &v["properties"]["type"];
            let name = t["const"].as_str().or_else(|| t["enum"][0].as_str()).expect("a variant names its type");
            (name.to_string(), v["properties"]["data"].clone())
        })
        .collect();
    let props = def["properties"].as_object().cloned().unwrap_or_default();
    let required = def["required"].as_array().cloned().unwrap_or_default();
    (types, props, required)
}

/// The message key of an event type: `io.stemq.job.started.v1` → `job.started.v1`.
fn message_key(event_type: &str) -> &str {
    event_type.strip_prefix("io.stemq.").unwrap_or(event_type)
}

fn reference<T: JsonSchema>(g: &mut SchemaGenerator) -> Value {
    g.subschema_for::<T>().to_value()
}

/// The schema of the submit endpoint's reply, made by the ingress that answers it
/// (its answer and error types are its own), in the document's generator.
pub type ReplySchema = fn(&mut SchemaGenerator) -> Value;

/// The document, with `submit_reply` as the submit endpoint's reply.
pub fn document(submit_reply: ReplySchema) -> Value {
    let s = Samples::new();
    let mut g = SchemaSettings::draft07()
        .with(|x| {
            x.meta_schema = None;
            x.definitions_path = DEFS.into();
        })
        .into_generator();
    reference::<Event>(&mut g);
    reference::<BatchEvent>(&mut g);
    let view = reference::<JobView>(&mut g);
    let request = reference::<JobRequest>(&mut g);
    let membership = reference::<Membership>(&mut g);
    let reply = submit_reply(&mut g);
    let mut schemas = g.take_definitions(true);
    let envelope = |name: &str, schemas: &mut Map<String, Value>| {
        let def = schemas.remove(name).expect("the envelope's schema");
        let (types, props, required) = variants(&def);
        schemas.remove(&format!("{name}Body"));
        (types, props, required)
    };
    // Message key → (title, media type, payload schema).
    let mut messages: Map<String, Value> = Map::new();
    for (kind, name) in [("job", "Event"), ("batch", "BatchEvent")] {
        let (types, props, required) = envelope(name, &mut schemas);
        for (event_type, data) in types {
            let mut properties = props.clone();
            properties.insert("type".into(), json!({"type": "string", "const": event_type}));
            properties.insert("data".into(), data);
            let mut required = required.clone();
            required.extend([json!("type"), json!("data")]);
            schemas.insert(
                event_type.clone(),
                json!({
                    "description": format!("A {kind} event of type `{event_type}` (CloudEvents 1.0, structured mode)."),
                    "type": "object", "required": required, "properties": properties,
                }),
            );
            messages.insert(
                message_key(&event_type).to_string(),
                json!([event_type, "application/cloudevents+json", {"$ref": format!("#{DEFS}/{event_type}")}]),
            );
        }
    }
    messages.insert("job.view".into(), json!(["The status view of a job", "application/json", view]));
    messages.insert("batch.job".into(), json!(["A batch holds a job", "application/json", membership]));
    messages.insert(
        "submit.request".into(),
        json!(["A job request (the body of POST /v1/separations)", "application/json", request]),
    );
    messages.insert(
        "submit.reply".into(),
        json!(["The answer of POST /v1/separations, with its status code", "application/json", reply]),
    );
    messages.insert(
        "empty".into(),
        json!(["An empty body", "application/octet-stream", {"type": "string", "maxLength": 0}]),
    );
    let message = |key: &str, headers: Headers| {
        let m = &messages[key];
        let mut o = json!({"name": key, "title": m[0], "contentType": m[1], "payload": m[2]});
        if let Some(h) = headers.schema() {
            o["headers"] = h;
        }
        o
    };

    let mut channel_map = Map::new();
    let mut operations = Map::new();
    let mut used = std::collections::BTreeSet::new();
    for c in channels(&s) {
        let stream = c.stream.clone().or_else(|| stream_of(&c.subject));
        let (addr, params) = address(&c.subject, &s);
        let mut msgs = Map::new();
        for m in &c.messages {
            let key = message_key(m);
            assert!(messages.contains_key(key), "channel {} names unknown message {m}", c.id);
            used.insert(key.to_string());
            msgs.insert(key.to_string(), message(key, c.headers));
        }
        let mut ch = json!({
            "address": addr,
            "title": c.id,
            "description": c.description,
            "messages": msgs,
        });
        if !params.is_empty() {
            ch["parameters"] = params.iter().map(|p| (p.to_string(), parameter(p))).collect::<Map<_, _>>().into();
        }
        if let Some(st) = &stream {
            ch["x-nats-stream"] = json!(st);
        }
        let a = access(&c.subject, stream.as_deref(), &s);
        let refs: Vec<Value> = c
            .messages
            .iter()
            .map(|m| json!({"$ref": format!("#/channels/{}/messages/{}", c.id, message_key(m))}))
            .collect();
        let channel_ref = json!({"$ref": format!("#/channels/{}", c.id)});
        let security = json!([{"$ref": "#/components/securitySchemes/nkey"}]);
        let mut send = json!({
            "action": "send",
            "channel": channel_ref,
            "summary": format!("Publish on {}", addr),
            "messages": refs,
            "security": security,
            "x-nats-users": a.publish,
        });
        if let Some(reply) = c.reply {
            let reply_id = format!("{}Reply", c.id);
            used.insert(reply.to_string());
            channel_map.insert(
                reply_id.clone(),
                json!({
                    "address": null,
                    "description": format!("The reply to a request on `{addr}`: the requester's inbox."),
                    "messages": {reply: message(reply, Headers::None)},
                }),
            );
            send["reply"] = json!({
                "channel": {"$ref": format!("#/channels/{reply_id}")},
                "messages": [{"$ref": format!("#/channels/{reply_id}/messages/{reply}")}],
            });
        }
        operations.insert(format!("publish{}", upper_first(c.id)), send);
        // A JetStream API subject is answered by the server: nobody receives it.
        if !c.subject.starts_with("$JS.") {
            operations.insert(
                format!("receive{}", upper_first(c.id)),
                json!({
                    "action": "receive",
                    "channel": channel_ref,
                    "summary": format!("Read {}", addr),
                    "description": "`x-nats-subscribers` may subscribe to the subject; `x-nats-stream-readers` may \
                        read it from its stream (a direct get, a consumer, a get by sequence).",
                    "messages": refs,
                    "security": security,
                    "x-nats-subscribers": a.subscribe,
                    "x-nats-stream-readers": a.read,
                }),
            );
        }
        channel_map.insert(c.id.to_string(), ch);
    }
    for key in messages.keys() {
        assert!(used.contains(key), "message {key} is on no channel");
    }
    let users: Vec<Value> = roles()
        .expect("nats/users.json is valid")
        .into_iter()
        .map(|r| {
            json!({
                "user": if r.per_owner { format!("{}-{{ownerToken}}", r.user) } else { r.user.clone() },
                "description": r.description,
                "all": r.all,
                "publish": r.publish,
                "subscribe": r.subscribe,
                "allow_responses": r.allow_responses,
            })
        })
        .collect();
    json!({
        "asyncapi": "3.0.0",
        "info": {
            "title": "stemq over NATS",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "What another service may publish, read and watch on stemq's NATS: the job log \
                (CloudEvents 1.0 in structured mode), the progress stream, the status view bucket, the batch log \
                and the submit endpoint. Every channel says which NATS users may publish (`x-nats-users` on its \
                send operation), subscribe or read its stream (on its receive operation), and the stream that \
                stores it (`x-nats-stream`); the users and their permissions are `x-nats-users` here \
                (`nats/users.json`; `{inbox}` is the user's inbox prefix `_INBOX_<user>`, `{owner}` a \
                publisher's owner token). Prose: docs/events.md.",
            "license": {"name": "Apache-2.0", "url": "https://www.apache.org/licenses/LICENSE-2.0"},
        },
        "x-nats-users": users,
        "defaultContentType": "application/cloudevents+json",
        "servers": {"nats": {
            "host": "localhost:4222",
            "protocol": "nats",
            "description": "A stemq NATS server or cluster (`stemq dev` listens on localhost:4222).",
            "security": [{"$ref": "#/components/securitySchemes/nkey"}],
        }},
        "channels": channel_map,
        "operations": operations,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"nkey": {
                "type": "asymmetricEncryption",
                "description": "A NATS user's nkey (the credentials file from `stemq nats users add ROLE` or \
                    `stemq nats users add-publisher OWNER`), with the inbox prefix the file names.",
            }},
        },
    })
}

fn upper_first(s: &str) -> String {
    let mut c = s.chars();
    c.next().map(|f| f.to_ascii_uppercase().to_string() + c.as_str()).unwrap_or_default()
}

/// The document as checked in (`schemas/asyncapi.json`), with `submit_reply` as in
/// [`document`].
pub fn render(submit_reply: ReplySchema) -> String {
    let mut s = serde_json::to_string_pretty(&document(submit_reply)).expect("the document serialises");
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reply schema as the ingress gives one (the ingress's tests check its own).
    fn reply(_: &mut SchemaGenerator) -> Value {
        json!({"type": "object", "required": ["http_status"]})
    }

    fn document() -> Value {
        super::document(reply)
    }

    /// Each address, its parameters filled with other values, is the subject the code
    /// makes for those values.
    #[test]
    fn addresses_are_the_subjects_the_code_makes() {
        let s = Samples::new();
        let other = Samples {
            job: JobId::parse(&"a".repeat(64)).unwrap(),
            batch: BatchId::parse(&"b".repeat(64)).unwrap(),
            owner: "acme",
        };
        let values = [
            ("jobId", other.job.to_string()),
            ("batchId", other.batch.to_string()),
            ("ownerToken", owner_token(other.owner)),
            ("model", Model::ALL[0].to_string()),
            ("lane", Priority::ALL[0].to_string()),
        ];
        let (mine, theirs) = (channels(&s), channels(&other));
        assert_eq!(mine.len(), theirs.len());
        for (a, b) in mine.iter().zip(&theirs) {
            let (mut addr, _) = address(&a.subject, &s);
            for (name, v) in &values {
                addr = addr.replace(&format!("{{{name}}}"), v);
            }
            assert_eq!(addr, b.subject, "{}", a.id);
        }
        let doc = document();
        assert_eq!(
            doc["channels"]["jobRequested"]["address"],
            "stemq.jobs.{jobId}.requested.{ownerToken}.{model}.{lane}"
        );
        assert_eq!(doc["channels"]["jobView"]["address"], "$KV.stemq_jobs.{ownerToken}.{jobId}");
    }

    /// Every subject docs/events.md names is a channel's address.
    #[test]
    fn every_subject_of_the_events_page_is_a_channel() {
        let page = include_str!("../../../docs/events.md");
        let doc = document();
        let shapes: Vec<Vec<String>> = doc["channels"]
            .as_object()
            .unwrap()
            .values()
            .filter_map(|c| c["address"].as_str())
            .map(|a| a.split('.').map(|t| if t.starts_with('{') { "{}".into() } else { t.to_string() }).collect())
            .collect();
        let mut seen = 0;
        for quoted in page.split('`').skip(1).step_by(2) {
            // A subject with `<placeholder>` tokens, not a filter (`*`, `>`).
            let shape: Vec<String> = quoted
                .split('.')
                .map(|t| if t.starts_with('<') && t.ends_with('>') { "{}".into() } else { t.to_string() })
                .collect();
            let named = (quoted.starts_with("stemq.") || quoted.starts_with("$KV."))
                && shape.iter().all(|t| t == "{}" || !t.contains(['*', '>', '<', ' ', '{', '…']));
            if !named {
                continue;
            }
            seen += 1;
            assert!(shapes.contains(&shape), "docs/events.md names `{quoted}`, which no channel of the AsyncAPI has");
        }
        assert!(seen >= 15, "only {seen} subjects found in docs/events.md");
    }

    #[test]
    fn who_may_do_what_comes_from_the_permissions() {
        let doc = document();
        let ops = &doc["operations"];
        let users = |op: &str, field: &str| -> Vec<String> {
            ops[op][field]
                .as_array()
                .unwrap_or_else(|| panic!("{op}.{field}"))
                .iter()
                .map(|u| u.as_str().unwrap().to_string())
                .collect()
        };
        let publish = users("publishJobRequested", "x-nats-users");
        assert!(publish.contains(&"publisher-{ownerToken}".to_string()), "{publish:?}");
        assert!(publish.contains(&"ingress".to_string()) && publish.contains(&"operator".to_string()), "{publish:?}");
        assert!(!publish.contains(&"worker".to_string()), "{publish:?}");
        // Only the operator publishes the request form without an owner token.
        assert_eq!(users("publishJobRequestedUntokened", "x-nats-users"), ["operator"]);
        // The status reader follows the view bucket and gets its entries, nothing else.
        assert!(users("receiveJobView", "x-nats-subscribers").contains(&"status-reader".to_string()));
        assert!(users("publishJobViewGet", "x-nats-users").contains(&"status-reader".to_string()));
        // An owner's reader reads its owner's views, and nothing of the log.
        assert!(users("receiveJobView", "x-nats-subscribers").contains(&"reader-{ownerToken}".to_string()));
        assert!(users("publishJobViewGet", "x-nats-users").contains(&"reader-{ownerToken}".to_string()));
        assert!(!users("receiveJobStarted", "x-nats-stream-readers").contains(&"reader-{ownerToken}".to_string()));
        assert!(!users("receiveJobStarted", "x-nats-stream-readers").contains(&"status-reader".to_string()));
        assert!(!users("publishJobProgress", "x-nats-users").contains(&"publisher-{ownerToken}".to_string()));
        // Workers listen for cancel requests with a plain subscription.
        assert!(users("receiveJobCancelRequested", "x-nats-subscribers").contains(&"worker".to_string()));
        assert_eq!(doc["channels"]["jobOutcome"]["x-nats-stream"], "STEMQ_OUTCOMES");
        assert_eq!(doc["channels"]["jobStarted"]["x-nats-stream"], "STEMQ_JOBS");
        assert_eq!(doc["channels"]["jobProgress"]["x-nats-stream"], "STEMQ_PROGRESS");
        assert_eq!(doc["channels"]["batchJob"]["x-nats-stream"], "STEMQ_BATCHES");
    }

    /// Every event type of the Rust types has a message on some channel, and a message's
    /// payload is the envelope with its type.
    #[test]
    fn every_event_type_is_a_message() {
        let doc = document();
        let schemas = &doc["components"]["schemas"];
        let on_channels: std::collections::BTreeSet<String> = doc["channels"]
            .as_object()
            .unwrap()
            .values()
            .flat_map(|c| c["messages"].as_object().unwrap().values().map(|m| m["name"].as_str().unwrap().to_string()))
            .collect();
        let event = serde_json::to_value(schemars::schema_for!(Event)).unwrap();
        for v in event["oneOf"].as_array().unwrap() {
            let t = v["properties"]["type"]["const"].as_str().unwrap();
            assert!(on_channels.contains(message_key(t)), "{t} is on no channel");
            let payload = &schemas[t];
            assert_eq!(payload["properties"]["type"]["const"], t);
            for field in ["specversion", "id", "source", "subject", "time", "type", "data"] {
                assert!(payload["required"].as_array().unwrap().contains(&json!(field)), "{t}: {field}");
            }
        }
        let headers = &doc["channels"]["jobRequested"]["messages"]["job.requested.v1"]["headers"];
        assert!(headers["required"].as_array().unwrap().contains(&json!("Nats-Msg-Id")), "{headers}");
        assert!(headers["properties"]["Nats-Expected-Last-Subject-Sequence-Subject"].is_object());
    }
}
