//! The view writes of many jobs stored as one atomic batch (JetStream's batch publish,
//! ADR-50): the lanes' first write of each fold goes to one [`Writer`], which gathers
//! what the lanes have in flight, publishes it with each entry's compare-and-set
//! (`Nats-Expected-Last-Subject-Sequence`) and answers every write with its revision.
//! N writes cost N messages and two replies instead of 2N messages.
//!
//! A batch is all or nothing: when the server refuses it (one entry moved by another
//! writer, a limit, no answer in time), every write in it is answered "not stored" and
//! its fold writes alone, with the usual compare-and-set and re-read. A batch whose
//! commit went unanswered may still have been stored; the fold's own write then meets
//! the new revision, re-reads and finds nothing left to do.

use std::time::Duration;

use async_nats::header::{
    HeaderMap, NATS_BATCH_COMMIT, NATS_BATCH_COMMIT_FINAL, NATS_BATCH_ID, NATS_BATCH_SEQUENCE,
    NATS_EXPECTED_LAST_SUBJECT_SEQUENCE,
};
use async_nats::jetstream::kv;
use bytes::Bytes;
use futures::StreamExt;
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, warn};

/// The most writes one batch carries (the server's limit is 1000).
const MAX_BATCH: usize = 500;

/// How long a batch may wait for the server's answers before its writes go alone.
const ANSWER_WITHIN: Duration = Duration::from_secs(5);

/// One view write waiting for its batch.
struct Write {
    subject: String,
    body: Bytes,
    /// The entry's revision it expects (0: the key has none).
    revision: u64,
    done: oneshot::Sender<Option<u64>>,
}

/// Where the lanes send their first writes; a writer that is off answers each write
/// "not stored" at once, so the fold writes it alone.
#[derive(Clone)]
pub(crate) struct Writer {
    tx: Option<mpsc::Sender<Write>>,
    /// The bucket's subject prefix (`$KV.stemq_jobs.`).
    prefix: String,
}

impl Writer {
    /// A writer that batches nothing.
    pub(crate) fn off() -> Writer {
        Writer { tx: None, prefix: String::new() }
    }

    /// Starts the batch writer for `kv` when its stream takes atomic batches
    /// (`allow_atomic`, which `stemq nats apply` sets); otherwise [`Writer::off`].
    /// The writer ends when every clone is dropped.
    pub(crate) fn start(client: async_nats::Client, kv: &kv::Store) -> Writer {
        if !kv.stream.cached_info().config.allow_atomic_publish {
            debug!(bucket = %kv.name, "the bucket takes no atomic batches: views are written one by one");
            return Writer::off();
        }
        if kv.use_jetstream_prefix {
            // A JetStream API prefix (a domain) this writer does not know how to add.
            debug!(bucket = %kv.name, "the bucket is behind an API prefix: views are written one by one");
            return Writer::off();
        }
        let prefix = kv.put_prefix.clone().unwrap_or_else(|| kv.prefix.clone());
        let (tx, rx) = mpsc::channel(4 * MAX_BATCH);
        tokio::spawn(run(client, rx));
        Writer { tx: Some(tx), prefix }
    }

    /// Stores `body` under `key` if the entry's revision is still `revision`, in a batch
    /// with whatever other writes are waiting. `Some(revision)` once stored; `None` when
    /// it was not (the batch was refused, or the writer is off): the caller writes it
    /// alone.
    pub(crate) async fn write(&self, key: &str, body: Bytes, revision: u64) -> Option<u64> {
        let tx = self.tx.as_ref()?;
        let (done, answer) = oneshot::channel();
        let write = Write { subject: format!("{}{key}", self.prefix), body, revision, done };
        tx.send(write).await.ok()?;
        answer.await.ok().flatten()
    }
}

/// The server's answer to a batch's commit.
#[derive(serde::Deserialize)]
struct CommitAck {
    #[serde(default)]
    seq: u64,
    #[serde(default)]
    count: usize,
    error: Option<serde_json::Value>,
}

/// Gathers waiting writes into batches, one batch in flight at a time: while one is
/// out, the next gathers.
async fn run(client: async_nats::Client, mut rx: mpsc::Receiver<Write>) {
    let inbox = client.new_inbox();
    let token = inbox.rsplit('.').next().unwrap_or("stemq").to_string();
    let mut answers = match client.subscribe(format!("{inbox}.*")).await {
        Ok(s) => s,
        Err(e) => {
            warn!(error = %e, "cannot subscribe for batch answers; views are written one by one");
            // Dropping the receiver answers every write "not stored".
            return;
        }
    };
    let mut number: u64 = 0;
    let mut batch: Vec<Write> = Vec::new();
    while let Some(first) = rx.recv().await {
        batch.push(first);
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(w) => batch.push(w),
                Err(_) => break,
            }
        }
        if batch.len() < 3 {
            // Two writes alone cost what a batch of two does: no batch.
            for w in batch.drain(..) {
                let _ = w.done.send(None);
            }
            continue;
        }
        // One write a key: a second write of a key in one batch could not be checked
        // against the first (never the case: a job's fold writes once at a time).
        let mut keys = std::collections::HashSet::new();
        let (mut unique, mut repeated) = (Vec::with_capacity(batch.len()), Vec::new());
        for w in batch.drain(..) {
            if keys.insert(w.subject.clone()) {
                unique.push(w);
            } else {
                repeated.push(w);
            }
        }
        for w in repeated {
            let _ = w.done.send(None);
        }
        number += 1;
        let id = format!("{token}{number}");
        let reply = format!("{inbox}.{number}");
        let stored = publish(&client, &mut answers, &id, &reply, &unique).await;
        match stored {
            Ok(last) => {
                let n = unique.len() as u64;
                for (i, w) in unique.into_iter().enumerate() {
                    let _ = w.done.send(Some(last - (n - 1 - i as u64)));
                }
            }
            Err(why) => {
                debug!(batch = %id, writes = unique.len(), %why, "batch not stored; its writes go one by one");
                for w in unique {
                    let _ = w.done.send(None);
                }
            }
        }
    }
}

/// Publishes `writes` as batch `id`, the first and the last message with `reply` for
/// their answers, and waits for both. The last message's stream sequence once stored.
async fn publish(
    client: &async_nats::Client,
    answers: &mut async_nats::Subscriber,
    id: &str,
    reply: &str,
    writes: &[Write],
) -> Result<u64, String> {
    let last = writes.len();
    for (i, w) in writes.iter().enumerate() {
        let mut headers = HeaderMap::new();
        headers.insert(NATS_BATCH_ID, id);
        headers.insert(NATS_BATCH_SEQUENCE, (i + 1).to_string().as_str());
        headers.insert(NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, w.revision.to_string().as_str());
        if i + 1 == last {
            headers.insert(NATS_BATCH_COMMIT, NATS_BATCH_COMMIT_FINAL);
        }
        let sent = if i == 0 || i + 1 == last {
            client.publish_with_reply_and_headers(w.subject.clone(), reply.to_string(), headers, w.body.clone()).await
        } else {
            client.publish_with_headers(w.subject.clone(), headers, w.body.clone()).await
        };
        sent.map_err(|e| format!("publish: {e}"))?;
    }
    // Two answers: the start's (empty, or an error) and the commit's (a pub ack). Answers
    // to an earlier batch that gave up waiting are skipped.
    let deadline = tokio::time::Instant::now() + ANSWER_WITHIN;
    let mut started = false;
    loop {
        let msg = match tokio::time::timeout_at(deadline, answers.next()).await {
            Ok(Some(m)) => m,
            Ok(None) => return Err("the answers' subscription ended".into()),
            Err(_) => return Err("no answer in time".into()),
        };
        if msg.subject.as_str() != reply {
            continue;
        }
        if !started {
            started = true;
            if msg.payload.is_empty() {
                continue;
            }
            // An error for the start; or, from a server that knows no batches, the first
            // write's own pub ack: only the commit's answer says what was stored.
            if String::from_utf8_lossy(&msg.payload).contains("\"error\"") {
                return Err(format!("start refused: {}", String::from_utf8_lossy(&msg.payload)));
            }
            continue;
        }
        let ack: CommitAck =
            serde_json::from_slice(&msg.payload).map_err(|e| format!("commit answer does not parse: {e}"))?;
        if let Some(error) = ack.error {
            return Err(format!("commit refused: {error}"));
        }
        if ack.count != last || ack.seq < last as u64 {
            return Err(format!("commit stored {} of {last} writes (sequence {})", ack.count, ack.seq));
        }
        return Ok(ack.seq);
    }
}

#[cfg(test)]
mod tests {
    use async_nats::jetstream::{self, kv, stream};
    use stemq_devkit::nats_server::{NatsServer, ServerOptions};

    use super::*;

    async fn bucket(server: &NatsServer, atomic: bool) -> (async_nats::Client, kv::Store) {
        let client = stemq_nats::connect(&server.url(), "test").await.unwrap();
        let js = jetstream::new(client.clone());
        js.create_key_value(kv::Config { bucket: "views".into(), history: 1, ..Default::default() }).await.unwrap();
        if atomic {
            let mut s = js.get_stream("KV_views").await.unwrap();
            let mut config: stream::Config = s.info().await.unwrap().config.clone();
            config.allow_atomic_publish = true;
            js.update_stream(config).await.unwrap();
        }
        (client.clone(), js.get_key_value("views").await.unwrap())
    }

    fn server(dir: &std::path::Path) -> NatsServer {
        NatsServer::start_with(dir, ServerOptions { auth: false, ..Default::default() })
            .expect("nats-server >= 2.12 on PATH (scripts/install-nats.sh)")
    }

    /// Writes sent together are stored together, each at its own revision; a batch one
    /// entry of which was moved stores nothing and answers every write "not stored".
    #[tokio::test]
    async fn writes_sent_together_are_stored_together_or_not_at_all() {
        let dir = tempfile::tempdir().unwrap();
        let server = server(dir.path());
        let (client, kv) = bucket(&server, true).await;
        let writer = Writer::start(client, &kv);
        let write = |key: String, revision: u64| {
            let writer = writer.clone();
            async move { writer.write(&key, Bytes::from(key.clone()), revision).await }
        };
        let keys: Vec<String> = (0..8).map(|i| format!("k{i}")).collect();
        let stored = futures::future::join_all(keys.iter().map(|k| write(k.clone(), 0))).await;
        let revisions: Vec<u64> = stored.iter().map(|r| r.expect("stored in a batch")).collect();
        for (k, revision) in keys.iter().zip(&revisions) {
            let entry = kv.entry(k).await.unwrap().expect("the entry exists");
            assert_eq!((entry.revision, entry.value.as_ref()), (*revision, k.as_bytes()), "{k}");
        }
        // k3 moves under the writer; a batch that still expects its old revision
        // stores none of its writes.
        kv.put("k3", "moved".into()).await.unwrap();
        let again = futures::future::join_all(keys.iter().zip(&revisions).map(|(k, r)| write(k.clone(), *r))).await;
        assert!(again.iter().all(Option::is_none), "a refused batch stores nothing: {again:?}");
        for (k, revision) in keys.iter().zip(&revisions).filter(|(k, _)| *k != "k3") {
            assert_eq!(kv.entry(k).await.unwrap().unwrap().revision, *revision, "{k} was not written");
        }
    }

    /// A bucket whose stream takes no atomic batches gets no batches: every write is
    /// left to be made alone.
    #[tokio::test]
    async fn a_bucket_without_atomic_batches_gets_none() {
        let dir = tempfile::tempdir().unwrap();
        let server = server(dir.path());
        let (client, kv) = bucket(&server, false).await;
        let writer = Writer::start(client, &kv);
        let stored = futures::future::join_all((0..4).map(|i| {
            let writer = writer.clone();
            async move { writer.write(&format!("k{i}"), Bytes::from_static(b"v"), 0).await }
        }))
        .await;
        assert!(stored.iter().all(Option::is_none));
        assert!(kv.entry("k0").await.unwrap().is_none());
    }
}
