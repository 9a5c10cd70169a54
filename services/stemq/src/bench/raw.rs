//! `stemq bench raw`: raw JetStream cycles with the pipeline's load shape, the ceiling
//! `bench pipeline` is compared with.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use async_nats::jetstream;
use futures::StreamExt;
use tokio::sync::{Mutex, Semaphore};

use stemq_devkit::nats_cluster::NatsCluster;

use super::figures::{Counter, Figures, Messages};
use super::{own_server, Load};

/// Raw JetStream cycles on a server of its own (`cluster`: three nodes, the stream at
/// R3, as `bench pipeline --cluster` runs): publish a request, pull it, publish an
/// outcome, ack.
pub(super) async fn raw_cycles(Load { jobs, rate, workers, in_flight }: Load, cluster: bool) -> Result<Figures> {
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("nats");
    let (server, cluster_nodes, client) = if cluster {
        let c = NatsCluster::start_async(dir, 3, Default::default()).await?;
        let client = c.connect_as(stemq_nats::users::OPERATOR, "stemq-bench-raw").await?;
        (None, Some(c), client)
    } else {
        let s = own_server(&dir).await?;
        let client = s.connect_as(stemq_nats::users::OPERATOR, "stemq-bench-raw").await?;
        (Some(s), None, client)
    };
    let js = jetstream::new(client.clone());
    let stream = js
        .create_stream(jetstream::stream::Config {
            name: "RAW_BENCH".into(),
            subjects: vec!["rawbench.req.*".into(), "rawbench.out.*".into()],
            storage: jetstream::stream::StorageType::File,
            num_replicas: if cluster { 3 } else { 1 },
            ..Default::default()
        })
        .await?;
    let consumer: jetstream::consumer::PullConsumer = stream
        .create_consumer(jetstream::consumer::pull::Config {
            durable_name: Some("raw".into()),
            filter_subject: "rawbench.req.*".into(),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            max_ack_pending: workers as i64,
            ..Default::default()
        })
        .await?;
    let counter = [Counter::start("cycle", &client)];
    // Completions: the outcomes, seen on a plain subscription.
    let done: Arc<Mutex<HashMap<u64, Instant>>> = Default::default();
    let mut outs = client.subscribe("rawbench.out.*").await?;
    let watcher = {
        let done = done.clone();
        tokio::spawn(async move {
            while let Some(m) = outs.next().await {
                if let Some(n) = m.subject.rsplit('.').next().and_then(|n| n.parse::<u64>().ok()) {
                    done.lock().await.entry(n).or_insert_with(Instant::now);
                }
            }
        })
    };
    // The consumer loops: pull, publish the outcome (acked), ack the request.
    let cycler = {
        let js = js.clone();
        let mut messages = consumer.messages().await?;
        let slots = Arc::new(Semaphore::new(workers));
        tokio::spawn(async move {
            while let Some(Ok(m)) = messages.next().await {
                let Ok(permit) = slots.clone().acquire_owned().await else { break };
                let js = js.clone();
                tokio::spawn(async move {
                    let n = m.subject.rsplit('.').next().unwrap_or("0").to_string();
                    if let Ok(ack) = js.publish(format!("rawbench.out.{n}"), "done".into()).await {
                        let _ = ack.await;
                    }
                    let _ = m.ack().await;
                    drop(permit);
                });
            }
        })
    };
    let submitted: Arc<Mutex<HashMap<u64, Instant>>> = Default::default();
    let sem = Arc::new(Semaphore::new(in_flight));
    let t0 = Instant::now();
    let interval = rate.map(|r| Duration::from_secs_f64(1.0 / r));
    let mut handles = Vec::with_capacity(jobs);
    for i in 0..jobs as u64 {
        if let Some(iv) = interval {
            tokio::time::sleep_until((t0 + iv.mul_f64(i as f64)).into()).await;
        }
        let permit = sem.clone().acquire_owned().await?;
        let (js, submitted) = (js.clone(), submitted.clone());
        handles.push(tokio::spawn(async move {
            let start = Instant::now();
            let body = format!(r#"{{"audio_uri":"bench/{i}.wav","model":"dsp"}}"#);
            let mut h = async_nats::HeaderMap::new();
            h.insert("Nats-Msg-Id", format!("raw-{i}").as_str());
            let ok = match js.publish_with_headers(format!("rawbench.req.{i}"), h, body.into()).await {
                Ok(ack) => ack.await.is_ok(),
                Err(_) => false,
            };
            drop(permit);
            if ok {
                submitted.lock().await.insert(i, start);
            }
        }));
    }
    for h in handles {
        h.await?;
    }
    let deadline = Instant::now() + Duration::from_secs(60 + jobs as u64 / 100);
    while done.lock().await.len() < submitted.lock().await.len() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut figures = Figures::of(
        "raw JetStream cycles (publish, pull, publish outcome, ack)",
        t0,
        &*submitted.lock().await,
        &*done.lock().await,
    );
    figures.messages = Some(Messages::of(&counter, figures.done));
    cycler.abort();
    watcher.abort();
    drop((server, cluster_nodes));
    Ok(figures)
}
