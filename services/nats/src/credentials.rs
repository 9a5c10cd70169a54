//! NATS credentials: a user's nkey seed and the file that holds it.
//!
//! This module owns the client side of a NATS identity: [`Credentials`] is a user's
//! nkey seed, written to a file of its own (mode 0600) that names the user and its inbox
//! prefix in comment lines; the seed line is a plain NATS user seed, so
//! `nats --nkey FILE` reads the same file. Connecting reads it
//! ([`crate::ConnectAuth::credentials_file`]); which users exist and what each may do is
//! [`crate::users`]'s.

use std::fmt;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// A credentials file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CredentialsError {
    /// The file could not be read.
    #[error("cannot read NATS credentials {0}")]
    Read(PathBuf, #[source] io::Error),
    /// No `SU…` seed line in it.
    #[error("{0} holds no NATS user nkey seed (a line starting with `SU`)")]
    NoSeed(PathBuf),
    /// The seed does not decode.
    #[error("{path}: the nkey seed is not valid: {message}")]
    BadSeed {
        /// The file.
        path: PathBuf,
        /// The nkeys error (never the seed).
        message: String,
    },
}

/// A user's credentials: its nkey seed, and who it is. [`fmt::Debug`] never prints the
/// seed.
#[derive(Clone)]
pub struct Credentials {
    /// The user name, when the file names it.
    pub user: Option<String>,
    /// The inbox prefix to connect with (`ConnectOptions::custom_inbox_prefix`), when
    /// the file names it; a user whose inbox is not the default must set it, or every
    /// request times out.
    pub inbox_prefix: Option<String>,
    seed: String,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("user", &self.user)
            .field("inbox_prefix", &self.inbox_prefix)
            .field("seed", &"<secret>")
            .finish()
    }
}

impl Credentials {
    /// New credentials (a fresh key pair) for the user `name`, whose inbox prefix is
    /// `inbox_prefix`.
    pub fn generate(name: &str, inbox_prefix: &str) -> Credentials {
        let kp = nkeys::KeyPair::new_user();
        Credentials {
            user: Some(name.to_string()),
            inbox_prefix: Some(inbox_prefix.to_string()),
            seed: kp.seed().expect("a generated key pair has a seed"),
        }
    }

    /// The seed (`SU…`): the secret.
    pub fn seed(&self) -> &str {
        &self.seed
    }

    /// The public key (`U…`) the server configuration names.
    pub fn public_key(&self) -> String {
        nkeys::KeyPair::from_seed(&self.seed).map(|k| k.public_key()).unwrap_or_default()
    }

    /// Reads a credentials file: [`Credentials::file_text`]'s form, or a file holding
    /// only a seed (then the user and inbox prefix are unknown).
    pub fn load(path: &Path) -> Result<Credentials, CredentialsError> {
        let text = std::fs::read_to_string(path).map_err(|e| CredentialsError::Read(path.to_path_buf(), e))?;
        Credentials::parse(&text, path)
    }

    /// Parses a credentials file's text (`path` only names it in errors).
    pub fn parse(text: &str, path: &Path) -> Result<Credentials, CredentialsError> {
        let (mut user, mut inbox_prefix, mut seed) = (None, None, None);
        for line in text.lines().map(str::trim) {
            if let Some(meta) = line.strip_prefix('#') {
                if let Some((k, v)) = meta.split_once(':') {
                    match k.trim() {
                        "user" => user = Some(v.trim().to_string()),
                        "inbox_prefix" => inbox_prefix = Some(v.trim().to_string()),
                        _ => {}
                    }
                }
            } else if line.starts_with("SU") && seed.is_none() {
                seed = Some(line.to_string());
            }
        }
        let seed = seed.ok_or_else(|| CredentialsError::NoSeed(path.to_path_buf()))?;
        nkeys::KeyPair::from_seed(&seed)
            .map_err(|e| CredentialsError::BadSeed { path: path.to_path_buf(), message: e.to_string() })?;
        Ok(Credentials { user, inbox_prefix, seed })
    }

    /// The file's text: comment lines naming the user and its inbox prefix, then the
    /// seed on a line of its own.
    pub fn file_text(&self) -> String {
        let user = self.user.as_deref().unwrap_or("?");
        let inbox = self.inbox_prefix.as_deref().unwrap_or("_INBOX");
        format!(
            "# stemq NATS credentials. Secret: keep this file mode 0600 and out of version control.\n\
             # The last line is a NATS user nkey seed (`nats --nkey FILE` reads this file as it is);\n\
             # connect with the inbox prefix below, the only inbox this user may subscribe to.\n\
             # user: {user}\n\
             # inbox_prefix: {inbox}\n\
             {}\n",
            self.seed
        )
    }

    /// Writes the file, readable by its owner only (0600), replacing any old one.
    pub fn write(&self, path: &Path) -> io::Result<()> {
        use std::os::unix::fs::OpenOptionsExt;
        let tmp = path.with_extension("tmp");
        let _ = std::fs::remove_file(&tmp);
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp)?;
        f.write_all(self.file_text().as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    }
}
