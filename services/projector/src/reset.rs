//! Rebuilding the view: [`reset`] empties it for a replay of the log, and
//! [`wait_caught_up`] waits for the replay.

use std::time::Duration;

use async_nats::jetstream::{self, consumer::PullConsumer};
use stemq_nats::error::JetStreamError;
use stemq_nats::{self as names, Settings};

use crate::ProjectorError;

/// Drops the view and the projector's consumers and recreates them empty, so a running
/// (or next) projector replays the whole log. Returns the number of job events to replay.
pub async fn reset(js: &jetstream::Context, settings: &Settings) -> Result<u64, ProjectorError> {
    for (stream, consumer) in
        [(names::JOBS_STREAM, names::PROJECTOR_CONSUMER), (names::PROGRESS_STREAM, names::PROJECTOR_PROGRESS_CONSUMER)]
    {
        if let Ok(s) = js.get_stream_no_info(stream).await {
            let _ = s.delete_consumer(consumer).await;
        }
    }
    let _ = js.delete_key_value(names::JOBS_BUCKET).await;
    names::apply(js, settings).await?;
    let mut s = js.get_stream(names::JOBS_STREAM).await.map_err(JetStreamError::open("stream info"))?;
    let info = s.info().await.map_err(JetStreamError::read("stream info"))?;
    Ok(info.state.messages)
}

/// Waits until the projector has applied (acked) everything in the log.
pub async fn wait_caught_up(js: &jetstream::Context, timeout: Duration) -> Result<bool, ProjectorError> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let mut done = true;
        for (stream, consumer) in [
            (names::JOBS_STREAM, names::PROJECTOR_CONSUMER),
            (names::PROGRESS_STREAM, names::PROJECTOR_PROGRESS_CONSUMER),
        ] {
            let mut c: PullConsumer =
                js.get_consumer_from_stream(consumer, stream).await.map_err(JetStreamError::open("consumer"))?;
            let info = c.info().await.map_err(JetStreamError::read("consumer info"))?;
            if info.num_pending > 0 || info.num_ack_pending > 0 {
                done = false;
            }
        }
        if done {
            return Ok(true);
        }
        if tokio::time::Instant::now() > deadline {
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
