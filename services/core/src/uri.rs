//! Which input URIs stemq agrees to read.
//!
//! This module owns the input URI policy. A job's `audio_uri` must name an object
//! *inside* one of the configured stores (`file:///abs/dir`, `s3://bucket/prefix`):
//! nothing else is ever fetched. That rules out, with a reason a person can act on:
//!
//! - `http(s)://` URLs of any host (no server-side requests: cloud metadata at
//!   169.254.169.254, loopback and private addresses, or anywhere else). The one
//!   exception is opt-in: where the operator allows external audio URLs
//!   (`STEMQ_AUDIO_URL_ALLOW`), the ingress and the worker take [`is_web_url`] URIs past
//!   this module to the address policy of [`crate::netpolicy`] instead;
//! - other schemes (`ftp:`, `data:`, `gs:`...), and stores that are not configured;
//! - files outside the store root (`file:///etc/passwd`), other buckets or prefixes;
//! - path traversal: `.`/`..` segments, also percent-encoded (`%2e%2e`), encoded
//!   slashes or backslashes, NUL, and query strings or fragments.
//!
//! The ingress checks before it publishes; the worker checks again before it reads
//! (a raw publisher bypasses the ingress).

use std::net::IpAddr;

use crate::request::RequestError;

const FIELD: &str = "audio_uri";

/// The largest input stemq reads, uploaded or fetched from a URL: 1 GiB.
pub const MAX_INPUT_BYTES: u64 = 1 << 30;

/// True for `http://` and `https://` URIs (external audio URLs), whatever their host.
pub fn is_web_url(uri: &str) -> bool {
    let scheme = uri.split_once(':').map(|(s, _)| s.to_ascii_lowercase());
    matches!(scheme.as_deref(), Some("http" | "https"))
}

fn refuse(message: impl Into<String>) -> RequestError {
    RequestError { field: FIELD.to_string(), message: message.into() }
}

/// Accepts `uri` only when it names an object inside one of the `allowed` store base
/// URLs (as `storage::Store::base_url` gives them).
pub fn check_audio_uri(uri: &str, allowed: &[String]) -> Result<(), RequestError> {
    store_key(uri, allowed).map(|_| ())
}

/// Like [`check_audio_uri`], and returns which store (index into `allowed`) and the
/// object key inside it.
pub fn store_key<'a>(uri: &'a str, allowed: &[String]) -> Result<(usize, &'a str), RequestError> {
    let parsed = url::Url::parse(uri).map_err(|e| refuse(format!("not an absolute URI: {e}")))?;
    let scheme = parsed.scheme();
    if scheme == "http" || scheme == "https" {
        let host = match parsed.host() {
            Some(url::Host::Ipv4(ip)) => describe_ip(IpAddr::V4(ip)),
            Some(url::Host::Ipv6(ip)) => describe_ip(IpAddr::V6(ip)),
            Some(url::Host::Domain(d)) => format!("host `{d}`"),
            None => "no host".to_string(),
        };
        return Err(refuse(format!(
            "{scheme} URLs are never fetched ({host}) unless this service's operator allows their host; \
             upload the file with POST /v1/uploads and use the audio_uri it returns"
        )));
    }
    let schemes: Vec<&str> = allowed.iter().filter_map(|b| b.split_once("://").map(|(s, _)| s)).collect();
    if !schemes.contains(&scheme) {
        let mut expected = schemes.clone();
        expected.dedup();
        return Err(refuse(format!(
            "scheme `{scheme}` is not accepted; expected a URI in the configured store ({})",
            if expected.is_empty() { "none configured".to_string() } else { expected.join(", ") }
        )));
    }
    if uri.contains('?') || uri.contains('#') {
        return Err(refuse("must not have a query string or a fragment"));
    }
    if uri.contains('\\') || uri.bytes().any(|b| b.is_ascii_control()) {
        return Err(refuse("must not contain backslashes or control characters"));
    }
    let lower = uri.to_ascii_lowercase();
    for (enc, what) in [("%2e", "dot"), ("%2f", "slash"), ("%5c", "backslash"), ("%00", "NUL")] {
        if lower.contains(enc) {
            return Err(refuse(format!("must not contain `{enc}` (a percent-encoded {what}): path traversal")));
        }
    }
    let after_scheme = &uri[scheme.len() + 3..];
    if after_scheme.split('/').any(|seg| seg == ".." || seg == ".") {
        return Err(refuse("must not contain `.` or `..` path segments: path traversal"));
    }
    for (i, base) in allowed.iter().enumerate() {
        let base = base.trim_end_matches('/');
        if let Some(key) = uri.strip_prefix(base).and_then(|rest| rest.strip_prefix('/')) {
            if key.is_empty() || key.ends_with('/') || key.split('/').any(str::is_empty) {
                return Err(refuse("must name an object, not a folder"));
            }
            return Ok((i, key));
        }
    }
    // Where the store is stays the server's business: the answer names none of it.
    let place = match scheme {
        "file" => "a file outside the store root",
        "s3" => "an object outside the configured bucket and prefix",
        _ => "outside the configured store",
    };
    Err(refuse(format!(
        "is {place}; only objects in the store are read: upload the file with POST /v1/uploads and use the \
         audio_uri it returns"
    )))
}

/// The folder of `owner`'s uploads inside a store (`POST /v1/uploads` writes there).
pub fn uploads_prefix(owner: &str) -> String {
    format!("uploads/{owner}/")
}

/// Refuses a store object (its key, from [`store_key`]) outside `owner`'s uploads: a job
/// reads only what its owner uploaded, never another owner's upload or another job's
/// stems.
pub fn check_owned(key: &str, owner: &str) -> Result<(), RequestError> {
    if key.starts_with(&uploads_prefix(owner)) {
        Ok(())
    } else {
        Err(refuse(format!(
            "must be one of your own uploads ({}…); upload the file with POST /v1/uploads and use the audio_uri it returns",
            uploads_prefix(owner)
        )))
    }
}

fn describe_ip(ip: IpAddr) -> String {
    let kind = match ip {
        IpAddr::V4(v4) if v4.is_link_local() => "a link-local (cloud metadata) address",
        IpAddr::V4(v4) if v4.is_loopback() => "a loopback address",
        IpAddr::V4(v4) if v4.is_private() => "a private address",
        IpAddr::V4(v4) if v4.is_unspecified() => "the unspecified address",
        IpAddr::V6(v6) if v6.is_loopback() => "a loopback address",
        IpAddr::V6(v6) if (v6.segments()[0] & 0xffc0) == 0xfe80 => "a link-local address",
        IpAddr::V6(v6) if (v6.segments()[0] & 0xfe00) == 0xfc00 => "a private address",
        IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some() => "an IPv4-mapped address",
        _ => "an address",
    };
    format!("{ip} is {kind}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allowed() -> Vec<String> {
        vec!["file:///srv/stemq/store".to_string(), "s3://songs/prod".to_string()]
    }

    fn refused(uri: &str) -> String {
        let e = check_audio_uri(uri, &allowed()).expect_err(uri);
        assert_eq!(e.field, "audio_uri", "{uri}");
        e.message
    }

    #[test]
    fn objects_inside_the_stores_are_accepted() {
        assert_eq!(store_key("file:///srv/stemq/store/uploads/ab.wav", &allowed()).unwrap(), (0, "uploads/ab.wav"));
        assert_eq!(store_key("s3://songs/prod/uploads/ab.flac", &allowed()).unwrap(), (1, "uploads/ab.flac"));
        // A trailing slash on the configured base changes nothing.
        let a = vec!["file:///srv/stemq/store/".to_string()];
        assert_eq!(store_key("file:///srv/stemq/store/x.wav", &a).unwrap(), (0, "x.wav"));
        assert!(check_audio_uri("file:///srv/stemq/store/a%20b.wav", &allowed()).is_ok());
    }

    #[test]
    fn only_the_owners_own_uploads_are_readable() {
        assert!(check_owned("uploads/acme/ab.wav", "acme").is_ok());
        for key in
            ["uploads/acme2/ab.wav", "uploads/ab.wav", "jobs/0123/vocals.wav", "uploads/acmeab.wav", "x/uploads/acme/a"]
        {
            assert_eq!(check_owned(key, "acme").unwrap_err().field, "audio_uri", "{key}");
        }
    }

    #[test]
    fn http_is_refused_for_every_host() {
        for uri in [
            "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
            "http://127.0.0.1:8080/v1/separations",
            "http://[::1]/x.wav",
            "http://10.0.0.5/x.wav",
            "http://192.168.1.1/x.wav",
            "https://example.com/song.wav",
            "http://0.0.0.0/x",
        ] {
            let m = refused(uri);
            assert!(m.contains("never fetched") && m.contains("/v1/uploads"), "{uri}: {m}");
        }
        assert!(refused("http://169.254.169.254/latest").contains("link-local"));
        assert!(refused("http://127.0.0.1/").contains("loopback"));
        assert!(refused("http://10.1.2.3/").contains("private"));
        assert!(refused("http://[::1]/").contains("loopback"));
    }

    #[test]
    fn web_urls_are_recognised_by_scheme() {
        for u in ["https://example.com/a.wav", "http://10.0.0.1/", "HTTPS://x/"] {
            assert!(is_web_url(u), "{u}");
        }
        for u in ["file:///a.wav", "s3://b/k", "ftp://x/", "httpx://x/", "not a uri"] {
            assert!(!is_web_url(u), "{u}");
        }
    }

    #[test]
    fn other_schemes_are_refused() {
        for uri in ["ftp://example.com/a.wav", "gs://bucket/a.wav", "data:audio/wav;base64,AAAA", "memory:///a"] {
            let m = refused(uri);
            assert!(m.contains("is not accepted") && m.contains("file, s3"), "{uri}: {m}");
        }
        assert!(refused("not a uri").contains("not an absolute URI"));
        let none = check_audio_uri("file:///a.wav", &[]).unwrap_err();
        assert!(none.message.contains("none configured"), "{}", none.message);
    }

    #[test]
    fn files_outside_the_store_root_are_refused() {
        for uri in [
            "file:///etc/passwd",
            "file:///srv/stemq/store-other/a.wav",
            "file:///srv/stemq/a.wav",
            "file://otherhost/srv/stemq/store/a.wav",
        ] {
            let m = refused(uri);
            assert!(m.contains("outside the store root"), "{uri}");
            // The caller is never told where the store is.
            assert!(!m.contains("/srv/stemq/store") && !m.contains("s3://songs"), "{uri}: {m}");
        }
        assert!(refused("file:///srv/stemq/store").contains("outside"));
        assert!(refused("file:///srv/stemq/store/").contains("not a folder"));
        assert!(refused("file:///srv/stemq/store/uploads/").contains("not a folder"));
        assert!(refused("file:///srv/stemq/store//etc/passwd").contains("not a folder"));
    }

    #[test]
    fn other_buckets_and_prefixes_are_refused() {
        for uri in ["s3://other/prod/a.wav", "s3://songs/staging/a.wav", "s3://songs/production/a.wav"] {
            assert!(refused(uri).contains("outside the configured bucket"), "{uri}");
        }
    }

    #[test]
    fn traversal_is_refused_plain_and_encoded() {
        for uri in [
            "file:///srv/stemq/store/../../../etc/passwd",
            "file:///srv/stemq/store/uploads/../../x",
            "file:///srv/stemq/store/./x.wav",
            "s3://songs/prod/../staging/a.wav",
        ] {
            assert!(refused(uri).contains("path traversal"), "{uri}");
        }
        for uri in [
            "file:///srv/stemq/store/%2e%2e/%2e%2e/etc/passwd",
            "file:///srv/stemq/store/%2E%2E/x",
            "file:///srv/stemq/store/..%2f..%2fetc/passwd",
            "file:///srv/stemq/store/..%5c..%5cx",
            "s3://songs/prod/a%00.wav",
        ] {
            let m = refused(uri);
            assert!(m.contains("percent-encoded") && m.contains("path traversal"), "{uri}: {m}");
        }
        assert!(refused("file:///srv/stemq/store/..\\x").contains("backslash"));
        assert!(refused("file:///srv/stemq/store/a.wav?x=1").contains("query"));
        assert!(refused("file:///srv/stemq/store/a.wav#f").contains("fragment"));
    }
}
