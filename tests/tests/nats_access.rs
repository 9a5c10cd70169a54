//! NATS users and least privilege, tried the way an attacker would: each user connects
//! with its own credentials and tries what it must not do (forge an outcome, request
//! for another owner, delete the stream, rewrite a consumer, write the view, read
//! secrets), next to what it must be able to do.
//!
//! A denial never comes back as an error of the call: the server drops the message and
//! tells the connection asynchronously (`Permissions Violation`), so a JetStream call
//! simply gets no answer. Each attempt here therefore runs on a JetStream context with a
//! short timeout, expects that timeout, and then checks with the operator's client that
//! nothing happened (the stream is there, no outcome is stored, the view is unchanged).
//! Where a positive signal helps (a denied subscription), the server's error event on the
//! connection is asserted too.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, stream};
use serde_json::json;
use stemq_core::event::{EventBody, Succeeded};
use stemq_core::request::{Model, Priority};
use stemq_core::{Event, JobId, JobRequest, JobStatus, JobView};
use stemq_nats::credentials::Credentials;
use stemq_nats::users::{INGRESS, OPERATOR, PROJECTOR, RELAY, STATUS_READER, WORKER};
use stemq_nats::{self as names, job_subject, request_subject, unrouted_request_subject, SubjectKind};
use stemq_tests::{job_body, job_id, Stack, StackOptions, TEST_OWNER};

const T: Duration = Duration::from_secs(30);
/// How long a call waits for an answer a denial never gives.
const DENIED: Duration = Duration::from_millis(800);

/// JetStream on `client` with a short timeout: a denied call fails fast.
fn short(client: &async_nats::Client) -> jetstream::Context {
    jetstream::ContextBuilder::new().timeout(DENIED).build(client.clone())
}

/// A request for `owner` (a unique audio URI per `name`), as its `requested` event.
fn request_of(stack: &Stack, name: &str, owner: &str) -> Event {
    let n = JobRequest::from_value(job_body(stack, name, None)).unwrap().normalize(owner).unwrap();
    Event::requested(n, None, None, "urn:test:foreign")
}

/// Publishes `ev` to `subject` as a JetStream publish with the request headers; the
/// PubAck, or the error (a timeout when the server refused it).
async fn js_publish(js: &jetstream::Context, subject: String, ev: &Event, msg_id: Option<&str>) -> Result<u64, String> {
    let mut h = async_nats::HeaderMap::new();
    if let Some(id) = msg_id {
        h.insert("Nats-Msg-Id", id);
    }
    h.insert("Nats-Expected-Last-Subject-Sequence", "0");
    match js.publish_with_headers(subject, h, ev.to_bytes()).await {
        Ok(ack) => ack.await.map(|a| a.sequence).map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    }
}

fn assert_denied<T: std::fmt::Debug>(what: &str, r: Result<T, String>) {
    match r {
        Ok(v) => panic!("{what} was allowed: {v:?}"),
        Err(e) => assert!(e.to_lowercase().contains("timed out"), "{what}: expected a timeout (denied), got: {e}"),
    }
}

fn denied<T, E: std::fmt::Display>(what: &str, r: Result<T, E>) {
    assert_denied(what, r.map(|_| "answered").map_err(|e| e.to_string()));
}

/// A connection as `user` that records the server's error events (permission
/// violations) instead of only logging them.
async fn watched(stack: &Stack, user: &str) -> (async_nats::Client, Arc<Mutex<Vec<String>>>) {
    let creds = Credentials::load(&stack.server.credentials(user)).unwrap();
    let errors = Arc::new(Mutex::new(Vec::new()));
    let e = errors.clone();
    let client = async_nats::ConnectOptions::with_nkey(creds.seed().to_string())
        .custom_inbox_prefix(creds.inbox_prefix.clone().unwrap())
        .event_callback(move |ev| {
            let e = e.clone();
            async move {
                if let async_nats::Event::ServerError(err) = ev {
                    e.lock().unwrap().push(err.to_string());
                }
            }
        })
        .connect(stack.server.url())
        .await
        .unwrap();
    (client, errors)
}

async fn wait_error(errors: &Arc<Mutex<Vec<String>>>, needle: &str) -> String {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(e) = errors.lock().unwrap().iter().find(|e| e.contains(needle)) {
            return e.clone();
        }
        if tokio::time::Instant::now() > deadline {
            panic!("no server error about {needle}; got {:?}", errors.lock().unwrap());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_anonymous_client_is_refused() {
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let anonymous = async_nats::ConnectOptions::new().connect(stack.server.url()).await;
    let e = anonymous.expect_err("an anonymous client connected");
    assert!(e.to_string().to_lowercase().contains("authorization"), "{e}");
    // A seed the server does not know is refused the same way.
    let stranger = async_nats::ConnectOptions::with_nkey(nkeys_seed()).connect(stack.server.url()).await;
    assert!(stranger.is_err(), "an unknown key connected");
    stack.shutdown().await;
}

/// The routed subject of a `dsp` interactive request of `owner`, where a publisher may
/// publish its own owner's requests.
fn routed(id: &stemq_core::JobId, owner: &str) -> String {
    request_subject(id, owner, Model::Dsp, Priority::Interactive)
}

/// A valid user seed that no server knows.
fn nkeys_seed() -> String {
    let dir = tempfile::tempdir().unwrap();
    let store = stemq_nats::users::UserStore::open(dir.path()).unwrap();
    let path = store.ensure(&stemq_nats::users::User::of_role(WORKER)).unwrap();
    Credentials::load(&path).unwrap().seed().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_requests_for_its_own_owner_only() {
    let mut stack = Stack::start(StackOptions::default()).await;
    let acme = stack.add_publisher("acme").await;
    let client = stack.connect_as(&acme).await;
    let js = short(&client);

    // For another owner: refused by the server, nothing stored, no job.
    let theirs = request_of(&stack, "globex-job", "globex");
    let theirs_id = theirs.subject.clone();
    let r = js_publish(&js, routed(&theirs_id, "globex"), &theirs, Some(theirs_id.as_str())).await;
    assert_denied("a request for another owner", r);
    let r = js_publish(&js, unrouted_request_subject(&theirs_id, "globex"), &theirs, None).await;
    assert_denied("an unrouted request for another owner", r);
    // On the old subject (no owner token) too.
    let r = js_publish(&js, job_subject(&theirs_id, SubjectKind::Requested), &theirs, None).await;
    assert_denied("a request on the old subject", r);
    assert_eq!(stack.count_on(&format!("stemq.jobs.{theirs_id}.>")).await, 0);

    // For its own owner: accepted, and the job runs like any other.
    let mine = request_of(&stack, "acme-job", "acme");
    let id = mine.subject.clone();
    js_publish(&js, routed(&id, "acme"), &mine, Some(id.as_str())).await.expect("its own request");
    let v = stack.wait_terminal(&id, T).await;
    assert_eq!(v.status, JobStatus::Succeeded, "{v:#?}");
    assert_eq!(v.request.as_ref().unwrap().owner, "acme");
    // In the form before routing too: the ingress's router moves it into its pool.
    let old = request_of(&stack, "acme-old-job", "acme");
    let old_id = old.subject.clone();
    js_publish(&js, unrouted_request_subject(&old_id, "acme"), &old, Some(old_id.as_str())).await.expect("unrouted");
    assert_eq!(stack.wait_terminal(&old_id, T).await.status, JobStatus::Succeeded);

    // Its own subject, but a body for another owner (globex's exact job, say): dropped
    // by the worker and the projector, with no outcome, so it cannot end globex's job
    // before globex submits it.
    let smuggled = request_of(&stack, "smuggled", "globex");
    let sid = smuggled.subject.clone();
    js_publish(&js, routed(&sid, "acme"), &smuggled, Some(sid.as_str())).await.expect("allowed subject");
    let t0 = std::time::Instant::now();
    let pool = names::pool_consumer(Model::Dsp, Priority::Interactive);
    while stack.js.get_stream(names::JOBS_STREAM).await.unwrap().consumer_info(&pool).await.unwrap().num_pending > 0 {
        assert!(t0.elapsed() < T, "the workers never took the smuggled request");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(stack.count_on(&format!("stemq.jobs.{sid}.>")).await, 1, "an attempt or outcome was recorded");
    assert!(stack.view(&sid).await.is_none(), "the projector folded a request for another owner");
    // The read side does not take it for the job's request either.
    let views = stemq_nats::read::Views::open(&stack.js).await.unwrap();
    assert!(stemq_nats::read::request_of(views.log(), &sid).await.unwrap().is_none());
    // globex's real request, published by the operator on its own subject, runs.
    stack.js.publish(routed(&sid, "globex"), smuggled.to_bytes()).await.unwrap().await.unwrap();
    assert_eq!(stack.wait_terminal(&sid, T).await.status, JobStatus::Succeeded);
    stack.shutdown().await;
}

/// A publisher asks the request-reply submit endpoint: the API key in the message
/// decides (a job with it, a 401 without it), and the reply reaches the publisher's own
/// inbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_submits_over_request_reply_with_an_api_key() {
    let mut stack = Stack::start(StackOptions::default()).await;
    let publisher = stack.add_publisher(TEST_OWNER).await;
    let client = stack.connect_as(&publisher).await;
    let body = serde_json::to_vec(&job_body(&stack, "publisher-submit", None)).unwrap();
    let ask = |key: Option<&str>| {
        let mut h = async_nats::HeaderMap::new();
        if let Some(k) = key {
            h.insert("Authorization", format!("Bearer {k}").as_str());
        }
        let (c, b) = (client.clone(), body.clone());
        async move {
            let m = tokio::time::timeout(T, c.request_with_headers(names::SUBMIT_SUBJECT, h, b.into()))
                .await
                .expect("an answer in time")
                .expect("the publisher may ask the submit endpoint");
            serde_json::from_slice::<serde_json::Value>(&m.payload).unwrap()
        }
    };
    let refused = ask(None).await;
    assert_eq!(refused["http_status"].as_u64(), Some(401), "{refused}");
    let key = stack.key.clone();
    let accepted = ask(Some(&key)).await;
    assert_eq!(accepted["http_status"].as_u64(), Some(202), "{accepted}");
    let id = JobId::parse(accepted["job_id"].as_str().unwrap()).unwrap();
    assert_eq!(stack.wait_terminal(&id, T).await.status, JobStatus::Succeeded);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_outcome_is_refused_and_the_real_submit_runs() {
    let mut stack = Stack::start(StackOptions::default()).await;
    let publisher = stack.add_publisher(TEST_OWNER).await;
    let body = job_body(&stack, "target", None);
    // The id the real submit will have (job ids are content hashes: anyone can compute it).
    let id = JobRequest::from_value(body.clone()).unwrap().normalize(TEST_OWNER).unwrap().job_id();
    let forged = Event::new(
        &id,
        "urn:test:attacker",
        EventBody::Succeeded(Succeeded {
            attempt: 1,
            outputs: vec![],
            manifest_uri: None,
            degraded: false,
            device: "cpu".into(),
            segment: None,
            duration_ms: 1,
            audio_ms: None,
        }),
    );
    let client = stack.connect_as(&publisher).await;
    let js = short(&client);
    let outcome = job_subject(&id, SubjectKind::Outcome);
    assert_denied("a forged outcome", js_publish(&js, outcome.clone(), &forged, None).await);
    assert_denied("a forged started", js_publish(&js, job_subject(&id, SubjectKind::Started), &forged, None).await);
    assert_denied("a forged progress", js_publish(&js, job_subject(&id, SubjectKind::Progress), &forged, None).await);
    // Straight into the view: refused too.
    let kv_subject = format!("$KV.{}.{id}", names::JOBS_BUCKET);
    assert_denied("a forged view", js_publish(&js, kv_subject, &forged, None).await);
    assert_eq!(stack.count_on(&outcome).await, 0, "a forged outcome was stored");
    assert!(stack.view(&id).await.is_none());

    // The real submit is a new job and runs normally.
    let (code, b) = stack.submit(&body).await;
    assert_eq!(code, 202, "{b}");
    assert_eq!(job_id(&b), id);
    let v = stack.wait_terminal(&id, T).await;
    assert_eq!(v.status, JobStatus::Succeeded, "{v:#?}");
    assert!(!v.outputs.is_empty(), "the outputs are the worker's");
    assert_eq!(v.worker.as_deref(), Some("inproc-0"));
    stack.shutdown().await;
}

/// An outcome event of job `id` (`cancelled` when `forged`, else `succeeded`).
fn outcome_of(id: &JobId, forged: bool) -> Event {
    let body = if forged {
        EventBody::Cancelled(stemq_core::event::Cancelled { attempt: 0, interrupted: false })
    } else {
        EventBody::Succeeded(Succeeded {
            attempt: 1,
            outputs: vec![],
            manifest_uri: None,
            degraded: false,
            device: "cpu".into(),
            segment: None,
            duration_ms: 1,
            audio_ms: None,
        })
    };
    Event::new(id, "urn:test:outcome", body)
}

/// Issue 39, finding 3: `worker` and `ingress` may record outcomes (of any job: a
/// subject permission cannot tell jobs apart), and a second outcome sent without the
/// "nothing yet" header was stored after the first; the view kept the first, but a
/// direct get of the latest returned the forged one. The server now keeps one outcome
/// per job and refuses any other, whatever the headers (none, a fresh message id, the
/// first outcome's sequence as the expected one), and every reader reads the first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_outcome_is_refused_by_the_server_whatever_its_headers() {
    use stemq_nats::read::outcome::{outcome, From};
    let stack = Stack::start(StackOptions::default()).await;
    let (_, b) = stack.submit(&job_body(&stack, "ended", None)).await;
    let id = job_id(&b);
    assert_eq!(stack.wait_terminal(&id, T).await.status, JobStatus::Succeeded);
    let subject = job_subject(&id, SubjectKind::Outcome);
    let first = outcome(&stack.js, &id, From::Leader).await.unwrap().expect("the outcome");
    let outcomes = stack.js.get_stream_no_info(names::OUTCOMES_STREAM).await.unwrap();
    let stored = outcomes.direct_get_last_for_subject(subject.as_str()).await.unwrap().sequence;
    let forged = outcome_of(&id, true).to_bytes();
    for user in [WORKER, INGRESS] {
        let c = stack.connect_as(user).await;
        let js = jetstream::ContextBuilder::new().timeout(Duration::from_secs(5)).build(c.clone());
        let mut headers = vec![async_nats::HeaderMap::new()];
        let mut h = async_nats::HeaderMap::new();
        h.insert("Nats-Msg-Id", format!("forged-{user}").as_str());
        headers.push(h);
        let mut h = async_nats::HeaderMap::new();
        h.insert("Nats-Expected-Last-Subject-Sequence", stored.to_string().as_str());
        headers.push(h);
        for h in headers {
            let what = format!("{user} records a second outcome with {h:?}");
            let r = match js.publish_with_headers(subject.clone(), h, forged.clone()).await {
                Ok(ack) => ack.await.map(|a| a.sequence).map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            // Refused by the server itself (an error answer, not a permission timeout).
            let e = r.expect_err(&what);
            assert!(!e.to_lowercase().contains("timed out"), "{what}: {e}");
        }
    }
    // One outcome, everywhere it is read: the first.
    let mut outcomes = stack.js.get_stream(names::OUTCOMES_STREAM).await.unwrap();
    let subjects = outcomes.info_with_subjects(subject.as_str()).await.unwrap();
    futures::pin_mut!(subjects);
    let (_, n) = futures::StreamExt::next(&mut subjects).await.unwrap().unwrap();
    assert_eq!(n, 1, "the outcome stream holds a second outcome");
    let _ = outcomes.info().await.unwrap();
    assert_eq!(stack.count_on(&subject).await, 1, "the job log holds a second outcome");
    for from in [From::Replica, From::Leader] {
        let m = outcome(&stack.js, &id, from).await.unwrap().expect("the outcome");
        assert_eq!(m.payload, first.payload, "{from:?} read another outcome");
    }
    let latest = stack.js.get_stream_no_info(names::JOBS_STREAM).await.unwrap();
    let last = latest.direct_get_last_for_subject(subject.as_str()).await.unwrap();
    assert_eq!(last.payload, first.payload, "the latest outcome in the log is not the first");
    assert_eq!(stack.view(&id).await.unwrap().status, JobStatus::Succeeded);
    stack.shutdown().await;
}

/// The outcome stream on a server whose job log holds outcomes from before it: `stemq
/// nats apply` moves the outcome subjects to it, the old outcomes stay readable where
/// they are, the first of a job's old outcomes is still "the" outcome, and a new job's
/// second outcome is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outcomes_recorded_before_the_outcome_stream_stay_the_jobs_outcomes() {
    use stemq_nats::read::outcome::{outcome, From};
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().to_path_buf();
    let server = tokio::task::spawn_blocking(move || stemq_devkit::nats_server::NatsServer::start(&store, 0))
        .await
        .unwrap()
        .unwrap();
    let client = server.connect_as(OPERATOR, "test").await.unwrap();
    let js = jetstream::new(client);
    // The job log as it was: every job subject, outcomes included.
    js.create_stream(stream::Config {
        name: names::JOBS_STREAM.into(),
        subjects: vec!["stemq.jobs.>".into()],
        allow_direct: true,
        ..Default::default()
    })
    .await
    .unwrap();
    let old = JobId::parse(&"c".repeat(64)).unwrap();
    let subject = job_subject(&old, SubjectKind::Outcome);
    let (first, later) = (outcome_of(&old, false).to_bytes(), outcome_of(&old, true).to_bytes());
    for payload in [first.clone(), later] {
        js.publish(subject.clone(), payload).await.unwrap().await.unwrap();
    }
    let settings = stemq_nats::Settings::default();
    stemq_nats::apply(&js, &settings).await.expect("apply over the old job log");
    let again = stemq_nats::apply(&js, &settings).await.unwrap();
    assert!(again.iter().all(|c| !c.is_change()), "a second apply changed {again:?}");
    // The old job's outcome is its first, read the same way as any other.
    for from in [From::Replica, From::Leader] {
        let m = outcome(&js, &old, from).await.unwrap().expect("the old outcome");
        assert_eq!(m.payload, first, "{from:?}");
    }
    // A new job: the first outcome is kept (and copied into the log), a second refused.
    let new = JobId::parse(&"d".repeat(64)).unwrap();
    let subject = job_subject(&new, SubjectKind::Outcome);
    let kept = outcome_of(&new, false).to_bytes();
    js.publish(subject.clone(), kept.clone()).await.unwrap().await.unwrap();
    let second = js.publish(subject.clone(), outcome_of(&new, true).to_bytes()).await.unwrap().await;
    assert!(second.is_err(), "a second outcome was stored: {second:?}");
    let log = js.get_stream_no_info(names::JOBS_STREAM).await.unwrap();
    let t0 = std::time::Instant::now();
    let copy = loop {
        match log.direct_get_last_for_subject(subject.as_str()).await {
            Ok(m) => break m,
            Err(_) if t0.elapsed() < T => tokio::time::sleep(Duration::from_millis(20)).await,
            Err(e) => panic!("the outcome never reached the job log: {e}"),
        }
    };
    assert_eq!(copy.payload, kept);
    println!("the copy reached the job log in {:?}", t0.elapsed());
    drop(server);
}

/// Nats-Msg-Id squatting: a publisher sends its own request with the message id of a job
/// someone else is about to submit. Inside the dedupe window the real publish would be
/// acked `duplicate` with nothing stored; the submit notices and stores it anyway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_squatted_message_id_does_not_swallow_a_submit() {
    let mut stack = Stack::start(StackOptions::default()).await;
    let acme = stack.add_publisher("acme").await;
    let body = job_body(&stack, "victim", None);
    let victim = JobRequest::from_value(body.clone()).unwrap().normalize(TEST_OWNER).unwrap().job_id();
    let own = request_of(&stack, "squatter", "acme");
    let client = stack.connect_as(&acme).await;
    js_publish(&short(&client), routed(&own.subject, "acme"), &own, Some(victim.as_str()))
        .await
        .expect("its own request, with someone else's message id");

    let (code, b) = stack.submit(&body).await;
    assert_eq!((code, job_id(&b)), (202, victim.clone()), "{b}");
    assert_eq!(stack.wait_terminal(&victim, T).await.status, JobStatus::Succeeded);
    assert_eq!(stack.count_on(&routed(&victim, TEST_OWNER)).await, 1);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn services_cannot_change_definitions() {
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    for user in [WORKER, INGRESS, PROJECTOR, RELAY, STATUS_READER] {
        let c = stack.connect_as(user).await;
        let js = short(&c);
        denied(&format!("{user} deletes the job stream"), js.delete_stream(names::JOBS_STREAM).await);
        denied(
            &format!("{user} deletes the workers consumer"),
            js.delete_consumer_from_stream(names::WORKERS_CONSUMER, names::JOBS_STREAM).await,
        );
        denied(
            &format!("{user} deletes a pool consumer"),
            js.delete_consumer_from_stream(names::pool_consumer(Model::Dsp, Priority::Batch), names::JOBS_STREAM).await,
        );
        denied(
            &format!("{user} creates a stream"),
            js.create_stream(stream::Config { name: format!("EVIL_{}", user.replace('-', "_")), ..Default::default() })
                .await,
        );
        denied(&format!("{user} deletes the view bucket"), js.delete_key_value(names::JOBS_BUCKET).await);
        // The unnamed ("ephemeral") create API: with the name of a durable consumer it
        // would rewrite that consumer (here: the workers' max deliver down to 1).
        let rewrite = json!({"stream_name": names::JOBS_STREAM, "config": {"name": "workers", "ack_policy": "explicit",
            "max_deliver": 1, "filter_subjects": names::REQUESTED_FILTERS}});
        let r = tokio::time::timeout(
            DENIED,
            c.request(format!("$JS.API.CONSUMER.CREATE.{}", names::JOBS_STREAM), rewrite.to_string().into()),
        )
        .await;
        assert!(!matches!(r, Ok(Ok(_))), "{user} reached the consumer create API: {r:?}");
    }
    // All still there, as defined.
    let mut s = stack.js.get_stream(names::JOBS_STREAM).await.expect("the job stream survived");
    assert_eq!(s.info().await.unwrap().config.name, names::JOBS_STREAM);
    let pool = names::pool_consumer(Model::Dsp, Priority::Interactive);
    let mut c: jetstream::consumer::PullConsumer =
        stack.js.get_consumer_from_stream(&pool, names::JOBS_STREAM).await.unwrap();
    let config = c.info().await.unwrap().config.clone();
    assert_eq!(config.max_deliver, stack.options.settings.max_deliver);
    assert_eq!(config.durable_name.as_deref(), Some(pool.as_str()));
    assert!(stack.js.get_stream("EVIL_worker").await.is_err());
    assert!(stack.js.get_key_value(names::JOBS_BUCKET).await.is_ok());
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_projector_writes_the_view_and_only_the_worker_records_attempts() {
    let stack = Stack::start(StackOptions::default()).await;
    let (_, b) = stack.submit(&job_body(&stack, "done", None)).await;
    let id = job_id(&b);
    let before = stack.wait_terminal(&id, T).await;
    assert_eq!(before.status, JobStatus::Succeeded);
    let forged = serde_json::to_vec(&JobView { status: JobStatus::Failed, ..before.clone() }).unwrap();
    for user in [INGRESS, RELAY, WORKER, STATUS_READER] {
        let c = stack.connect_as(user).await;
        let kv = short(&c).get_key_value(names::JOBS_BUCKET).await;
        match kv {
            // Users that may read the view open the bucket; the write is refused.
            Ok(kv) => {
                let key = names::view_key(Some(TEST_OWNER), &id);
                denied(&format!("{user} writes the view"), kv.put(key, forged.clone().into()).await)
            }
            Err(e) => assert_eq!(user, WORKER, "{user} cannot open the bucket: {e}"),
        }
    }
    assert_eq!(stack.view(&id).await.unwrap(), before, "the view changed");

    // Attempt events are the worker's, deliveries the relay's.
    let ev = Event::new(&id, "urn:test", EventBody::Retried(stemq_core::event::Retried { retried_by: id.clone() }));
    for (user, kind) in [
        (INGRESS, SubjectKind::Started),
        (INGRESS, SubjectKind::Failed),
        (INGRESS, SubjectKind::Progress),
        (RELAY, SubjectKind::Outcome),
        (PROJECTOR, SubjectKind::Outcome),
        (WORKER, SubjectKind::Delivery),
        (INGRESS, SubjectKind::Delivery),
        (WORKER, SubjectKind::CancelRequested),
    ] {
        let c = stack.connect_as(user).await;
        let r = js_publish(&short(&c), job_subject(&id, kind), &ev, None).await;
        assert_denied(&format!("{user} publishes {kind:?}"), r);
    }
    // A worker cannot queue work either.
    let c = stack.connect_as(WORKER).await;
    let req = request_of(&stack, "from-a-worker", "anonymous");
    assert_denied("worker requests a job", js_publish(&short(&c), routed(&req.subject, "anonymous"), &req, None).await);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_reader_reads_and_follows_views_and_nothing_else() {
    let stack = Stack::start(StackOptions::default()).await;
    let (_, b) = stack.submit(&job_body(&stack, "read-me", None)).await;
    let id = job_id(&b);
    stack.wait_terminal(&id, T).await;
    let key = names::view_key(Some(TEST_OWNER), &id);

    let (client, errors) = watched(&stack, STATUS_READER).await;
    let js = short(&client);
    let kv = js.get_key_value(names::JOBS_BUCKET).await.expect("the reader opens the view bucket");
    let v: JobView = serde_json::from_slice(&kv.get(key.as_str()).await.unwrap().expect("a view")).unwrap();
    assert_eq!((v.job_id.clone(), v.status), (id.clone(), JobStatus::Succeeded));
    // It follows views by a plain subscription to the bucket's put subjects (no
    // consumer: see `readers_cannot_create_consumers_that_deliver_anywhere`).
    let mut follow = client.subscribe(format!("$KV.{}.{key}", names::JOBS_BUCKET)).await.unwrap();
    client.flush().await.unwrap();
    let op = stack.connect_as(OPERATOR).await;
    let view = serde_json::to_vec(&v).unwrap();
    jetstream::new(op.clone())
        .get_key_value(names::JOBS_BUCKET)
        .await
        .unwrap()
        .put(key.as_str(), view.into())
        .await
        .unwrap();
    let heard = tokio::time::timeout(T, futures::StreamExt::next(&mut follow)).await.unwrap().unwrap();
    assert_eq!(serde_json::from_slice::<JobView>(&heard.payload).unwrap().job_id, id);
    denied("the reader watches through a consumer", kv.watch_with_history(key.as_str()).await);

    // Anything else: no.
    denied("the reader writes a view", kv.put(key.as_str(), "{}".into()).await);
    let req = request_of(&stack, "from-reader", "anonymous");
    assert_denied("the reader requests a job", js_publish(&js, routed(&req.subject, "anonymous"), &req, None).await);
    denied("the reader opens the webhook secrets", js.get_key_value(names::WEBHOOKS_BUCKET).await);
    let log = js.get_stream_no_info(names::JOBS_STREAM).await.unwrap();
    denied("the reader reads the log", log.direct_get_last_for_subject(job_subject(&id, SubjectKind::Outcome)).await);
    // A core publish "succeeds" locally; the server says no on the connection.
    client.publish(job_subject(&id, SubjectKind::CancelRequested), "x".into()).await.unwrap();
    wait_error(&errors, "Permissions Violation for Publish").await;
    // And it cannot listen in on events or on another user's inbox.
    let _events = client.subscribe("stemq.jobs.>").await.unwrap();
    wait_error(&errors, "Subscription to \"stemq.jobs.>\"").await;
    let _inbox = client.subscribe("_INBOX_ingress.>").await.unwrap();
    wait_error(&errors, "Subscription to \"_INBOX_ingress.>\"").await;
    assert_eq!(stack.count_on(&job_subject(&id, SubjectKind::CancelRequested)).await, 0);
    // The operator, of course, may do all of it.
    assert!(short(&op).get_key_value(names::WEBHOOKS_BUCKET).await.is_ok());
    stack.shutdown().await;
}

/// A direct get of `key` in the status bucket, as a plain request (what an owner's
/// reader may send): the reply, or the error (a timeout when the server refused it).
async fn view_by_key(client: &async_nats::Client, key: &str) -> Result<async_nats::Message, String> {
    let subject = format!("$JS.API.DIRECT.GET.KV_{b}.$KV.{b}.{key}", b = names::JOBS_BUCKET);
    match tokio::time::timeout(DENIED, client.request(subject, "".into())).await {
        Ok(Ok(m)) => Ok(m),
        Ok(Err(e)) => Err(format!("timed out: {e}")),
        Err(_) => Err("timed out".into()),
    }
}

/// Per-owner reads over NATS: owner A's `reader` and `publisher` read A's view by its
/// key and follow it; B's get nothing of A's job (no view, no progress, no event, not
/// even the list of keys), and B's reader reads B's own job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owners_nats_users_read_only_that_owners_jobs() {
    let mut stack = Stack::start(StackOptions::default()).await;
    let a_reader = stack.add_reader(TEST_OWNER).await;
    let a_publisher = stack.add_publisher(TEST_OWNER).await;
    let b_reader = stack.add_reader("globex").await;
    let b_publisher = stack.add_publisher("globex").await;
    let (_, b) = stack.submit(&job_body(&stack, "owner-a", Some(json!({"sleep_ms": 300})))).await;
    let id = job_id(&b);
    let ended = stack.wait_terminal(&id, T).await;
    let key = names::view_key(Some(TEST_OWNER), &id);

    // A's users: the view by its key, and its updates by a plain subscription.
    for user in [&a_reader, &a_publisher] {
        let (client, _) = watched(&stack, user).await;
        let m = view_by_key(&client, &key).await.unwrap_or_else(|e| panic!("{user} reads its owner's view: {e}"));
        let v: JobView = serde_json::from_slice(&m.payload).unwrap_or_else(|e| panic!("{user}: {e}: {m:?}"));
        assert_eq!((v.job_id.clone(), v.status), (id.clone(), JobStatus::Succeeded));
        let mut follow = client.subscribe(format!("$KV.{}.{key}", names::JOBS_BUCKET)).await.unwrap();
        client.flush().await.unwrap();
        let op = stack.connect_as(OPERATOR).await;
        let kv = jetstream::new(op).get_key_value(names::JOBS_BUCKET).await.unwrap();
        kv.put(key.as_str(), serde_json::to_vec(&ended).unwrap().into()).await.unwrap();
        let heard = tokio::time::timeout(T, futures::StreamExt::next(&mut follow)).await.unwrap().unwrap();
        assert_eq!(serde_json::from_slice::<JobView>(&heard.payload).unwrap().job_id, id, "{user}");
    }

    // B's users: nothing of A's job.
    for user in [&b_reader, &b_publisher] {
        let (client, errors) = watched(&stack, user).await;
        assert_denied(&format!("{user} reads A's view"), view_by_key(&client, &key).await);
        assert_denied(&format!("{user} reads A's view by id"), view_by_key(&client, id.as_str()).await);
        let js = short(&client);
        denied(&format!("{user} lists the bucket's keys"), js.get_stream(format!("KV_{}", names::JOBS_BUCKET)).await);
        let log = js.get_stream_no_info(names::JOBS_STREAM).await.unwrap();
        denied(&format!("{user} reads A's events"), log.direct_get_last_for_subject(names::job_filter(&id)).await);
        let progress = js.get_stream_no_info(names::PROGRESS_STREAM).await.unwrap();
        denied(
            &format!("{user} reads A's progress"),
            progress.direct_get_last_for_subject(job_subject(&id, SubjectKind::Progress)).await,
        );
        for subject in [
            format!("$KV.{}.{key}", names::JOBS_BUCKET),
            format!("$KV.{}.>", names::JOBS_BUCKET),
            job_subject(&id, SubjectKind::Progress),
            format!("stemq.jobs.{id}.>"),
        ] {
            errors.lock().unwrap().clear();
            let mut sub = client.subscribe(subject.clone()).await.unwrap();
            client.flush().await.unwrap();
            wait_error(&errors, "Permissions Violation for Subscription").await;
            // Nothing arrives, even when the view changes.
            let op = stack.connect_as(OPERATOR).await;
            let kv = jetstream::new(op).get_key_value(names::JOBS_BUCKET).await.unwrap();
            kv.put(key.as_str(), serde_json::to_vec(&ended).unwrap().into()).await.unwrap();
            let heard = tokio::time::timeout(Duration::from_millis(300), futures::StreamExt::next(&mut sub)).await;
            assert!(!matches!(heard, Ok(Some(_))), "{user} heard {subject}");
        }
    }

    // B's reader reads B's own jobs.
    let theirs = request_of(&stack, "owner-b", "globex");
    let theirs_id = theirs.subject.clone();
    stack.js.publish(routed(&theirs_id, "globex"), theirs.to_bytes()).await.unwrap().await.unwrap();
    stack.wait_terminal(&theirs_id, T).await;
    let (client, _) = watched(&stack, &b_reader).await;
    let m = view_by_key(&client, &names::view_key(Some("globex"), &theirs_id)).await.expect("B reads its own view");
    assert_eq!(serde_json::from_slice::<JobView>(&m.payload).unwrap().job_id, theirs_id);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_without_its_inbox_prefix_gets_no_answers() {
    // The inbox is per user: a client on the default `_INBOX` cannot subscribe to it,
    // so every request of its goes unanswered (and cannot read anyone else's replies).
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let creds = Credentials::load(&stack.server.credentials(STATUS_READER)).unwrap();
    let c = async_nats::ConnectOptions::with_nkey(creds.seed().to_string()).connect(stack.server.url()).await.unwrap();
    denied("a request without the user's inbox prefix", short(&c).get_key_value(names::JOBS_BUCKET).await);
    stack.shutdown().await;
}

#[test]
fn job_ids_differ_per_owner() {
    // What the owner binding rests on: the owner is part of the request, so the same
    // song for two owners is two jobs with two subjects.
    let body = json!({"audio_uri": "file:///x.wav"});
    let a = JobRequest::from_value(body.clone()).unwrap().normalize("acme").unwrap().job_id();
    let g = JobRequest::from_value(body).unwrap().normalize("globex").unwrap().job_id();
    assert_ne!(a, g);
    let _: &JobId = &a;
}

/// `stemq nats users add-publisher` on the folder of a running server: the server
/// reloads and the new publisher connects at once, for its owner only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_adds_a_publisher_that_can_connect_at_once() {
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let data_dir = stack.dir.path().to_path_buf();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(Stack::stemq_bin())
            .args(["nats", "users", "add-publisher", "--owner", "cli.owner"])
            .env("STEMQ_DATA_DIR", data_dir)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let user = format!("publisher-{}", stemq_core::request::owner_token("cli.owner"));
    assert!(stdout.contains(&user) && stdout.contains("reloaded"), "{stdout}");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(stack.server.credentials(&user)).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);

    let c = stack.connect_as(&user).await;
    let js = short(&c);
    let mine = request_of(&stack, "cli-owner-job", "cli.owner");
    js_publish(&js, routed(&mine.subject, "cli.owner"), &mine, None).await.expect("its own owner");
    let other = request_of(&stack, "not-mine", "anonymous");
    assert_denied("another owner", js_publish(&js, routed(&other.subject, "anonymous"), &other, None).await);
    stack.shutdown().await;
}

/// A worker's registry entry, as a forger would write it: a worker named `name` that
/// claims to serve every model.
fn forged_worker(name: &str) -> Vec<u8> {
    let now = chrono::Utc::now();
    serde_json::to_vec(&stemq_nats::registry::WorkerInfo {
        name: name.into(),
        models: Model::ALL.to_vec(),
        devices: vec!["cuda:0".into()],
        engine: "demucs".into(),
        version: "0".into(),
        concurrency: 64,
        running: 0,
        free_memory_bytes: None,
        gpu_free_memory_bytes: Default::default(),
        started_at: now,
        heartbeat_at: now,
    })
    .unwrap()
}

/// A JetStream publish of raw `body` to `subject`: the sequence, or the error (a timeout
/// when the server refused it).
async fn js_put(js: &jetstream::Context, subject: String, body: Vec<u8>) -> Result<u64, String> {
    match js.publish(subject, body.into()).await {
        Ok(ack) => ack.await.map(|a| a.sequence).map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    }
}

/// Issue 12: only workers announce themselves. Anyone else who could write the registry
/// could make `GET /v1/workers`, `stemq top` and the alerts show a fleet that is not
/// there (a worker "serving" a model nobody runs hides `StemqJobsWaitingForWorker`, and
/// an ingress that refuses unserved models would accept them). Every other service user
/// and a publisher are refused a put, through the KV API where they may open the bucket
/// (the queue exporters read it) and as a raw publish on `$KV.stemq_workers.<key>`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_workers_write_the_worker_registry() {
    let mut stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let acme = stack.add_publisher("acme").await;
    let registry = stack.js.get_key_value(names::WORKERS_BUCKET).await.unwrap();
    for user in [INGRESS, PROJECTOR, RELAY, STATUS_READER, acme.as_str()] {
        let c = stack.connect_as(user).await;
        let js = short(&c);
        let name = format!("ghost-{user}");
        let key = stemq_nats::registry::key_of(&name);
        if let Ok(kv) = js.get_key_value(names::WORKERS_BUCKET).await {
            // Readers (the ingress, the queue exporters) open it; the write is refused.
            assert!([INGRESS, PROJECTOR, RELAY].contains(&user), "{user} opens the worker registry");
            denied(&format!("{user} announces a worker"), kv.put(&key, forged_worker(&name).into()).await);
            denied(&format!("{user} removes a worker"), kv.delete(&key).await);
        }
        let subject = format!("$KV.{}.{key}", names::WORKERS_BUCKET);
        assert_denied(&format!("{user} publishes a registry entry"), js_put(&js, subject, forged_worker(&name)).await);
        assert!(registry.get(&key).await.unwrap().is_none(), "{user} wrote the registry");
    }
    assert!(stemq_nats::registry::live(&registry).await.unwrap().is_empty(), "a forged worker is live");

    // A worker may: it announces itself, and the operator reads it back.
    let c = stack.connect_as(WORKER).await;
    let kv = short(&c).get_key_value(names::WORKERS_BUCKET).await.expect("the worker opens the registry");
    kv.put(stemq_nats::registry::key_of("w-real"), forged_worker("w-real").into()).await.expect("a worker announces");
    let live = stemq_nats::registry::live(&registry).await.unwrap();
    assert_eq!(live.iter().map(|w| w.name.as_str()).collect::<Vec<_>>(), ["w-real"]);
    stack.shutdown().await;
}

/// Issue 12: a worker pulls only from the pools. The `projector` consumer (every event
/// of every job) and the unrouted `workers` consumer (the ingress's router's) are not its
/// to pull: a pull request there is refused by the server (no answer; a `Permissions
/// Violation` on the connection), while the same request on a pool consumer is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_pulls_from_no_consumer_but_its_pools() {
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let (client, errors) = watched(&stack, WORKER).await;
    // One message, without waiting: a pool with nothing in it answers "no messages".
    let pull = || json!({"batch": 1, "no_wait": true}).to_string();
    let next = |consumer: &str| format!("$JS.API.CONSUMER.MSG.NEXT.{}.{consumer}", names::JOBS_STREAM);
    let pool = names::pool_consumer(Model::Dsp, Priority::Interactive);
    let answer = tokio::time::timeout(T, client.request(next(&pool), pull().into())).await;
    assert!(matches!(answer, Ok(Ok(_))), "a pull on its own pool {pool} got no answer: {answer:?}");
    for consumer in [names::PROJECTOR_CONSUMER, names::WORKERS_CONSUMER] {
        let r = tokio::time::timeout(DENIED, client.request(next(consumer), pull().into())).await;
        assert!(!matches!(r, Ok(Ok(_))), "the worker pulled from {consumer}: {r:?}");
        wait_error(&errors, &format!("Publish to \"{}\"", next(consumer))).await;
        // Nor through the client API (the same request, with a JetStream timeout).
        let js = short(&client);
        let c: jetstream::consumer::PullConsumer = match js.get_consumer_from_stream(consumer, names::JOBS_STREAM).await
        {
            Ok(c) => c,
            // It may read their info (the queue figures) but needs not to.
            Err(_) => continue,
        };
        let batch = c.fetch().max_messages(1).expires(DENIED).messages().await;
        if let Ok(mut batch) = batch {
            let first = tokio::time::timeout(2 * DENIED, futures::StreamExt::next(&mut batch)).await;
            assert!(!matches!(first, Ok(Some(Ok(_)))), "the worker fetched from {consumer}: {first:?}");
        }
    }
    stack.shutdown().await;
}

/// The queue figures (`--queue-metrics`) may be exported by the projector (the deployed
/// exporter), the relay or a worker: each reads every pool's consumer, the unrouted
/// `workers` consumer and the worker registry with its own user, so no figure goes
/// missing under least privilege.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_exporters_read_every_pool_and_the_registry() {
    let stack = Stack::start(StackOptions { workers: 1, ..Default::default() }).await;
    let t0 = std::time::Instant::now();
    let registry = stack.js.get_key_value(names::WORKERS_BUCKET).await.unwrap();
    while stemq_nats::registry::live(&registry).await.unwrap().is_empty() {
        assert!(t0.elapsed() < T, "the in-process worker never announced itself");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for user in [PROJECTOR, RELAY, WORKER] {
        let c = stack.connect_as(user).await;
        let q = stemq_nats::queue_figures::read_queue(&jetstream::new(c)).await;
        assert_eq!(q.lanes.len(), names::pool_consumers().len(), "{user} reads every pool: {q:?}");
        assert!(q.unrouted.is_some() && q.projector.is_some(), "{user}: {q:?}");
        assert_eq!(q.serving(Model::Dsp), Some(1), "{user} reads the registry: {q:?}");
        assert_eq!(q.waiting_for_worker(Model::Htdemucs), Some(0), "{user}");
    }
    stack.shutdown().await;
}

/// Issue 15: credits are minted by operators only. A movement on an owner's ledger
/// subject is refused for the ingress, the relay, the status reader and publishers
/// (a grant there would be free money); only workers (reservations) and the projector
/// (settlements) write it, and nobody but the operator sets the price list (a service
/// that could would set every price to 0).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_operator_mints_credits_or_sets_prices() {
    use stemq_accounts::ledger::{self, Kind, Ledger};
    let mut stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let acme = stack.add_publisher("acme").await;
    let grant = |amount: i64| {
        serde_json::to_vec(&ledger::Entry {
            owner: "acme".into(),
            time: chrono::Utc::now(),
            movement: ledger::Movement::Granted { amount, by: "forger".into(), note: None },
        })
        .unwrap()
    };
    for user in [INGRESS, RELAY, STATUS_READER, acme.as_str()] {
        let c = stack.connect_as(user).await;
        let js = short(&c);
        for subject in
            Kind::ALL.map(|k| ledger::ledger_subject("acme", k)).into_iter().chain([ledger::legacy_subject("acme")])
        {
            assert_denied(&format!("{user} writes {subject}"), js_put(&js, subject.clone(), grant(1_000_000)).await);
        }
        if let Ok(kv) = js.get_key_value(ledger::CONFIG_BUCKET).await {
            assert_eq!(user, INGRESS, "{user} opens the configuration bucket");
            denied(
                &format!("{user} sets the prices"),
                kv.put(ledger::PRICES_KEY, b"{\"per_audio_minute\":{}}".to_vec().into()).await,
            );
        }
        let subject = format!("$KV.{}.{}", ledger::CONFIG_BUCKET, ledger::PRICES_KEY);
        assert_denied(&format!("{user} publishes prices"), js_put(&js, subject, b"{}".to_vec()).await);
    }
    for user in [WORKER, PROJECTOR] {
        let c = stack.connect_as(user).await;
        let js = short(&c);
        let kv = js.get_key_value(ledger::CONFIG_BUCKET).await;
        if let Ok(kv) = kv {
            denied(&format!("{user} sets the prices"), kv.put(ledger::PRICES_KEY, b"{}".to_vec().into()).await);
        }
    }
    let (account, seq) = Ledger::new(stack.js.clone()).account("acme").await.unwrap();
    assert_eq!((account.balance, seq), (0, 0), "a forged grant reached the ledger");
    // The ingress reads an account (for GET /v1/account and the 402).
    let c = stack.connect_as(INGRESS).await;
    Ledger::new(short(&c)).account("acme").await.expect("the ingress reads accounts");
    stack.shutdown().await;
}

/// Issue 39, finding 1: the `worker` and `projector` users could write any movement on
/// any owner's ledger (a forged grant was accepted; `{}` made the account unreadable).
/// Now each kind of movement has a subject of its own that one role may write: grants
/// the operator, reservations (and their release) workers, settlements and refunds the
/// projector. The attack (read bob's last entry, then publish a grant after it
/// with `Nats-Expected-Last-Subject-Sequence`) is refused on every subject but the
/// user's own kinds; what it may still write there (a grant, `{}`, another owner's
/// entry) is left out of the account and counted, the account reads as before, and the
/// next real movement is recorded after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_credit_movement_is_written_by_its_own_role_and_misfits_are_left_out() {
    use stemq_accounts::ledger::{self, Entry, Kind, Ledger, Movement, MICRO};
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let operator = Ledger::new(stack.js.clone());
    for owner in ["alice", "bob"] {
        operator.grant(owner, 5 * MICRO, "test", None, &format!("g-{owner}")).await.unwrap();
    }
    let entry = |owner: &str, movement: Movement| {
        serde_json::to_vec(&Entry { owner: owner.into(), time: chrono::Utc::now(), movement }).unwrap()
    };
    let free_money = Movement::Granted { amount: 1_000_000 * MICRO, by: "forger".into(), note: None };
    let skipped = || {
        let text = stemq_telemetry::metrics::metrics().render();
        text.lines()
            .filter(|l| l.starts_with("stemq_ledger_entries_skipped_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    let skipped_before = skipped();
    for user in [WORKER, PROJECTOR] {
        let c = stack.connect_as(user).await;
        let js = short(&c);
        let log = js.get_stream_no_info(ledger::LEDGER_STREAM).await.unwrap();
        let last = log.direct_get_last_for_subject(ledger::ledger_subject("bob", Kind::Granted)).await.unwrap();
        for subject in Kind::ALL
            .into_iter()
            .filter(|k| k.writer() != user)
            .map(|k| ledger::ledger_subject("bob", k))
            .chain([ledger::legacy_subject("bob")])
        {
            let mut h = async_nats::HeaderMap::new();
            h.insert("Nats-Expected-Last-Subject-Sequence", last.sequence.to_string().as_str());
            let r = match js.publish_with_headers(subject.clone(), h, entry("bob", free_money.clone()).into()).await {
                Ok(ack) => ack.await.map(|a| a.sequence).map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            assert_denied(&format!("{user} grants on {subject}"), r);
        }
        // Its own kinds' subjects take what it sends, and the fold leaves it out.
        for kind in Kind::ALL.into_iter().filter(|k| k.writer() == user) {
            for (owner, body) in [
                ("bob", entry("bob", free_money.clone())),
                ("alice", b"{}".to_vec()),
                ("alice", entry("bob", free_money.clone())),
            ] {
                let subject = ledger::ledger_subject(owner, kind);
                js_put(&js, subject.clone(), body).await.unwrap_or_else(|e| panic!("{user} on {subject}: {e}"));
            }
        }
    }
    // Every account reads as the operator left it, in a reader that never saw it...
    let fresh = Ledger::new(stack.js.clone());
    for owner in ["alice", "bob"] {
        let (a, _) = fresh.account(owner).await.unwrap_or_else(|e| panic!("{owner}'s account: {e}"));
        assert_eq!((a.balance, a.granted), (5 * MICRO, 5 * MICRO), "{owner}: {a:?}");
        let entries = fresh.entries(owner, None).await.unwrap();
        assert_eq!(entries.len(), 1, "{owner}: only the operator's grant counts: {entries:?}");
    }
    // ...and in one that did (it reads only what came since).
    assert_eq!(operator.account("alice").await.unwrap().0.balance, 5 * MICRO);
    // Each misfit was counted (3 per writer's kind, each by the two readers).
    let counted = skipped() - skipped_before;
    assert!(counted >= 9.0, "misfits counted: {counted}");
    // The ledger goes on: a grant after the misfits is recorded and read.
    let (_, after) = operator.grant("alice", MICRO, "test", None, "g-again").await.unwrap();
    assert_eq!(after.balance, 6 * MICRO);
    assert_eq!(fresh.account("alice").await.unwrap().0.balance, 6 * MICRO);
    stack.shutdown().await;
}

/// Issue 39, finding 4: a user that may create consumers may create a *push* consumer,
/// and the server then publishes every matching message to its `deliver_subject`,
/// whatever that subject is: `status-reader` could make `KV_stemq_jobs` deliver views
/// onto `stemq.jobs.<id>.cancel_requested` (stored in the log, heard by workers), and a
/// worker could make its own registry entry (any bytes it writes) land on an owner's
/// grant subject. No user but the operator and the ingress may create a consumer now:
/// the status reader reads views by direct get and follows them by a plain subscription,
/// and the services read the worker registry by direct get.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_cannot_create_consumers_that_deliver_anywhere() {
    use stemq_accounts::ledger::{self, Kind};
    let stack = Stack::start(StackOptions::default()).await;
    let (_, b) = stack.submit(&job_body(&stack, "deliver-me", None)).await;
    let id = job_id(&b);
    stack.wait_terminal(&id, T).await;
    let cancel = job_subject(&id, SubjectKind::CancelRequested);
    let grant = ledger::ledger_subject("acme", Kind::Granted);
    for (user, stream, deliver) in [
        (STATUS_READER, "KV_stemq_jobs", cancel.clone()),
        (WORKER, "KV_stemq_workers", grant.clone()),
        (PROJECTOR, "KV_stemq_workers", grant.clone()),
        (RELAY, "KV_stemq_workers", cancel.clone()),
    ] {
        let c = stack.connect_as(user).await;
        let js = short(&c);
        let s = js.get_stream_no_info(stream).await.unwrap();
        let config = jetstream::consumer::push::Config {
            deliver_subject: deliver.clone(),
            deliver_policy: jetstream::consumer::DeliverPolicy::All,
            ..Default::default()
        };
        denied(
            &format!("{user} creates a push consumer on {stream} delivering to {deliver}"),
            s.create_consumer(config).await,
        );
        let named = jetstream::consumer::push::Config {
            durable_name: Some(format!("evil-{user}")),
            deliver_subject: deliver.clone(),
            ..Default::default()
        };
        denied(&format!("{user} creates a durable push consumer on {stream}"), s.create_consumer(named).await);
    }
    // Nothing was delivered anywhere (give a consumer, had one been made, time to).
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(stack.count_on(&cancel).await, 0, "a view landed on the cancel subject");
    let ledger_stream = stack.js.get_stream_no_info(ledger::LEDGER_STREAM).await.unwrap();
    assert!(ledger_stream.direct_get_last_for_subject(grant.clone()).await.is_err(), "a delivery landed on {grant}");
    for s in ["KV_stemq_jobs", "KV_stemq_workers"] {
        let stream = stack.js.get_stream(s).await.unwrap();
        let mut consumers = stream.consumers();
        while let Some(info) = futures::StreamExt::next(&mut consumers).await {
            let deliver = info.unwrap().config.deliver_subject;
            assert!(
                deliver.as_deref() != Some(cancel.as_str()) && deliver.as_deref() != Some(grant.as_str()),
                "{s}: {deliver:?}"
            );
        }
    }
    // What they still do: the queue exporters (and the ingress's /metrics) read the
    // registry without a consumer.
    for user in [WORKER, PROJECTOR, RELAY, INGRESS] {
        let c = stack.connect_as(user).await;
        let bucket = short(&c).get_key_value(names::WORKERS_BUCKET).await.unwrap();
        let live =
            stemq_nats::registry::live(&bucket).await.unwrap_or_else(|e| panic!("{user} reads the registry: {e}"));
        assert!(!live.is_empty(), "{user} sees the stack's workers");
    }
    stack.shutdown().await;
}

/// Batches: only the ingress records a batch's rounds and which batches hold a job, only
/// the relay records a batch's end and its webhook attempts (a forged end would fire the
/// batch's webhook before its jobs are done; a forged round could add another owner's
/// jobs to a batch). Nobody else reads the batch log (its rounds name each owner's jobs)
/// or pulls the relay's batch consumers. Each denied write is checked against the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_ingress_records_batch_rounds_and_only_the_relay_ends_them() {
    use stemq_core::batch::{BatchEvent, BatchEventBody, BatchId, BatchSubmitted, ItemState};
    use stemq_nats::batch_log::{batch_subject, member_subject, BatchSubject};
    let mut stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let acme = stack.add_publisher("acme").await;
    let batch = BatchId::parse(&"b".repeat(64)).unwrap();
    let job = JobId::parse(&"a".repeat(64)).unwrap();
    let round = BatchSubmitted {
        owner: "acme".into(),
        items: vec![ItemState::Submitted { job_id: job.clone() }],
        webhook: None,
        metadata: None,
        created_at: chrono::Utc::now(),
        rounds: 1,
    };
    let forged = BatchEvent::new(&batch, "urn:test:forged", BatchEventBody::Submitted(round)).to_bytes().to_vec();
    let (submitted, ended, delivery, member) = (
        batch_subject(&batch, BatchSubject::Submitted),
        batch_subject(&batch, BatchSubject::Ended),
        batch_subject(&batch, BatchSubject::Delivery),
        member_subject(&job, &batch),
    );
    let log = stack.js.get_stream(names::BATCHES_STREAM).await.unwrap();
    let stored = |subject: String| {
        let log = log.clone();
        async move { log.direct_get_last_for_subject(subject).await.is_ok() }
    };
    for (user, subject) in [
        (WORKER, &submitted),
        (PROJECTOR, &submitted),
        (RELAY, &submitted),
        (STATUS_READER, &submitted),
        (acme.as_str(), &submitted),
        (INGRESS, &ended),
        (WORKER, &ended),
        (PROJECTOR, &ended),
        (acme.as_str(), &ended),
        (INGRESS, &delivery),
        (WORKER, &delivery),
        (acme.as_str(), &delivery),
        (WORKER, &member),
        (RELAY, &member),
        (acme.as_str(), &member),
    ] {
        let c = stack.connect_as(user).await;
        assert_denied(
            &format!("{user} publishes {subject}"),
            js_put(&short(&c), subject.clone(), forged.clone()).await,
        );
        assert!(!stored(subject.clone()).await, "{user} wrote {subject}");
    }
    // Reading the log, and pulling the relay's batch consumers, is the services' own.
    for user in [WORKER, PROJECTOR, STATUS_READER, acme.as_str()] {
        let c = stack.connect_as(user).await;
        let js = short(&c);
        let theirs = js.get_stream_no_info(names::BATCHES_STREAM).await.unwrap();
        denied(&format!("{user} reads the batch log"), theirs.direct_get_last_for_subject(submitted.clone()).await);
        for (consumer, stream) in [
            (names::RELAY_BATCHES_CONSUMER, names::BATCHES_STREAM),
            (names::RELAY_BATCH_OUTCOMES_CONSUMER, names::JOBS_STREAM),
        ] {
            let r = js.get_consumer_from_stream::<jetstream::consumer::pull::Config, _, _>(consumer, stream).await;
            denied(&format!("{user} opens {stream}/{consumer}"), r);
        }
    }
    let c = stack.connect_as(INGRESS).await;
    let js = short(&c);
    let r = js.get_consumer_from_stream::<jetstream::consumer::pull::Config, _, _>(
        names::RELAY_BATCHES_CONSUMER,
        names::BATCHES_STREAM,
    );
    denied("the ingress opens the relay's batch consumer", r.await);

    // The ingress records rounds and memberships, the relay ends and attempts.
    for (user, subject) in [(INGRESS, &member), (INGRESS, &submitted), (RELAY, &ended), (RELAY, &delivery)] {
        let c = stack.connect_as(user).await;
        js_put(&short(&c), subject.clone(), forged.clone())
            .await
            .unwrap_or_else(|e| panic!("{user} on {subject}: {e}"));
        assert!(stored(subject.clone()).await, "{subject}");
    }
    stack.shutdown().await;
}
