//! Hearing of new requests: the worker's wake subscriptions, one per lane it serves.
//!
//! This module owns when a worker listens. A pull consumer's clients are not told that
//! something arrived, so a worker subscribes to the request subjects of its lanes
//! (`stemq.jobs.*.requested.*.<model>.<lane>`, plain NATS) and a request it hears
//! wakes its dispatcher ([`crate::Heard`]). Each such announcement is one more message
//! through the server per request and per worker that serves its lane.
//!
//! **A lane with a backlog is not listened to.** While every look at a lane comes back
//! full, the dispatcher looks at it again whenever a slot frees, whatever it hears; an
//! announcement then only costs. After [`DEAF_AFTER`] of full looks the lane's
//! subscription is dropped; the first look that finds the lane drained subscribes again,
//! waits until the server has the subscription (a flush), and has the lane looked at
//! once more, since a request stored between that look and the subscription was not
//! heard. So a saturated fleet pays no announcements (a request reached every worker
//! of its pool before: N messages a job for N workers), an idle worker hears every
//! request at once, and a lane changes state at most once per [`DEAF_AFTER`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use stemq_nats as names;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

use crate::{Heard, WorkerError};

/// How long every look at a lane must have come back full before its subscription is
/// dropped.
pub const DEAF_AFTER: Duration = Duration::from_millis(200);

/// Longest wait for the server to confirm a new subscription.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(1);

/// The wake subscriptions of a worker's lanes (in the dispatcher's lane order).
pub(crate) struct Ears {
    client: async_nats::Client,
    heard: Arc<Heard>,
    wake: Arc<tokio::sync::Notify>,
    tracker: TaskTracker,
    shutdown: CancellationToken,
    /// Per lane: the stop of its listening task, while it listens.
    listening: Vec<Option<CancellationToken>>,
    /// Per lane: since when every look at it came back full.
    full_since: Vec<Option<Instant>>,
}

impl Ears {
    /// Subscribes to every lane's requests; the listening tasks run on `tracker` until
    /// `shutdown`.
    pub(crate) async fn open(
        client: async_nats::Client,
        heard: Arc<Heard>,
        wake: Arc<tokio::sync::Notify>,
        tracker: TaskTracker,
        shutdown: CancellationToken,
    ) -> Result<Ears, WorkerError> {
        let n = heard.routes.len();
        let mut ears =
            Ears { client, heard, wake, tracker, shutdown, listening: vec![None; n], full_since: vec![None; n] };
        for i in 0..n {
            ears.listen(i).await?;
        }
        Ok(ears)
    }

    /// Whether lane `i` is listened to.
    pub(crate) fn listens(&self, i: usize) -> bool {
        self.listening[i].is_some()
    }

    async fn listen(&mut self, i: usize) -> Result<(), WorkerError> {
        let (model, lane) = self.heard.routes[i];
        let mut sub = self.client.subscribe(names::pool_filter(model, lane)).await.map_err(WorkerError::Subscribe)?;
        let stop = self.shutdown.child_token();
        let (heard, wake, until) = (self.heard.clone(), self.wake.clone(), stop.clone());
        self.tracker.spawn(async move {
            loop {
                tokio::select! {
                    _ = until.cancelled() => {
                        let _ = sub.unsubscribe().await;
                        return;
                    }
                    m = sub.next() => match m {
                        Some(_) => {
                            heard.announce(i);
                            wake.notify_one();
                        }
                        None => return,
                    },
                }
            }
        });
        self.listening[i] = Some(stop);
        Ok(())
    }

    /// After a look at lane `i` that came back `full` (or not): stops listening to a
    /// lane full for [`DEAF_AFTER`], listens again to a drained one. Returns whether the
    /// lane is to be taken as full (looked at on the next look): also when it was just
    /// listened to again, or could not be.
    pub(crate) async fn after_look(&mut self, i: usize, full: bool) -> bool {
        if full {
            let since = *self.full_since[i].get_or_insert_with(Instant::now);
            if since.elapsed() >= DEAF_AFTER {
                if let Some(stop) = self.listening[i].take() {
                    debug!(lane = ?self.heard.routes[i], "a backlog: not listening to the lane's requests");
                    stop.cancel();
                }
            }
            return true;
        }
        self.full_since[i] = None;
        if self.listens(i) {
            return false;
        }
        // Drained: listen again, and look once more once the server has the subscription.
        match self.listen(i).await {
            Ok(()) => {
                // Bounded: a connection that just went away must not hold the dispatcher
                // (the subscription is sent again on reconnection, and the lane is
                // looked at again either way).
                match tokio::time::timeout(FLUSH_TIMEOUT, self.client.flush()).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => warn!(error = %e, "flush after subscribing failed; the lane is looked at again"),
                    Err(_) => warn!("flush after subscribing unanswered; the lane is looked at again"),
                }
                debug!(lane = ?self.heard.routes[i], "drained: listening to the lane's requests again");
            }
            Err(e) => warn!(error = %e, "cannot subscribe to a lane's requests; looking at it on every look"),
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stemq_core::request::{Model, Priority};
    use stemq_devkit::nats_server::{NatsServer, ServerOptions};

    /// A lane full for [`DEAF_AFTER`] stops hearing requests; once drained it hears
    /// them again, and asks to be looked at once more.
    #[tokio::test]
    async fn a_lane_with_a_backlog_is_not_listened_to_until_it_drains() {
        let dir = tempfile::tempdir().unwrap();
        let server = NatsServer::start_with(dir.path(), ServerOptions { auth: false, ..Default::default() })
            .expect("nats-server >= 2.11 on PATH (scripts/install-nats.sh)");
        let client = stemq_nats::connect(&server.url(), "test").await.unwrap();
        let routes = vec![(Model::Dsp, Priority::Interactive), (Model::Dsp, Priority::Batch)];
        let heard = Arc::new(Heard::new(routes));
        let (tracker, stop) = (TaskTracker::new(), CancellationToken::new());
        let wake = Arc::new(tokio::sync::Notify::new());
        let mut ears = Ears::open(client.clone(), heard.clone(), wake, tracker.clone(), stop.clone()).await.unwrap();
        let publisher = stemq_nats::connect(&server.url(), "publisher").await.unwrap();
        let announce = |n: u32| {
            let publisher = publisher.clone();
            async move {
                let subject = format!("stemq.jobs.{n:064x}.requested.tok.dsp.interactive");
                publisher.publish(subject, "{}".into()).await.unwrap();
                publisher.flush().await.unwrap();
            }
        };
        // Heard: a request of the lane is announced.
        announce(1).await;
        let heard_at = |h: &Heard| h.at(0);
        tokio::time::timeout(Duration::from_secs(5), async {
            while heard_at(&heard) == 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the lane's request is heard");

        // Full looks for less than DEAF_AFTER: still listening.
        assert!(ears.after_look(0, true).await);
        assert!(ears.listens(0));
        tokio::time::sleep(DEAF_AFTER).await;
        assert!(ears.after_look(0, true).await, "a full lane is looked at again");
        assert!(!ears.listens(0), "full for DEAF_AFTER: not listened to");
        assert!(ears.listens(1), "the other lane still is");
        tokio::time::sleep(Duration::from_millis(50)).await;
        let before = heard_at(&heard);
        tokio::time::sleep(Duration::from_millis(5)).await;
        announce(2).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(heard_at(&heard), before, "a request of a lane not listened to is not heard");

        // Drained: listening again, and the lane is to be looked at once more.
        assert!(ears.after_look(0, false).await, "looked at once more after subscribing again");
        assert!(ears.listens(0));
        assert!(!ears.after_look(0, false).await, "then only when heard");
        tokio::time::sleep(Duration::from_millis(5)).await;
        announce(3).await;
        tokio::time::timeout(Duration::from_secs(5), async {
            while heard_at(&heard) == before {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("heard again after draining");
        stop.cancel();
        tracker.close();
        tracker.wait().await;
    }
}
