//! NATS users: who may publish and subscribe to what, and the credentials that prove it.
//!
//! This module owns the identities stemq's processes connect as and the server-side
//! half of least privilege:
//!
//! - the roles and their permissions are data, `nats/users.json` (embedded at build
//!   time), like the stream, consumer and bucket definitions: `operator` (everything),
//!   `ingress`, `worker`, `projector`, `relay`, `status-reader`, and the per-owner
//!   roles `publisher` (`publisher-<owner token>`, publishing only on
//!   `stemq.jobs.*.requested.<owner token>`, and reading its owner's views) and
//!   `reader` (`reader-<owner token>`, reading its owner's views only: the view keys
//!   carry the owner token, `crate::view_key`);
//! - every user has an inbox prefix of its own, `_INBOX_<user>`, and may subscribe only
//!   below it, so no user reads another's replies, PubAcks or pull deliveries;
//! - each user's [`Credentials`] (`crate::credentials`), one file per user; the server
//!   only ever sees public keys;
//! - [`UserStore`]: a folder of credential files (mode 0700) — one per user — and the
//!   `authorization` block of nats-server's configuration rendered from them
//!   ([`UserStore::authorization_conf`]). `stemq dev`, the test harness (through
//!   `stemq_devkit::nats_server::NatsServer`) and `stemq nats users add-publisher` keep one.

use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use stemq_core::request::owner_token;

use crate::credentials::{Credentials, CredentialsError};

/// `nats/users.json`.
pub const USERS_DEF: &str = include_str!("../../../nats/users.json");

/// Everything: provisioning (`stemq nats apply`), rebuilds, the client commands.
pub const OPERATOR: &str = "operator";
/// The HTTP API and the NATS submit endpoint.
pub const INGRESS: &str = "ingress";
/// The workers (and their dead-letter handler).
pub const WORKER: &str = "worker";
/// The projector.
pub const PROJECTOR: &str = "projector";
/// The webhook relay.
pub const RELAY: &str = "relay";
/// A foreign service submitting for one owner (the role; users are
/// `publisher-<owner token>`).
pub const PUBLISHER: &str = "publisher";
/// A foreign service reading one owner's views (the role; users are
/// `reader-<owner token>`).
pub const READER: &str = "reader";
/// The roles with one user per owner.
pub const PER_OWNER_ROLES: [&str; 2] = [PUBLISHER, READER];
/// Reads and watches the status view bucket (every owner's).
pub const STATUS_READER: &str = "status-reader";
/// The users every stemq server has (publishers are added per owner).
pub const FIXED_USERS: [&str; 6] = [OPERATOR, INGRESS, WORKER, PROJECTOR, RELAY, STATUS_READER];

/// The file extension of credential files (`<user>.nk`).
pub const CREDENTIALS_EXT: &str = "nk";

/// Failures with users and credentials.
#[derive(Debug, thiserror::Error)]
pub enum UsersError {
    /// `nats/users.json` is malformed (a build-time bug).
    #[error("bad nats/users.json")]
    Definition(#[source] serde_json::Error),
    /// No such role in `nats/users.json`.
    #[error(
        "no NATS role `{0}` (known: operator, ingress, worker, projector, relay, publisher, reader, status-reader)"
    )]
    UnknownRole(String),
    /// A credentials file could not be read or parsed.
    #[error(transparent)]
    Credentials(#[from] CredentialsError),
    /// The credentials folder could not be read or written.
    #[error("credentials folder {0}")]
    Io(PathBuf, #[source] io::Error),
}

/// One role of `nats/users.json`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoleDef {
    /// The role (and user) name.
    pub user: String,
    /// What the role is for (the docs' table).
    pub description: String,
    /// No permissions block: everything.
    #[serde(default)]
    pub all: bool,
    /// One user per owner (`publisher`).
    #[serde(default)]
    pub per_owner: bool,
    /// Publish allow list (`{inbox}`, `{owner}` filled in per user; an entry with
    /// `{pool}` stands for one entry per pool consumer).
    #[serde(default)]
    pub publish: Vec<String>,
    /// Subscribe allow list (an entry may name a queue group: `"subject group"`).
    #[serde(default)]
    pub subscribe: Vec<String>,
    /// May answer requests it received (one reply each, within 2 minutes).
    #[serde(default)]
    pub allow_responses: bool,
}

#[derive(Deserialize)]
struct UsersFile {
    #[allow(dead_code)]
    description: String,
    users: Vec<RoleDef>,
}

/// Every role of `nats/users.json`.
pub fn roles() -> Result<Vec<RoleDef>, UsersError> {
    let f: UsersFile = serde_json::from_str(USERS_DEF).map_err(UsersError::Definition)?;
    Ok(f.users)
}

/// One role by name.
pub fn role(name: &str) -> Result<RoleDef, UsersError> {
    roles()?.into_iter().find(|r| r.user == name).ok_or_else(|| UsersError::UnknownRole(name.to_string()))
}

/// A user: a role, and for a publisher the owner it may publish for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    /// The user name: the role, or `publisher-<owner token>`.
    pub name: String,
    /// The role in `nats/users.json`.
    pub role: String,
    /// A publisher's owner token.
    pub owner_token: Option<String>,
}

/// What a user may do, as nats-server's `permissions` block spells it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Permissions {
    /// `publish: {allow: [...]}`.
    pub publish: AllowList,
    /// `subscribe: {allow: [...]}`.
    pub subscribe: AllowList,
    /// `allow_responses: true`.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub allow_responses: bool,
}

/// An allow list (everything else is denied).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AllowList {
    /// The subjects (wildcards allowed).
    pub allow: Vec<String>,
}

impl User {
    /// The user of a fixed role (`worker`, ...).
    pub fn of_role(role: &str) -> User {
        User { name: role.to_string(), role: role.to_string(), owner_token: None }
    }

    /// The user of a per-owner `role` ([`PER_OWNER_ROLES`]) for `owner`:
    /// `<role>-<owner token>`.
    pub fn of_owner(role: &str, owner: &str) -> User {
        let token = owner_token(owner);
        User { name: format!("{role}-{token}"), role: role.to_string(), owner_token: Some(token) }
    }

    /// The publisher of `owner`.
    pub fn publisher(owner: &str) -> User {
        User::of_owner(PUBLISHER, owner)
    }

    /// The reader of `owner`.
    pub fn reader(owner: &str) -> User {
        User::of_owner(READER, owner)
    }

    /// The user a user name stands for: `<per-owner role>-<token>` is that role's user
    /// for that owner, any other name its own role.
    pub fn from_name(name: &str) -> User {
        for role in PER_OWNER_ROLES {
            if let Some(token) = name.strip_prefix(role).and_then(|r| r.strip_prefix('-')).filter(|t| !t.is_empty()) {
                return User { name: name.to_string(), role: role.to_string(), owner_token: Some(token.to_string()) };
            }
        }
        User::of_role(name)
    }

    /// `_INBOX_<user>`: the only inbox this user may subscribe to.
    pub fn inbox_prefix(&self) -> String {
        format!("_INBOX_{}", self.name)
    }

    /// The user's permissions (`None`: everything).
    pub fn permissions(&self) -> Result<Option<Permissions>, UsersError> {
        let def = role(&self.role)?;
        if def.all {
            return Ok(None);
        }
        let inbox = self.inbox_prefix();
        let owner = self.owner_token.clone().unwrap_or_default();
        // `{pool}` stands for every pool consumer's name: one entry each (a consumer
        // name is one subject token, so no wildcard could name only the pools).
        let pools = crate::pool_consumers();
        let fill = |list: &[String]| -> Vec<String> {
            list.iter()
                .map(|s| s.replace("{inbox}", &inbox).replace("{owner}", &owner))
                .flat_map(|s| match s.contains("{pool}") {
                    true => pools.iter().map(|p| s.replace("{pool}", p)).collect::<Vec<_>>(),
                    false => vec![s],
                })
                .collect()
        };
        Ok(Some(Permissions {
            publish: AllowList { allow: fill(&def.publish) },
            subscribe: AllowList { allow: fill(&def.subscribe) },
            allow_responses: def.allow_responses,
        }))
    }
}

/// A folder of credential files, one per user (`<user>.nk`), and the server
/// configuration rendered from them.
#[derive(Debug, Clone)]
pub struct UserStore {
    dir: PathBuf,
}

impl UserStore {
    /// Opens (creating, mode 0700) the folder.
    pub fn open(dir: &Path) -> Result<UserStore, UsersError> {
        use std::os::unix::fs::PermissionsExt;
        let io = |e| UsersError::Io(dir.to_path_buf(), e);
        std::fs::create_dir_all(dir).map_err(io)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(io)?;
        Ok(UserStore { dir: dir.to_path_buf() })
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where the credentials of user `name` are (or would be).
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.{CREDENTIALS_EXT}"))
    }

    /// Creates credentials for `user` unless it has some; returns their path.
    pub fn ensure(&self, user: &User) -> Result<PathBuf, UsersError> {
        role(&user.role)?;
        let path = self.path(&user.name);
        if !path.exists() {
            Credentials::generate(&user.name, &user.inbox_prefix())
                .write(&path)
                .map_err(|e| UsersError::Io(path.clone(), e))?;
        }
        Ok(path)
    }

    /// Creates credentials for every fixed user that has none.
    pub fn ensure_fixed(&self) -> Result<(), UsersError> {
        for name in FIXED_USERS {
            self.ensure(&User::of_role(name))?;
        }
        Ok(())
    }

    /// Creates the publisher of `owner` (unless it exists); returns its credentials'
    /// path. The server learns of it when its configuration is rendered again and
    /// reloaded.
    pub fn add_publisher(&self, owner: &str) -> Result<PathBuf, UsersError> {
        self.ensure(&User::publisher(owner))
    }

    /// Every user with credentials here, by name.
    pub fn users(&self) -> Result<Vec<(User, Credentials)>, UsersError> {
        let io = |e| UsersError::Io(self.dir.clone(), e);
        let mut out = Vec::new();
        for entry in std::fs::read_dir(&self.dir).map_err(io)? {
            let path = entry.map_err(io)?.path();
            if path.extension().and_then(|e| e.to_str()) != Some(CREDENTIALS_EXT) {
                continue;
            }
            let Some(stem) = path.file_stem().and_then(|s| s.to_str()) else { continue };
            let creds = Credentials::load(&path)?;
            out.push((User::from_name(stem), creds));
        }
        out.sort_by(|a, b| a.0.name.cmp(&b.0.name));
        Ok(out)
    }

    /// nats-server's `authorization` block for every user here: public keys and
    /// permissions, no secret.
    pub fn authorization_conf(&self) -> Result<String, UsersError> {
        let mut out = String::from(
            "# Generated by stemq from nats/users.json and the credentials folder; rewritten on start.\n\
             # Only public keys: each client holds its own seed.\nauthorization {\n  users = [\n",
        );
        for (user, creds) in self.users()? {
            out.push_str(&format!("    # {}\n    {}\n", user.name, user_entry(&user, &creds.public_key())?));
        }
        out.push_str("  ]\n}\n");
        Ok(out)
    }
}

/// One user's entry of the `users` list: `{"nkey": "U…", "permissions": {…}}` (JSON,
/// which nats-server's configuration format reads as it is).
pub fn user_entry(user: &User, public_key: &str) -> Result<String, UsersError> {
    let mut entry = serde_json::json!({ "nkey": public_key });
    if let Some(p) = user.permissions()? {
        entry["permissions"] = serde_json::to_value(p).expect("permissions serialise");
    }
    Ok(entry.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_role_parses_and_only_the_operator_has_everything() {
        let roles = roles().unwrap();
        let names: Vec<_> = roles.iter().map(|r| r.user.as_str()).collect();
        for n in FIXED_USERS.iter().chain(&PER_OWNER_ROLES) {
            assert!(names.contains(n), "{n} missing from nats/users.json");
        }
        for r in &roles {
            assert_eq!(r.all, r.user == OPERATOR, "{}", r.user);
            if !r.all {
                assert!(r.subscribe.iter().any(|s| s == "{inbox}.>"), "{} cannot read its own inbox", r.user);
                // Nobody but the operator changes definitions.
                for p in &r.publish {
                    for forbidden in ["STREAM.CREATE", "STREAM.UPDATE", "STREAM.DELETE", "STREAM.PURGE", "$JS.API.>"] {
                        assert!(!p.contains(forbidden), "{} may publish {p}", r.user);
                    }
                    // The one exception: the ingress reads an owner's ledger entries of a
                    // period through an ephemeral ordered consumer (the exact subject
                    // names no durable; the ledger stream has no durable to delete).
                    let ephemeral_ledger_reader = r.user == INGRESS
                        && ["$JS.API.CONSUMER.CREATE.STEMQ_LEDGER", "$JS.API.CONSUMER.DELETE.STEMQ_LEDGER.*"]
                            .contains(&p.as_str());
                    let on_job_stream = (p.starts_with("$JS.API.CONSUMER.CREATE.STEMQ")
                        || p.starts_with("$JS.API.CONSUMER.DELETE.STEMQ"))
                        && !ephemeral_ledger_reader
                        || p.starts_with("$JS.API.CONSUMER.DURABLE");
                    assert!(!on_job_stream, "{} may create or delete consumers of the job streams: {p}", r.user);
                }
            }
        }
    }

    #[test]
    fn a_publisher_publishes_only_for_its_owner_and_reads_only_its_inbox_and_views() {
        let p = User::publisher("acme").permissions().unwrap().unwrap();
        let view = "$JS.API.DIRECT.GET.KV_stemq_jobs.$KV.stemq_jobs.acme.>";
        assert_eq!(
            p.publish.allow,
            ["stemq.jobs.*.requested.acme", "stemq.jobs.*.requested.acme.*.*", "stemq.api.submit", view]
        );
        assert_eq!(p.subscribe.allow, ["_INBOX_publisher-acme.>", "$KV.stemq_jobs.acme.>"]);
        assert!(!p.allow_responses);
        let odd = User::publisher("a.b");
        assert_eq!(odd.name, format!("publisher-{}", owner_token("a.b")));
        assert_eq!(User::from_name(&odd.name), odd);
        assert_eq!(User::from_name("worker"), User::of_role("worker"));
        // The reader: its owner's views, nothing else.
        let r = User::reader("acme");
        assert_eq!((r.name.as_str(), User::from_name("reader-acme")), ("reader-acme", r.clone()));
        let p = r.permissions().unwrap().unwrap();
        assert_eq!(p.publish.allow, [view]);
        assert_eq!(p.subscribe.allow, ["_INBOX_reader-acme.>", "$KV.stemq_jobs.acme.>"]);
        assert_eq!(User::from_name("reader-"), User::of_role("reader-"));
        assert!(User::of_role(OPERATOR).permissions().unwrap().is_none());
    }

    #[test]
    fn only_the_worker_records_attempts_and_only_the_projector_writes_the_view() {
        let may = |user: &str, subject: &str| {
            User::of_role(user).permissions().unwrap().map(|p| p.publish.allow.iter().any(|s| s == subject))
        };
        for user in [INGRESS, PROJECTOR, RELAY, STATUS_READER] {
            assert_eq!(may(user, "stemq.jobs.*.started"), Some(false), "{user}");
            assert_eq!(may(user, "stemq.progress.*"), Some(false), "{user}");
            assert_eq!(may(user, "$KV.stemq_jobs.>"), Some(user == PROJECTOR), "{user}");
            assert_eq!(may(user, "stemq.jobs.*.delivery"), Some(user == RELAY), "{user}");
            assert_eq!(may(user, "$KV.stemq_delivery_claims.>"), Some(user == RELAY), "{user}");
        }
        assert_eq!(may(WORKER, "stemq.jobs.*.outcome"), Some(true));
        // Only workers announce themselves in the registry.
        for user in [INGRESS, PROJECTOR, RELAY, STATUS_READER] {
            assert_eq!(may(user, "$KV.stemq_workers.>"), Some(false), "{user}");
        }
        assert_eq!(may(WORKER, "$KV.stemq_workers.>"), Some(true));
    }

    #[test]
    fn only_the_operator_and_the_ingress_create_consumers() {
        // A push consumer delivers to whatever subject its creator names, stream
        // subjects included: creating one is publishing anywhere.
        for user in [WORKER, PROJECTOR, RELAY, STATUS_READER, "publisher-acme"] {
            let p = User::from_name(user).permissions().unwrap().unwrap();
            for s in &p.publish.allow {
                assert!(!s.starts_with("$JS.API.CONSUMER.CREATE"), "{user} may create consumers: {s}");
                assert!(!s.starts_with("$JS.API.CONSUMER.DURABLE"), "{user} may create consumers: {s}");
                assert!(!s.starts_with("$JS.API.>") && s != ">", "{user} may use the whole API: {s}");
            }
        }
    }

    #[test]
    fn a_worker_pulls_from_every_pool_and_from_no_other_consumer() {
        let p = User::of_role(WORKER).permissions().unwrap().unwrap();
        let next: Vec<&str> =
            p.publish.allow.iter().filter_map(|s| s.strip_prefix("$JS.API.CONSUMER.MSG.NEXT.STEMQ_JOBS.")).collect();
        assert_eq!(next, crate::pool_consumers());
        assert!(!p.publish.allow.iter().any(|s| s.contains("{pool}")));
    }

    #[test]
    fn credentials_round_trip_without_showing_the_seed() {
        let dir = tempfile::tempdir().unwrap();
        let store = UserStore::open(&dir.path().join("creds")).unwrap();
        store.ensure_fixed().unwrap();
        let path = store.add_publisher("acme").unwrap();
        let c = Credentials::load(&path).unwrap();
        assert_eq!(c.user.as_deref(), Some("publisher-acme"));
        assert_eq!(c.inbox_prefix.as_deref(), Some("_INBOX_publisher-acme"));
        assert!(c.public_key().starts_with('U'));
        assert!(!format!("{c:?}").contains(c.seed()));
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        // The same file again keeps its key.
        assert_eq!(Credentials::load(&store.add_publisher("acme").unwrap()).unwrap().public_key(), c.public_key());
        let conf = store.authorization_conf().unwrap();
        assert_eq!(conf.matches("\"nkey\"").count(), 7, "{conf}");
        assert!(conf.contains(&c.public_key()) && !conf.contains(c.seed()), "{conf}");
        // A bare seed reads too.
        let bare = Credentials::parse(c.seed(), Path::new("x")).unwrap();
        assert_eq!((bare.user.clone(), bare.public_key()), (None, c.public_key()));
        assert!(matches!(Credentials::parse("# nothing", Path::new("x")), Err(CredentialsError::NoSeed(_))));
    }
}
