//! Mixed versions: a log recorded with an earlier release is still read, and folds into
//! the views that release recorded.
//!
//! `tests/fixtures/release-0.1.0/events.jsonl` holds every event kind as that release
//! stored it: one line per message, `{"stream", "seq", "payload"}`, where `payload` is
//! the event body on the stream (`STEMQ_JOBS` or `STEMQ_PROGRESS`) and `seq` its stream
//! sequence. `views.json` holds the views its projector folded from them. The test reads
//! each payload the way the services do ([`Event::from_slice`], through the upcasters)
//! and folds it with [`view::apply`]; the views must come out equal.
//!
//! When an event type changes, this fixture stays as it is (it is what a running system
//! has stored) and an upcaster in `services/core/src/upcast.rs` keeps it readable. A new
//! release records its own fixture next to it:
//! `STEMQ_RECORD_FIXTURE=release-X.Y.Z cargo test -p stemq-core --test release_log -- --ignored`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use chrono::{DateTime, Duration, TimeZone, Utc};
use serde_json::{json, Value};
use stemq_core::event::*;
use stemq_core::request::JobRequest;
use stemq_core::view::{self, JobView, Position};
use stemq_core::JobId;

const JOBS: &str = "STEMQ_JOBS";
const PROGRESS: &str = "STEMQ_PROGRESS";

fn fixtures(release: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(release)
}

/// Folds stored lines into views, as the projector does (one view per job).
fn fold(lines: &str) -> BTreeMap<String, JobView> {
    let mut views: BTreeMap<String, JobView> = BTreeMap::new();
    for (n, line) in lines.lines().enumerate() {
        let stored: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("line {}: {e}", n + 1));
        let payload = serde_json::to_vec(&stored["payload"]).unwrap();
        let event = Event::from_slice(&payload).unwrap_or_else(|e| panic!("line {} is no longer readable: {e}", n + 1));
        let seq = stored["seq"].as_u64().expect("seq");
        let pos = match stored["stream"].as_str() {
            Some(JOBS) => Position::Log(seq),
            Some(PROGRESS) => Position::Progress(seq),
            other => panic!("line {}: unknown stream {other:?}", n + 1),
        };
        let id = event.subject.as_str().to_string();
        if let Some(v) = view::apply(views.get(&id), pos, &event) {
            views.insert(id, v);
        }
    }
    views
}

#[test]
fn the_release_0_1_0_log_folds_into_its_recorded_views() {
    let dir = fixtures("release-0.1.0");
    let lines = std::fs::read_to_string(dir.join("events.jsonl")).unwrap();
    let recorded: BTreeMap<String, JobView> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("views.json")).unwrap()).unwrap();
    let folded = fold(&lines);
    assert_eq!(folded.keys().collect::<Vec<_>>(), recorded.keys().collect::<Vec<_>>());
    for (id, want) in &recorded {
        assert_eq!(&folded[id], want, "view of {id}");
    }
    // What the recorded views say, in words: one job per ending (and the replay).
    let mut statuses: Vec<&str> = recorded.values().map(|v| v.status.as_str()).collect();
    statuses.sort();
    assert_eq!(
        statuses,
        ["cancelled", "dead_lettered", "expired", "failed", "rejected", "succeeded", "succeeded", "succeeded"]
    );
    let replay = recorded.values().find(|v| v.retry_of.is_some()).expect("the replayed job");
    let dead = &recorded[replay.retry_of.as_ref().unwrap().as_str()];
    assert_eq!(dead.retried_by.as_ref(), Some(&replay.job_id));
    // The fixture has every kind of event that release wrote.
    let kinds: std::collections::BTreeSet<String> = lines
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["payload"]["type"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(kinds.len(), 13, "{kinds:?}");
}

/// Writes the fixture of the current code into `tests/fixtures/$STEMQ_RECORD_FIXTURE/`.
#[test]
#[ignore = "records a fixture: STEMQ_RECORD_FIXTURE=release-X.Y.Z cargo test --test release_log -- --ignored"]
fn record_release_fixture() {
    let Ok(release) = std::env::var("STEMQ_RECORD_FIXTURE") else {
        panic!("set STEMQ_RECORD_FIXTURE to the release name (release-X.Y.Z)");
    };
    let log = Recorder::default().record();
    let lines: Vec<String> = log
        .iter()
        .map(|(stream, seq, e)| {
            let payload: Value = serde_json::from_slice(&e.to_bytes()).unwrap();
            serde_json::to_string(&json!({"stream": stream, "seq": seq, "payload": payload})).unwrap()
        })
        .collect();
    let text = lines.join("\n") + "\n";
    let views = fold(&text);
    let dir = fixtures(&release);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("events.jsonl"), text).unwrap();
    std::fs::write(dir.join("views.json"), serde_json::to_string_pretty(&views).unwrap() + "\n").unwrap();
}

/// Builds a small, deterministic log with the current event types: fixed times and ids.
#[derive(Default)]
struct Recorder {
    log: Vec<(&'static str, u64, Event)>,
    jobs_seq: u64,
    progress_seq: u64,
}

impl Recorder {
    fn t(n: usize) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 11, 1, 12, 0, 0).unwrap() + Duration::seconds(n as i64)
    }

    fn push(&mut self, mut e: Event) {
        let n = self.log.len();
        e.time = Self::t(n);
        if !matches!(e.body, EventBody::Requested(_)) {
            e.id = format!("00000000-0000-4000-8000-{n:012}");
        }
        let (stream, seq) = match e.body {
            EventBody::Progress(_) => {
                self.progress_seq += 1;
                (PROGRESS, self.progress_seq)
            }
            _ => {
                self.jobs_seq += 1;
                (JOBS, self.jobs_seq)
            }
        };
        self.log.push((stream, seq, e));
    }

    fn request(&mut self, body: Value, retry_of: Option<&JobId>) -> JobId {
        let req = JobRequest::from_value(body).unwrap();
        let mut n = req.normalize("acme").unwrap();
        n.retry_of = retry_of.cloned();
        let mut e = Event::requested(n, req.webhook.clone(), req.metadata.clone(), "/stemq/ingress");
        if let EventBody::Requested(r) = &mut e.body {
            r.start_before = req.start_before;
            r.max_runtime = req.max_runtime;
        }
        e.traceparent = Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into());
        let id = e.subject.clone();
        self.push(e);
        id
    }

    fn on(&mut self, id: &JobId, source: &str, body: EventBody) {
        self.push(Event::new(id, source, body));
    }

    fn started(&mut self, id: &JobId, attempt: u32) {
        let body = EventBody::Started(Started { attempt, worker: "w-gpu-1".into(), device: "cuda:0".into() });
        self.on(id, "/stemq/worker/w-gpu-1", body);
    }

    fn failed(&mut self, id: &JobId, attempt: u32, class: FailureClass, code: &str) {
        let retry_in_ms = (class == FailureClass::Transient).then_some(2000);
        let body = EventBody::Failed(Failed {
            attempt,
            class,
            code: code.into(),
            message: format!("{code} here"),
            retry_in_ms,
        });
        self.on(id, "/stemq/worker/w-gpu-1", body);
    }

    fn succeeded(&mut self, id: &JobId, attempt: u32, degraded: bool) {
        let outputs = ["vocals", "no_vocals"]
            .map(|stem| Output {
                stem: stem.into(),
                uri: format!("s3://stemq/jobs/{id}/{stem}.wav"),
                bytes: 1_234_567,
                sha256: "ab".repeat(32),
            })
            .to_vec();
        let body = EventBody::Succeeded(Succeeded {
            attempt,
            outputs,
            manifest_uri: Some(format!("s3://stemq/jobs/{id}/manifest.json")),
            degraded,
            device: if degraded { "cpu".into() } else { "cuda:0".into() },
            segment: degraded.then_some(3.9),
            duration_ms: 41_250,
            audio_ms: None,
        });
        self.on(id, "/stemq/worker/w-gpu-1", body);
    }

    fn record(mut self) -> Vec<(&'static str, u64, Event)> {
        let audio = |name: &str| format!("s3://stemq/uploads/acme/{name}.wav");
        // Succeeded, with progress, a webhook delivered on the second try and replayed.
        let a = self.request(
            json!({"audio_uri": audio("a"), "model": "htdemucs", "two_stems": "vocals",
                   "webhook": {"url": "https://hooks.example.com/stemq"}, "metadata": {"track": 7}}),
            None,
        );
        self.started(&a, 1);
        let progress =
            EventBody::Progress(Progress { attempt: 1, percent: 40.0, stage: "separate".into(), message: None });
        self.on(&a, "/stemq/worker/w-gpu-1", progress);
        self.succeeded(&a, 1, false);
        for (attempt, status, result) in [(1, 503, DeliveryResult::Retrying), (2, 200, DeliveryResult::Delivered)] {
            let body = EventBody::DeliveryAttempted(DeliveryAttempted {
                webhook_id: "msg_a_succeeded".into(),
                event_type: "io.stemq.job.succeeded.v1".into(),
                url: "https://hooks.example.com/stemq".into(),
                attempt,
                status_code: Some(status),
                latency_ms: 80,
                result,
                error: None,
                retry_in_ms: (result == DeliveryResult::Retrying).then_some(5000),
                replay: false,
            });
            self.on(&a, "/stemq/relay", body);
        }
        let replay = EventBody::DeliveryReplayRequested(DeliveryReplayRequested {
            webhook_id: "msg_a_succeeded".into(),
            event_type: "io.stemq.job.succeeded.v1".into(),
        });
        self.on(&a, "/stemq/ingress", replay);
        // A transient failure, then success on the CPU (degraded).
        let b = self.request(json!({"audio_uri": audio("b"), "output_format": "flac"}), None);
        self.started(&b, 1);
        self.failed(&b, 1, FailureClass::Transient, "out_of_memory");
        self.started(&b, 2);
        self.succeeded(&b, 2, true);
        // A permanent failure.
        let c = self.request(json!({"audio_uri": audio("c")}), None);
        self.started(&c, 1);
        self.failed(&c, 1, FailureClass::Permanent, "invalid_audio");
        // Dead-lettered, then replayed as a new job that succeeds.
        let d = self.request(json!({"audio_uri": audio("d")}), None);
        let d_seq = self.jobs_seq;
        for attempt in 1..=2 {
            self.started(&d, attempt);
            self.failed(&d, attempt, FailureClass::Transient, "engine_error");
        }
        let dead = EventBody::DeadLettered(DeadLettered {
            deliveries: 2,
            reason: "max_deliveries".into(),
            last_error: Some("engine_error: engine_error here".into()),
            request_seq: d_seq,
        });
        self.on(&d, "/stemq/worker/w-gpu-1", dead);
        let e = self.request(json!({"audio_uri": audio("d")}), Some(&d));
        self.on(&d, "/stemq/ingress", EventBody::Retried(Retried { retried_by: e.clone() }));
        self.started(&e, 1);
        self.succeeded(&e, 1, false);
        // Cancelled before it started.
        let f = self.request(json!({"audio_uri": audio("f"), "max_runtime": 600}), None);
        self.on(&f, "/stemq/ingress", EventBody::CancelRequested(CancelRequested { by: Some("http".into()) }));
        self.on(&f, "/stemq/worker/w-gpu-1", EventBody::Cancelled(Cancelled { attempt: 0, interrupted: false }));
        // Expired: not started before its deadline.
        let deadline = Self::t(0) + Duration::seconds(5);
        let g = self.request(json!({"audio_uri": audio("g"), "start_before": deadline}), None);
        self.on(&g, "/stemq/worker/w-gpu-1", EventBody::Expired(Expired { start_before: deadline }));
        // Rejected: an id that does not match the request.
        let h = self.request(json!({"audio_uri": audio("h")}), None);
        let rejected = EventBody::Rejected(Rejected { code: "id_mismatch".into(), message: "forged id".into() });
        self.on(&h, "/stemq/worker/w-gpu-1", rejected);
        self.log
    }
}
