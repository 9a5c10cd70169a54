//! `stemq webhooks`: the owner's webhook settings from the command line. It talks to
//! NATS directly, through the same functions the ingress routes use
//! (`stemq_webhook`), so no ingress is needed.

use anyhow::{Context, Result};
use clap::Subcommand;
use stemq_nats as names;

use crate::global::Global;

/// `stemq webhooks …`.
#[derive(Debug, Subcommand)]
pub enum WebhooksCommand {
    /// Deliver to URL again after a receiver disabled it with `410 Gone`.
    Enable {
        /// The receiver URL, exactly as in the job requests.
        url: String,
        /// Whose webhooks (the owner of the API keys that submitted the jobs).
        #[arg(long, default_value = stemq_ingress::access::LOCAL_OWNER)]
        owner: String,
    },
}

/// Runs a `stemq webhooks` command.
pub async fn run(g: &Global, command: WebhooksCommand) -> Result<()> {
    match command {
        WebhooksCommand::Enable { url, owner } => enable(g, &owner, &url).await,
    }
}

/// `stemq webhooks enable URL`: the CLI face of `POST /v1/webhooks/enable`.
async fn enable(g: &Global, owner: &str, url: &str) -> Result<()> {
    let client = crate::services::connect_cli(g).await?;
    let js = async_nats::jetstream::new(client);
    let bucket = js
        .get_key_value(names::WEBHOOKS_BUCKET)
        .await
        .context("the webhooks bucket is missing: run `stemq nats apply` or `stemq dev`")?;
    let (_, was_disabled) = stemq_webhook::enable(&bucket, owner, url).await?;
    if was_disabled {
        println!("{url} enabled again for {owner}");
    } else {
        println!("{url} was not disabled for {owner}; nothing changed");
    }
    Ok(())
}
