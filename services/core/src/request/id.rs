//! The job id: 64 lowercase hex characters, made only by hashing a normalised request
//! ([`super::NormalizedRequest::job_id`]) or by [`JobId::parse`], so an id is always safe
//! in a subject, a KV key or a path.

use schemars::JsonSchema;
use serde::de::{Deserializer, Error as _, Unexpected};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// A job id: 64 lowercase hex characters.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, JsonSchema)]
#[serde(transparent)]
pub struct JobId(#[schemars(regex(pattern = r"^[0-9a-f]{64}$"))] String);

impl JobId {
    /// Accepts only the exact form (64 lowercase hex digits), so an id is always safe in
    /// a subject, a key or a path.
    pub fn parse(s: &str) -> Option<JobId> {
        (s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))).then(|| JobId(s.to_string()))
    }

    /// The id of these canonical bytes: their lowercase hex SHA-256.
    pub(super) fn of_canonical(bytes: &[u8]) -> JobId {
        JobId(hex::encode(Sha256::digest(bytes)))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for JobId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A string on the wire, checked like [`JobId::parse`]: an event or a view can not carry
/// an id that would be unsafe in a subject or a path.
impl<'de> Deserialize<'de> for JobId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        JobId::parse(&s).ok_or_else(|| D::Error::invalid_value(Unexpected::Str(&s), &"64 lowercase hex digits"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "542ebe90ff7f7b97334d77cb5a4d19f44862779d40f2a7724461aa270fbef4d0";

    #[test]
    fn parse_is_strict() {
        let id = JobId::parse(ID).unwrap();
        assert_eq!(id.as_str(), ID);
        assert!(JobId::parse(&ID.to_uppercase()).is_none());
        assert!(JobId::parse("../etc").is_none());
        assert!(JobId::parse(&ID[1..]).is_none());
        assert!(JobId::parse(&format!("{}g", &ID[1..])).is_none());
    }

    #[test]
    fn serde_is_a_plain_string_and_deserialising_validates() {
        let id = JobId::parse(ID).unwrap();
        assert_eq!(serde_json::to_value(&id).unwrap(), serde_json::json!(ID));
        assert_eq!(serde_json::from_value::<JobId>(serde_json::json!(ID)).unwrap(), id);
        for bad in [serde_json::json!("../etc"), serde_json::json!(ID.to_uppercase()), serde_json::json!(3)] {
            assert!(serde_json::from_value::<JobId>(bad.clone()).is_err(), "{bad}");
        }
    }
}
