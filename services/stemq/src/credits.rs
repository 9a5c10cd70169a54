//! `stemq credits` and `stemq usage`: credits from the command line, for operators. They
//! talk to NATS directly as the `operator` user (the ledger, `stemq_accounts::ledger`, and
//! the price list in the `stemq_config` bucket), so no ingress is needed.

use anyhow::{bail, Context, Result};
use chrono::{DateTime, Utc};
use clap::Subcommand;
use stemq_accounts::ledger::{self, credits, Ledger, Movement, Prices};

use crate::global::Global;

/// `stemq credits …`.
#[derive(Debug, Subcommand)]
pub enum CreditsCommand {
    /// Add credits to an owner's balance (a negative amount takes them away).
    Grant {
        /// The owner.
        owner: String,
        /// Credits, e.g. `100` or `2.5`.
        #[arg(allow_hyphen_values = true)]
        amount: f64,
        /// Why (kept in the ledger).
        #[arg(long)]
        note: Option<String>,
    },
    /// An owner's balance, reservations and lifetime usage.
    Show {
        /// The owner.
        owner: String,
    },
    /// An owner's movements, oldest first.
    Log {
        /// The owner.
        owner: String,
        /// Only movements since this RFC 3339 time.
        #[arg(long)]
        since: Option<DateTime<Utc>>,
    },
    /// The price list: `set FILE` turns credits on (see `nats/prices.json`), `show`,
    /// `off` turns them off.
    Prices {
        #[command(subcommand)]
        command: PricesCommand,
    },
}

/// `stemq credits prices …`.
#[derive(Debug, Subcommand)]
pub enum PricesCommand {
    /// Sets the price list from a JSON file (`nats/prices.json` is the example).
    Set {
        /// The file.
        file: std::path::PathBuf,
    },
    /// Prints the price list.
    Show,
    /// Removes the price list: nothing is reserved or charged any more (open
    /// reservations are still closed).
    Off,
}

async fn config(g: &Global) -> Result<(async_nats::jetstream::Context, async_nats::jetstream::kv::Store)> {
    let client = crate::services::connect_cli(g).await?;
    let js = async_nats::jetstream::new(client);
    let kv = js
        .get_key_value(ledger::CONFIG_BUCKET)
        .await
        .context("the configuration bucket is missing: run `stemq nats apply` (or `stemq dev`)")?;
    Ok((js, kv))
}

/// Runs a `stemq credits` command.
pub async fn run(g: &Global, command: CreditsCommand) -> Result<()> {
    let (js, kv) = config(g).await?;
    let ledger = Ledger::new(js);
    match command {
        CreditsCommand::Grant { owner, amount, note } => {
            let Some(m) = ledger::micro(amount) else { bail!("`{amount}` is not an amount of credits") };
            if m == 0 {
                bail!("granting 0 credits changes nothing");
            }
            let by = std::env::var("USER").unwrap_or_else(|_| "operator".into());
            let (_, after) = ledger.grant(&owner, m, &by, note, &uuid::Uuid::new_v4().to_string()).await?;
            println!(
                "{owner}: {:+.6} credits; balance {:.6}, available {:.6}",
                credits(m),
                credits(after.balance),
                credits(after.available())
            );
        }
        CreditsCommand::Show { owner } => {
            let (a, _) = ledger.account(&owner).await?;
            println!("owner      {owner}");
            println!("balance    {:.6}", credits(a.balance));
            println!("reserved   {:.6} ({} job(s) running or queued)", credits(a.reserved), a.open.len());
            println!("available  {:.6}", credits(a.available()));
            println!(
                "granted    {:.6}   charged {:.6}   refunded {:.6}",
                credits(a.granted),
                credits(a.charged),
                credits(a.refunded)
            );
            for (model, u) in &a.usage {
                println!(
                    "  {model:<12} {:>6} jobs  {:>10.1} s audio  {:>10.1} s engine  {:>12.6} credits",
                    u.jobs,
                    u.audio_ms as f64 / 1000.0,
                    u.engine_ms as f64 / 1000.0,
                    credits(u.charged)
                );
            }
        }
        CreditsCommand::Log { owner, since } => {
            // The balance after each movement: the fold of the entries up to it.
            let all = ledger.entries(&owner, None).await?;
            let mut account = ledger::Account::default();
            for e in all {
                account.apply(&e.movement).map_err(|m| anyhow::anyhow!("entry at {}: {m}", e.time))?;
                if since.is_some_and(|t| e.time < t) {
                    continue;
                }
                let what = match &e.movement {
                    Movement::Granted { amount, by, note } => {
                        format!(
                            "granted  {:+.6} by {by}{}",
                            credits(*amount),
                            note.as_deref().map(|n| format!(" ({n})")).unwrap_or_default()
                        )
                    }
                    Movement::Reserved { job_id, model, audio_ms, amount, .. } => {
                        format!(
                            "reserved {:.6} for {job_id} ({model}, {:.1} s)",
                            credits(*amount),
                            *audio_ms as f64 / 1000.0
                        )
                    }
                    Movement::Settled { job_id, charged, reserved, audio_ms, .. } => format!(
                        "charged  {:.6} of {:.6} for {job_id} ({:.1} s)",
                        credits(*charged),
                        credits(*reserved),
                        *audio_ms as f64 / 1000.0
                    ),
                    Movement::Refunded { job_id, amount, reason, .. } => {
                        format!("refunded {:.6} for {job_id} ({reason})", credits(*amount))
                    }
                    Movement::Released { job_id, amount, reason, .. } => {
                        format!("released {:.6} for {job_id} ({reason})", credits(*amount))
                    }
                };
                println!("{}  {what}  → balance {:.6}", e.time.to_rfc3339(), credits(account.balance));
            }
        }
        CreditsCommand::Prices { command } => match command {
            PricesCommand::Set { file } => {
                let text = std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
                let p = Prices::parse(&text).with_context(|| format!("{}", file.display()))?;
                kv.put(ledger::PRICES_KEY, serde_json::to_vec(&p)?.into()).await?;
                println!(
                    "credits are on ({}): {}",
                    if p.enforce { "enforced" } else { "recorded only" },
                    serde_json::to_string(&p.per_audio_minute)?
                );
            }
            PricesCommand::Show => match ledger::prices(&kv).await? {
                Some(p) => println!("{}", serde_json::to_string_pretty(&p)?),
                None => println!("credits are off (no price list; `stemq credits prices set nats/prices.json`)"),
            },
            PricesCommand::Off => {
                kv.put(ledger::PRICES_KEY, Vec::new().into()).await?;
                println!("credits are off");
            }
        },
    }
    Ok(())
}

/// `stemq usage [--owner O] [--since T]`: usage per owner and model from the ledger.
pub async fn usage(g: &Global, owners: Vec<String>, since: Option<DateTime<Utc>>) -> Result<()> {
    let (js, _) = config(g).await?;
    let ledger = Ledger::new(js.clone());
    let owners = if owners.is_empty() { ledger_owners(&js).await? } else { owners };
    println!("{:<20} {:<12} {:>7} {:>12} {:>12} {:>14}", "OWNER", "MODEL", "JOBS", "AUDIO S", "ENGINE S", "CREDITS");
    for owner in owners {
        let mut per: std::collections::BTreeMap<String, (u64, u64, u64, i64)> = Default::default();
        for e in ledger.entries(&owner, since).await? {
            if let Movement::Settled { model, charged, audio_ms, engine_ms, .. } = e.movement {
                let x = per.entry(model.as_str().into()).or_default();
                x.0 += 1;
                x.1 += audio_ms;
                x.2 += engine_ms;
                x.3 += charged;
            }
        }
        for (model, (jobs, audio, engine, charged)) in per {
            println!(
                "{owner:<20} {model:<12} {jobs:>7} {:>12.1} {:>12.1} {:>14.6}",
                audio as f64 / 1000.0,
                engine as f64 / 1000.0,
                credits(charged)
            );
        }
    }
    Ok(())
}

/// The owners with a ledger (the subjects of the ledger stream).
async fn ledger_owners(js: &async_nats::jetstream::Context) -> Result<Vec<String>> {
    let stream =
        js.get_stream(ledger::LEDGER_STREAM).await.context("the ledger stream is missing: run `stemq nats apply`")?;
    let info = stream.info_with_subjects("stemq.ledger.>").await?;
    let mut owners = std::collections::BTreeSet::new();
    use futures::StreamExt;
    let mut subjects = info;
    let stream = js.get_stream_no_info(ledger::LEDGER_STREAM).await?;
    while let Some(s) = subjects.next().await {
        let (subject, _) = s?;
        // The subject carries the owner's token; the entries carry the owner itself,
        // and one whose owner is not its subject's is nobody's.
        let entry = stream.direct_get_last_for_subject(&subject).await?;
        if let Ok(e) = serde_json::from_slice::<ledger::Entry>(&entry.payload) {
            if e.check(&e.owner, &subject).is_ok() {
                owners.insert(e.owner);
            }
        }
    }
    Ok(owners.into_iter().collect())
}
