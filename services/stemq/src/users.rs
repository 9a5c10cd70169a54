//! `stemq nats users`: credentials for the NATS users of a stemq server, above all for
//! services outside the stack (a `publisher` and a `reader` per owner, a
//! `status-reader`).
//!
//! This module owns the command line of user management; the users, their permissions
//! and the credential files are [`stemq_nats::users`]'s. The credentials live in a
//! folder (default `<data-dir>/nats/creds`, the one `stemq dev` uses), one file per user
//! (mode 0600). When that folder belongs to a server `stemq dev` runs, the server's
//! `authorization` block is rewritten and the server reloaded, so the new user can
//! connect at once; for any other server, `stemq nats users conf` prints the block to
//! install.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Subcommand;
use stemq_nats::credentials::Credentials;
use stemq_nats::users::{self as nats_users, User, UserStore};

use crate::global::Global;

/// `stemq nats users ...`.
#[derive(Debug, Subcommand)]
pub enum UsersCommand {
    /// Create the `publisher` of OWNER (user `publisher-<owner token>`): it may publish
    /// `requested` events for that owner only (`stemq.jobs.*.requested.<owner token>`).
    AddPublisher {
        /// The owner its requests are for.
        #[arg(long)]
        owner: String,
        /// Credentials folder (default `<data-dir>/nats/creds`).
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    /// Create the `reader` of OWNER (user `reader-<owner token>`): it may read that
    /// owner's job views only (`$KV.stemq_jobs.<owner token>.>`), by direct get and by a
    /// plain subscription.
    AddReader {
        /// The owner whose jobs it reads.
        #[arg(long)]
        owner: String,
        /// Credentials folder (default `<data-dir>/nats/creds`).
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    /// Create the credentials of a fixed user (`status-reader`, `worker`, ...) unless
    /// they exist.
    Add {
        /// The user: operator, ingress, worker, projector, relay or status-reader.
        user: String,
        /// Credentials folder (default `<data-dir>/nats/creds`).
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    /// Print nats-server's `authorization` block for every user in the folder (public
    /// keys and permissions only), to include in a server's configuration.
    Conf {
        /// Credentials folder (default `<data-dir>/nats/creds`).
        #[arg(long)]
        dir: Option<PathBuf>,
    },
}

/// Runs a `stemq nats users` command.
pub fn run(g: &Global, command: UsersCommand) -> Result<()> {
    let folder = |dir: Option<PathBuf>| dir.unwrap_or_else(|| g.data_dir.join("nats/creds"));
    match command {
        UsersCommand::AddPublisher { owner, dir } => add(&folder(dir), &User::publisher(&owner)),
        UsersCommand::AddReader { owner, dir } => add(&folder(dir), &User::reader(&owner)),
        UsersCommand::Add { user, dir } => {
            nats_users::role(&user)?;
            if nats_users::PER_OWNER_ROLES.contains(&user.as_str()) {
                anyhow::bail!("a {user} is per owner: `stemq nats users add-{user} --owner OWNER`");
            }
            add(&folder(dir), &User::of_role(&user))
        }
        UsersCommand::Conf { dir } => {
            let store = UserStore::open(&folder(dir))?;
            print!("{}", store.authorization_conf()?);
            Ok(())
        }
    }
}

fn add(dir: &std::path::Path, user: &User) -> Result<()> {
    let store = UserStore::open(dir)?;
    let path = store.ensure(user)?;
    let creds = Credentials::load(&path)?;
    println!("user          {}", user.name);
    println!("credentials   {}   (secret: give it to that service only)", path.display());
    println!("inbox prefix  {}   (connect with it: the only inbox the user may read)", user.inbox_prefix());
    println!("public key    {}", creds.public_key());
    // A folder of a server `stemq dev` runs: that server learns of the user now.
    let server_store = dir.parent().filter(|p| p.join("nats-server.conf").is_file());
    if let Some(store_dir) = server_store {
        let reloaded = stemq_devkit::nats_server::refresh_users(store_dir)
            .with_context(|| format!("updating the users of the server in {}", store_dir.display()))?;
        if reloaded {
            println!("the running nats-server in {} reloaded its users", store_dir.display());
        } else {
            println!("{} updated; the server picks it up when it starts", store_dir.join("auth.conf").display());
        }
    } else {
        println!("server entry  {}", nats_users::user_entry(user, &creds.public_key())?);
        println!("(add it to the `authorization.users` of the server's configuration, or use `stemq nats users conf`)");
    }
    Ok(())
}
