//! `stemq keys`: API keys from the command line, for operators. It talks to NATS
//! directly (the `stemq_keys` bucket, through `stemq_accounts::auth`), so no ingress is
//! needed; the ingress replicas see a new or revoked key within seconds.
//!
//! This module also owns `stemq dev`'s admin key: created for the owner `local` on first
//! start and written to `<data-dir>/admin.key` (mode 0600), which the client commands
//! read when neither `--api-key` nor `STEMQ_API_KEY` is given.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use async_nats::jetstream::kv;
use clap::Subcommand;
use stemq_accounts::auth::{self, Limits, Role};
use stemq_nats as names;

use crate::global::Global;
use crate::job_opts::PriorityArg;

/// `stemq keys …`.
#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// Create a key and print it (once: only its hash is kept).
    Create {
        /// Whose jobs the key submits and sees (a-z, 0-9, `_`, `-`).
        #[arg(long)]
        owner: String,
        /// What it may do.
        #[arg(long, value_enum, default_value = "submit")]
        role: RoleArg,
        /// Submits per second, sustained (0: no rate limit).
        #[arg(long, default_value_t = Limits::default().rate)]
        rate: f64,
        /// Submits allowed at once above the rate.
        #[arg(long, default_value_t = Limits::default().burst)]
        burst: u32,
        /// Jobs of this key queued or running at once (0: no cap; at most 10 000).
        #[arg(long, default_value_t = Limits::default().max_in_flight)]
        max_in_flight: u32,
        /// A note for people (who holds it, what for).
        #[arg(long, default_value = "")]
        name: String,
        /// The lane of this key's jobs when a request names none (`interactive` when
        /// not set): `batch` for a bulk client, so its jobs never hold up interactive
        /// ones of the same model.
        #[arg(long, value_enum)]
        priority: Option<PriorityArg>,
    },
    /// List keys (ids, owners, roles, limits; never the keys).
    List,
    /// Revoke a key by its id (or the whole key).
    Revoke {
        /// The key id (the part after `sk_`), or the key.
        id: String,
    },
}

/// `--role`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RoleArg {
    /// Read the owner's jobs.
    Read,
    /// Also submit, upload, cancel, retry.
    Submit,
    /// Also the owner's webhook secret.
    Admin,
    /// Every owner's jobs.
    Operator,
}

impl RoleArg {
    fn role(self) -> Role {
        match self {
            RoleArg::Read => Role::Read,
            RoleArg::Submit => Role::Submit,
            RoleArg::Admin => Role::Admin,
            RoleArg::Operator => Role::Operator,
        }
    }
}

/// Opens the keys bucket.
pub async fn bucket(client: async_nats::Client) -> Result<kv::Store> {
    async_nats::jetstream::new(client)
        .get_key_value(names::KEYS_BUCKET)
        .await
        .context("the keys bucket is missing: run `stemq nats apply` or `stemq dev`")
}

/// Runs a `stemq keys` command.
pub async fn run(g: &Global, command: KeysCommand) -> Result<()> {
    let client = crate::services::connect_cli(g).await?;
    let bucket = bucket(client).await?;
    match command {
        KeysCommand::Create { owner, role, rate, burst, max_in_flight, name, priority } => {
            let limits = Limits { rate, burst, max_in_flight };
            let priority = priority.map(PriorityArg::priority);
            let (key, record) = auth::create_with(&bucket, &owner, role.role(), limits, &name, priority).await?;
            eprintln!(
                "created key {} for owner {} (role {}, lane {}); it is shown only now:",
                record.id,
                record.owner,
                record.role,
                lane(&record)
            );
            println!("{}", key.expose());
        }
        KeysCommand::List => {
            println!(
                "{:<18} {:<20} {:<9} {:>8} {:>6} {:>9}  {:<21} {:<20} STATUS",
                "ID", "OWNER", "ROLE", "RATE/S", "BURST", "IN-FLIGHT", "LANE", "CREATED"
            );
            for r in auth::list(&bucket).await? {
                let status = match (r.revoked_at, r.expires_at) {
                    (Some(t), _) => format!("revoked {}", t.format("%Y-%m-%d %H:%M")),
                    (None, Some(t)) if r.expired(chrono::Utc::now()) => {
                        format!("expired {}", t.format("%Y-%m-%d %H:%M"))
                    }
                    (None, Some(t)) => format!("active, expires {}", t.format("%Y-%m-%d %H:%M")),
                    (None, None) => "active".into(),
                };
                println!(
                    "{:<18} {:<20} {:<9} {:>8} {:>6} {:>9}  {:<21} {:<20} {}{}",
                    r.id,
                    r.owner,
                    r.role.as_str(),
                    r.limits.rate,
                    r.limits.burst,
                    r.limits.max_in_flight,
                    lane(&r),
                    r.created_at.format("%Y-%m-%d %H:%M"),
                    status,
                    if r.name.is_empty() { String::new() } else { format!("  ({})", r.name) }
                );
            }
        }
        KeysCommand::Revoke { id } => {
            let r = auth::revoke(&bucket, &id).await?;
            println!("revoked key {} of owner {} (every ingress refuses it within seconds)", r.id, r.owner);
        }
    }
    Ok(())
}

/// The lane a key gives its jobs when a request names none, as `stemq keys` prints it.
fn lane(r: &auth::KeyRecord) -> String {
    match r.priority {
        Some(p) => p.as_str().to_string(),
        None => format!("{} (default)", stemq_core::request::Priority::default()),
    }
}

/// Where `stemq dev` keeps its admin key.
pub fn admin_key_path(data_dir: &Path) -> PathBuf {
    data_dir.join("admin.key")
}

/// The limits of `stemq dev`'s keys of `local` (its page's session keys too).
pub const LOCAL_LIMITS: Limits = Limits { rate: 1000.0, burst: 1000, max_in_flight: Limits::MAX_IN_FLIGHT };

/// Where `stemq dev` keeps its operator key.
pub fn operator_key_path(data_dir: &Path) -> PathBuf {
    data_dir.join("operator.key")
}

/// The key in `<data-dir>/admin.key` if it still authenticates; otherwise a new admin
/// key of the owner `local`, written there (mode 0600). Returns the path.
pub async fn ensure_admin_key(bucket: &kv::Store, data_dir: &Path) -> Result<PathBuf> {
    ensure_local_key(bucket, &admin_key_path(data_dir), Role::Admin).await
}

/// Like [`ensure_admin_key`], an operator key of the owner `local` in
/// `<data-dir>/operator.key`, for the person at the laptop (the page's sign-in link
/// mints a session key of its own instead of handing this one out).
pub async fn ensure_operator_key(bucket: &kv::Store, data_dir: &Path) -> Result<PathBuf> {
    ensure_local_key(bucket, &operator_key_path(data_dir), Role::Operator).await
}

/// The key in `path` if it still authenticates; otherwise a new `role` key of the owner
/// `local`, written there (mode 0600).
async fn ensure_local_key(bucket: &kv::Store, path: &Path, role: Role) -> Result<PathBuf> {
    if let Ok(existing) = std::fs::read_to_string(path) {
        let ring = auth::KeyRing::new(bucket.clone());
        if ring.authenticate(existing.trim()).await.is_ok_and(|c| c.role == role) {
            return Ok(path.to_path_buf());
        }
    }
    let (key, _) = auth::create(bucket, stemq_ingress::access::LOCAL_OWNER, role, LOCAL_LIMITS, "stemq dev").await?;
    write_secret(path, &format!("{}\n", key.expose()))?;
    Ok(path.to_path_buf())
}

/// Writes `text` to `path` readable by its owner only.
fn write_secret(path: &Path, text: &str) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let _ = std::fs::remove_file(path);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("writing {}", path.display()))?;
    f.write_all(text.as_bytes())?;
    Ok(())
}

/// The API key of a client command: `--api-key`/`STEMQ_API_KEY`, else `stemq dev`'s
/// `<data-dir>/admin.key` when it exists.
pub fn client_key(explicit: Option<&str>, data_dir: &Path) -> Option<String> {
    explicit
        .map(str::to_string)
        .or_else(|| std::fs::read_to_string(admin_key_path(data_dir)).ok().map(|s| s.trim().to_string()))
        .filter(|k| !k.is_empty())
}
