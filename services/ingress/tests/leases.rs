//! The leases of per-key limits against a real nats-server and its `stemq_limits`
//! bucket, two `Leases` standing for two ingress replicas: neither limit is exceeded
//! however the checks are spread, a big bucket is leased in few round trips, what a
//! replica does not use goes back to the other, and a stopped replica's hold is taken
//! over with its jobs.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::kv;
use stemq_accounts::auth::{Caller, Limits, Role};
use stemq_core::JobId;
use stemq_devkit::nats_server::NatsServer;
use stemq_ingress::leases::{Leases, SWEEP, TOKEN_LEASE};
use stemq_ingress::limits::{self, JobState};
use stemq_nats::{self as names, Settings};

struct Bench {
    _server: NatsServer,
    _dir: tempfile::TempDir,
    bucket: kv::Store,
}

async fn start() -> Bench {
    let dir = tempfile::tempdir().unwrap();
    let server = NatsServer::start_async(dir.path().join("nats"), 0)
        .await
        .expect("nats-server starts (is nats-server on PATH?)");
    let client = server.connect_as(stemq_nats::users::INGRESS, "test").await.unwrap();
    let operator = server.connect_as(stemq_nats::users::OPERATOR, "test").await.unwrap();
    names::apply(&async_nats::jetstream::new(operator), &Settings::default()).await.unwrap();
    let bucket = async_nats::jetstream::new(client).get_key_value(names::LIMITS_BUCKET).await.unwrap();
    Bench { _server: server, _dir: dir, bucket }
}

fn caller(key_id: &str, limits: Limits) -> Caller {
    Caller { key_id: key_id.into(), owner: "acme".into(), role: Role::Submit, limits, priority: Default::default() }
}

fn job(i: usize) -> JobId {
    JobId::parse(&format!("{i:064x}")).unwrap()
}

/// Which jobs have ended, as the list index would say.
#[derive(Clone, Default)]
struct Ended(Arc<Mutex<HashSet<JobId>>>);

impl Ended {
    fn end(&self, id: &JobId) {
        self.0.lock().unwrap().insert(id.clone());
    }
    fn known(&self) -> impl Fn(&JobId) -> JobState + '_ {
        move |id| if self.0.lock().unwrap().contains(id) { JobState::Gone } else { JobState::Live }
    }
}

async fn live(_: JobId) -> bool {
    true
}

/// 64 submits at once on each of two replicas get exactly the burst between them; then
/// the empty bucket is refused without a round trip, with a Retry-After that counts down.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_burst_is_exact_across_two_replicas() {
    let b = start().await;
    let (r1, r2) = (Arc::new(Leases::default()), Arc::new(Leases::default()));
    let c = caller("k1", Limits { rate: 0.01, burst: 10, max_in_flight: 0 });
    let checks = (0..128).map(|i| {
        let (r, bucket, c) = (if i % 2 == 0 { r1.clone() } else { r2.clone() }, b.bucket.clone(), c.clone());
        tokio::spawn(async move { r.spend(&bucket, &c).await.unwrap() })
    });
    let answers = futures::future::join_all(checks).await;
    let allowed = answers.iter().filter(|a| a.as_ref().unwrap().is_ok()).count();
    assert_eq!(allowed, 10, "the burst is 10");
    let refused = answers.into_iter().find_map(|a| a.unwrap().err()).unwrap();
    assert_eq!(refused.limit, limits::Limit::Rate);
    assert!((90..=100).contains(&refused.retry_after), "one token in 100 s: {}", refused.retry_after);
}

/// A bucket far from empty is leased: 1 000 submits one after another cost a few
/// compare-and-sets, not 1 000, and what a replica did not spend goes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_big_bucket_is_leased_and_the_rest_goes_back() {
    let b = start().await;
    let r = Leases::default();
    let c = caller("k2", Limits { rate: 1.0, burst: 100_000, max_in_flight: 0 });
    for _ in 0..1000 {
        r.spend(&b.bucket, &c).await.unwrap().expect("allowed");
    }
    let writes = b.bucket.entry("rate.k2").await.unwrap().unwrap().revision;
    assert!(writes <= 8, "1 000 submits took {writes} writes of the bucket");
    let left = || async {
        let v = b.bucket.get("rate.k2").await.unwrap().unwrap();
        serde_json::from_slice::<serde_json::Value>(&v).unwrap()["tokens"].as_f64().unwrap()
    };
    assert!(left().await < 99_000.0, "the lease is out of the bucket");
    tokio::time::sleep(TOKEN_LEASE).await;
    r.sweep(&b.bucket, &|_: &JobId| JobState::Live).await;
    let back = left().await;
    assert!((99_000.0..99_002.0).contains(&back), "1 000 spent of 100 000, {back} in the bucket");
}

/// The cap holds across two replicas; a slot freed on one replica goes back within two
/// sweeps, and the other replica can fill it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_cap_is_exact_and_freed_slots_go_back() {
    let b = start().await;
    let (r1, r2) = (Leases::default(), Leases::default());
    let ended = Ended::default();
    let mut admitted = Vec::new();
    for i in 0..10 {
        let r = if i % 2 == 0 { &r1 } else { &r2 };
        if r.admit(&b.bucket, "k3", 3, &job(i), ended.known(), live).await.unwrap().is_ok() {
            admitted.push(i);
        }
    }
    assert_eq!(admitted, vec![0, 1, 2], "the first 3, whichever replica");
    // Admitted again (a retried submit) is not a new job.
    assert!(r1.admit(&b.bucket, "k3", 3, &job(0), ended.known(), live).await.unwrap().is_ok());
    // Job 0 (on replica 1) ends: replica 2 gets its slot once replica 1 gives it back.
    ended.end(&job(0));
    assert!(r2.admit(&b.bucket, "k3", 3, &job(20), ended.known(), live).await.unwrap().is_err());
    for _ in 0..3 {
        r1.sweep(&b.bucket, &ended.known()).await;
        tokio::time::sleep(SWEEP).await;
    }
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert!(r2.admit(&b.bucket, "k3", 3, &job(21), ended.known(), live).await.unwrap().is_ok());
    assert!(r2.admit(&b.bucket, "k3", 3, &job(22), ended.known(), live).await.unwrap().is_err());
}

/// A replica that stopped renewing its hold is taken over: its listed jobs keep their
/// slots until they end, its unlisted slots stay taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_replicas_hold_is_taken_over_with_its_jobs() {
    let b = start().await;
    // Replica "gone" held 3 of 5 slots, renewed long ago; it listed 2 jobs.
    let holds = serde_json::json!({"by": {"gone": {"slots": 3, "at_ms": 0}}});
    b.bucket.put("slots.k4", serde_json::to_vec(&holds).unwrap().into()).await.unwrap();
    let listed = serde_json::json!({"jobs": {job(1).to_string(): 0, job(2).to_string(): 0}});
    b.bucket.put("slots.k4.gone", serde_json::to_vec(&listed).unwrap().into()).await.unwrap();
    let r = Leases::default();
    let ended = Ended::default();
    let ok = |i| {
        let (r, b, ended) = (&r, &b, &ended);
        async move { r.admit(&b.bucket, "k4", 5, &job(i), ended.known(), live).await.unwrap().is_ok() }
    };
    assert!(ok(10).await && ok(11).await, "two slots were free");
    assert!(!ok(12).await, "3 taken by the stopped replica's jobs");
    assert!(b.bucket.get("slots.k4.gone").await.unwrap().is_none(), "its list is taken over");
    // One of its listed jobs ends: its slot is free.
    ended.end(&job(1));
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert!(ok(13).await);
    assert!(!ok(14).await, "job 2 and the unlisted slot still count");
}
