//! The address policy: which hosts and addresses stemq connects to when a request names
//! a URL (webhook receivers, external audio URLs).
//!
//! This module owns the server-side request forgery (SSRF) rules, one set for every
//! outbound URL:
//!
//! - [`SPECIAL_PURPOSE`]: every range of the IANA IPv4 and IPv6 Special-Purpose Address
//!   Registries (plus multicast and the deprecated IPv6 site-local range), each with its
//!   name and RFC. [`check_ip`] refuses an address in any of them, and any IPv6 address
//!   outside `2000::/3`, the only space allocated for global unicast. For IPv6 ranges
//!   that embed an IPv4 address (IPv4-mapped, IPv4-compatible, IPv4-translated, both
//!   NAT64 prefixes, 6to4, Teredo's client and server) the embedded address is taken
//!   out and named when it is not public; the embedding prefixes are refused either way,
//!   since a translator or relay would carry the request to an address we never checked;
//! - [`Allowlist`]: hosts and networks an operator vouches for: they may be private and
//!   may use plain http (`STEMQ_WEBHOOK_ALLOW=127.0.0.1,10.0.0.0/8,hooks.internal`);
//! - [`HostPolicy`]: which hosts a URL may name at all: any public host (webhooks), or
//!   only those an operator lists, with `*` and `*.example.com` wildcards for public
//!   hosts (external audio, `STEMQ_AUDIO_URL_ALLOW`);
//! - [`precheck`] and [`Unresolved::pin`]: the URL check in two pure halves around DNS,
//!   and, with the `resolve` feature, [`check_url`], which resolves the host once in
//!   between. Every address a name resolves to must be allowed, and the [`Target`] carries the
//!   address that was checked, so the caller connects to exactly that (no DNS
//!   rebinding between the check and the connection).
//!
//! The table and the checks are plain functions of their inputs and need no runtime;
//! only [`check_url`] resolves names.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

/// How an IPv6 range carries an IPv4 address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Embedding {
    /// In the last 32 bits (IPv4-mapped, -compatible, -translated; NAT64 with a /96).
    Last32,
    /// In bits 16..48 (6to4, `2002:AABB:CCDD::/48`).
    SixToFour,
    /// Teredo: the server in bits 32..64, the client inverted in the last 32 bits.
    Teredo,
}

/// One special-purpose range: an address in it is not a destination on the public
/// internet (or is one that only reaches us through a translator, relay or tunnel).
#[derive(Debug, PartialEq, Eq)]
pub struct SpecialRange {
    /// The network.
    pub net: IpNet,
    /// The registry's name for it, shortened.
    pub name: &'static str,
    /// The RFC that set it aside.
    pub rfc: &'static str,
    /// Where an embedded IPv4 address sits, for IPv6 ranges that carry one.
    pub embeds: Option<Embedding>,
}

impl fmt::Display for SpecialRange {
    /// `198.18.0.0/15 benchmarking (RFC 2544)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} ({})", self.net, self.name, self.rfc)
    }
}

const fn v4(a: u8, b: u8, c: u8, d: u8, len: u8, name: &'static str, rfc: &'static str) -> SpecialRange {
    SpecialRange { net: IpNet::V4(Ipv4Net::new_assert(Ipv4Addr::new(a, b, c, d), len)), name, rfc, embeds: None }
}

const fn v6(s: [u16; 8], len: u8, name: &'static str, rfc: &'static str, embeds: Option<Embedding>) -> SpecialRange {
    let ip = Ipv6Addr::new(s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]);
    SpecialRange { net: IpNet::V6(Ipv6Net::new_assert(ip, len)), name, rfc, embeds }
}

const LAST32: Option<Embedding> = Some(Embedding::Last32);

/// Every range refused as a destination. The IANA IPv4 and IPv6 Special-Purpose
/// Address Registries (as of late 2024), multicast (`224.0.0.0/4`, `ff00::/8`) and the
/// deprecated IPv6 site-local range. Ranges nest (`2001::/32` inside `2001::/23`): the
/// longest match names the reason. Blocks the registry marks globally reachable but
/// that only hold anycast infrastructure (AS112, AMT, PCP/TURN anycast) are refused as
/// well: no webhook or song lives there.
pub const SPECIAL_PURPOSE: &[SpecialRange] = &[
    // IPv4.
    v4(0, 0, 0, 0, 8, "\"this network\"", "RFC 791"),
    v4(10, 0, 0, 0, 8, "private-use", "RFC 1918"),
    v4(100, 64, 0, 0, 10, "shared address space (CGNAT)", "RFC 6598"),
    v4(127, 0, 0, 0, 8, "loopback", "RFC 1122"),
    v4(169, 254, 0, 0, 16, "link-local", "RFC 3927"),
    v4(172, 16, 0, 0, 12, "private-use", "RFC 1918"),
    v4(192, 0, 0, 0, 24, "IETF protocol assignments", "RFC 6890"),
    v4(192, 0, 2, 0, 24, "documentation (TEST-NET-1)", "RFC 5737"),
    v4(192, 31, 196, 0, 24, "AS112-v4", "RFC 7535"),
    v4(192, 52, 193, 0, 24, "AMT", "RFC 7450"),
    v4(192, 88, 99, 0, 24, "deprecated 6to4 relay anycast", "RFC 7526"),
    v4(192, 168, 0, 0, 16, "private-use", "RFC 1918"),
    v4(192, 175, 48, 0, 24, "direct delegation AS112 service", "RFC 7534"),
    v4(198, 18, 0, 0, 15, "benchmarking", "RFC 2544"),
    v4(198, 51, 100, 0, 24, "documentation (TEST-NET-2)", "RFC 5737"),
    v4(203, 0, 113, 0, 24, "documentation (TEST-NET-3)", "RFC 5737"),
    v4(224, 0, 0, 0, 4, "multicast", "RFC 5771"),
    v4(240, 0, 0, 0, 4, "reserved", "RFC 1112"),
    v4(255, 255, 255, 255, 32, "limited broadcast", "RFC 919"),
    // IPv6.
    v6([0, 0, 0, 0, 0, 0, 0, 0], 128, "unspecified", "RFC 4291", None),
    v6([0, 0, 0, 0, 0, 0, 0, 1], 128, "loopback", "RFC 4291", None),
    v6([0, 0, 0, 0, 0, 0, 0, 0], 96, "IPv4-compatible (deprecated)", "RFC 4291", LAST32),
    v6([0, 0, 0, 0, 0, 0xffff, 0, 0], 96, "IPv4-mapped", "RFC 4291", LAST32),
    v6([0, 0, 0, 0, 0xffff, 0, 0, 0], 96, "IPv4-translated", "RFC 2765", LAST32),
    v6([0x64, 0xff9b, 0, 0, 0, 0, 0, 0], 96, "NAT64 well-known prefix", "RFC 6052", LAST32),
    // Local-use NAT64 prefixes of any RFC 6052 length live here; the /96 layout is the
    // one that names the embedded address (the prefix is refused whatever it holds).
    v6([0x64, 0xff9b, 1, 0, 0, 0, 0, 0], 48, "local-use IPv4/IPv6 translation", "RFC 8215", LAST32),
    v6([0x100, 0, 0, 0, 0, 0, 0, 0], 64, "discard-only", "RFC 6666", None),
    v6([0x2001, 0, 0, 0, 0, 0, 0, 0], 23, "IETF protocol assignments", "RFC 2928", None),
    v6([0x2001, 0, 0, 0, 0, 0, 0, 0], 32, "Teredo", "RFC 4380", Some(Embedding::Teredo)),
    v6([0x2001, 2, 0, 0, 0, 0, 0, 0], 48, "benchmarking", "RFC 5180", None),
    v6([0x2001, 3, 0, 0, 0, 0, 0, 0], 32, "AMT", "RFC 7450", None),
    v6([0x2001, 4, 0x112, 0, 0, 0, 0, 0], 48, "AS112-v6", "RFC 7535", None),
    v6([0x2001, 0x10, 0, 0, 0, 0, 0, 0], 28, "ORCHID (deprecated)", "RFC 4843", None),
    v6([0x2001, 0x20, 0, 0, 0, 0, 0, 0], 28, "ORCHIDv2", "RFC 7343", None),
    v6([0x2001, 0x30, 0, 0, 0, 0, 0, 0], 28, "drone remote ID", "RFC 9374", None),
    v6([0x2001, 0xdb8, 0, 0, 0, 0, 0, 0], 32, "documentation", "RFC 3849", None),
    v6([0x2002, 0, 0, 0, 0, 0, 0, 0], 16, "6to4", "RFC 3056", Some(Embedding::SixToFour)),
    v6([0x2620, 0x4f, 0x8000, 0, 0, 0, 0, 0], 48, "direct delegation AS112 service", "RFC 7534", None),
    v6([0x3fff, 0, 0, 0, 0, 0, 0, 0], 20, "documentation", "RFC 9637", None),
    v6([0x5f00, 0, 0, 0, 0, 0, 0, 0], 16, "segment routing SIDs", "RFC 9602", None),
    v6([0xfc00, 0, 0, 0, 0, 0, 0, 0], 7, "unique local", "RFC 4193", None),
    v6([0xfe80, 0, 0, 0, 0, 0, 0, 0], 10, "link-local", "RFC 4291", None),
    v6([0xfec0, 0, 0, 0, 0, 0, 0, 0], 10, "site-local (deprecated)", "RFC 3879", None),
    v6([0xff00, 0, 0, 0, 0, 0, 0, 0], 8, "multicast", "RFC 4291", None),
];

/// Why an address is not a public destination.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// In a special-purpose range.
    #[error("{ip} is in {range}")]
    Special {
        /// The address.
        ip: IpAddr,
        /// The (longest) range holding it.
        range: &'static SpecialRange,
    },
    /// In an IPv6 range that embeds an IPv4 address, and that address is not public.
    #[error("{ip} is in {range} and embeds {embedded}, which is in {inner}")]
    Embeds {
        /// The address.
        ip: IpAddr,
        /// The embedding range.
        range: &'static SpecialRange,
        /// The IPv4 address taken out of it.
        embedded: Ipv4Addr,
        /// The range holding the embedded address.
        inner: &'static SpecialRange,
    },
    /// An IPv6 address outside `2000::/3`: nothing there is allocated for global unicast.
    #[error("{0} is outside 2000::/3, the only IPv6 space allocated for global unicast (RFC 4291)")]
    NotGlobalUnicast(Ipv6Addr),
}

impl Refusal {
    /// The range named as the reason (the embedded address's, when that is the reason).
    pub fn range(&self) -> Option<&'static SpecialRange> {
        match self {
            Refusal::Special { range, .. } => Some(range),
            Refusal::Embeds { inner, .. } => Some(inner),
            Refusal::NotGlobalUnicast(_) => None,
        }
    }
}

/// The longest special-purpose range holding `ip`, if any.
pub fn special_range(ip: IpAddr) -> Option<&'static SpecialRange> {
    SPECIAL_PURPOSE.iter().filter(|r| r.net.contains(&ip)).max_by_key(|r| r.net.prefix_len())
}

/// The IPv4 addresses `ip` carries in `range` (Teredo carries two: client, server).
fn embedded(range: &SpecialRange, ip: Ipv6Addr) -> Vec<Ipv4Addr> {
    let b = u128::from(ip);
    let at = |shift: u32| Ipv4Addr::from((b >> shift) as u32);
    match range.embeds {
        None => Vec::new(),
        Some(Embedding::Last32) => vec![at(0)],
        Some(Embedding::SixToFour) => vec![at(80)],
        Some(Embedding::Teredo) => vec![Ipv4Addr::from(!(b as u32)), at(64)],
    }
}

/// Accepts `ip` only when it is a public destination. See the module docs.
pub fn check_ip(ip: IpAddr) -> Result<(), Refusal> {
    let Some(range) = special_range(ip) else {
        return match ip {
            IpAddr::V6(v6) if v6.segments()[0] & 0xe000 != 0x2000 => Err(Refusal::NotGlobalUnicast(v6)),
            _ => Ok(()),
        };
    };
    if let IpAddr::V6(v6) = ip {
        for inner_ip in embedded(range, v6) {
            if let Some(inner) = special_range(IpAddr::V4(inner_ip)) {
                return Err(Refusal::Embeds { ip, range, embedded: inner_ip, inner });
            }
        }
    }
    Err(Refusal::Special { ip, range })
}

/// True for an IPv6 address in a range that embeds an IPv4 address (IPv4-mapped,
/// -compatible, -translated, NAT64, 6to4, Teredo): refused as a destination always,
/// whatever an allow-list says.
pub fn embeds_ipv4(ip: IpAddr) -> bool {
    special_range(ip).is_some_and(|r| r.embeds.is_some())
}

/// True for addresses on the public internet ([`check_ip`] accepts them).
pub fn is_public(ip: IpAddr) -> bool {
    check_ip(ip).is_ok()
}

/// Host names and networks an operator vouches for: reachable although not public,
/// and over plain http too (`STEMQ_WEBHOOK_ALLOW=127.0.0.1,10.0.0.0/8,hooks.internal`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Allowlist {
    hosts: Vec<String>,
    /// Networks (a bare address is its own `/32` or `/128`), matched with `ipnet`.
    nets: Vec<IpNet>,
}

impl Allowlist {
    /// Parses a comma-separated list of host names, addresses and CIDRs. An address may
    /// be bracketed (`[::1]`, `[fd00::]/8`); host bits in a CIDR are ignored
    /// (`10.1.2.3/8` is `10.0.0.0/8`); anything that is neither an address nor a CIDR is
    /// a host name.
    pub fn parse(s: &str) -> Allowlist {
        let mut a = Allowlist::default();
        for item in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
            a.push(item);
        }
        a
    }

    fn push(&mut self, item: &str) {
        let bare: String = item.chars().filter(|c| !matches!(c, '[' | ']')).collect();
        if let Ok(net) = bare.parse::<IpNet>() {
            self.nets.push(net);
        } else if let Ok(ip) = bare.parse::<IpAddr>() {
            self.nets.push(IpNet::from(ip));
        } else {
            self.hosts.push(item.to_ascii_lowercase());
        }
    }

    /// From the environment variable `var` (empty when unset).
    pub fn from_env(var: &str) -> Allowlist {
        Allowlist::parse(&std::env::var(var).unwrap_or_default())
    }

    /// True when nothing is listed.
    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty() && self.nets.is_empty()
    }

    /// True when `host` is listed by name (case and a trailing dot do not matter).
    pub fn allows_host(&self, host: &str) -> bool {
        let host = normal_host(host);
        self.hosts.iter().any(|h| normal_host(h) == host)
    }

    /// True when a listed network holds `ip`. An IPv6 address that embeds an IPv4 one
    /// ([`embeds_ipv4`]: `::ffff:127.0.0.1`, `64:ff9b::7f00:1`...) is never allowed, not
    /// even by a network that holds it: only the IPv4 address itself is.
    pub fn allows_ip(&self, ip: IpAddr) -> bool {
        !embeds_ipv4(ip) && self.nets.iter().any(|net| net.contains(&ip))
    }
}

fn normal_host(h: &str) -> String {
    h.strip_suffix('.').unwrap_or(h).to_ascii_lowercase()
}

/// Which hosts a URL may name, and which of them may be private.
///
/// - exempt ([`Allowlist`] entries): a named host, whatever its addresses, and any
///   address inside a listed network (an address URL, or an address an admitted name
///   resolves to); plain http is allowed when every address is exempt;
/// - wildcards: `*` (any host) and `*.example.com` (its subdomains, not itself) admit a
///   name or address whose every address is public (or exempt), over https.
///
/// A host name that no name or wildcard admits is refused before DNS.
///
/// Webhooks use [`HostPolicy::public`] (any public host, plus `STEMQ_WEBHOOK_ALLOW`);
/// external audio URLs use [`HostPolicy::parse`] of `STEMQ_AUDIO_URL_ALLOW`, where the
/// empty policy admits nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostPolicy {
    /// `*`: any host whose addresses are all public.
    any_public: bool,
    /// `*.example.com` as `example.com`: subdomains whose addresses are all public.
    suffixes: Vec<String>,
    /// Named hosts and networks, private or not.
    exempt: Allowlist,
}

/// A [`HostPolicy`] that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}`: a wildcard is `*` alone or `*.` before a domain (`*.example.com`)")]
pub struct PolicyParseError(pub String);

impl HostPolicy {
    /// Any public host, and the hosts and networks of `exempt` whatever their address.
    pub fn public(exempt: Allowlist) -> HostPolicy {
        HostPolicy { any_public: true, suffixes: Vec::new(), exempt }
    }

    /// Parses the [`Allowlist`] syntax plus wildcards: `*`, `*.example.com`.
    pub fn parse(s: &str) -> Result<HostPolicy, PolicyParseError> {
        let mut p = HostPolicy::default();
        for item in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
            if item == "*" {
                p.any_public = true;
            } else if let Some(domain) = item.strip_prefix("*.") {
                let domain = normal_host(domain);
                if domain.is_empty() || domain.contains('*') || domain.parse::<IpAddr>().is_ok() {
                    return Err(PolicyParseError(item.to_string()));
                }
                p.suffixes.push(domain);
            } else if item.contains('*') {
                return Err(PolicyParseError(item.to_string()));
            } else {
                p.exempt.push(item);
            }
        }
        Ok(p)
    }

    /// True when it admits no host at all.
    pub fn is_empty(&self) -> bool {
        !self.any_public && self.suffixes.is_empty() && self.exempt.is_empty()
    }

    /// The exempt hosts and networks.
    pub fn exempt(&self) -> &Allowlist {
        &self.exempt
    }

    /// True when a wildcard admits `host` (its addresses must still be public).
    fn wildcard_admits(&self, host: &str) -> bool {
        if self.any_public {
            return true;
        }
        let host = normal_host(host);
        self.suffixes.iter().any(|s| {
            host.len() > s.len() + 1 && host.ends_with(s.as_str()) && host.as_bytes()[host.len() - s.len() - 1] == b'.'
        })
    }
}

/// Why a URL is refused. The messages are sentences for whoever gave the URL.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UrlError {
    /// Not an absolute URL.
    #[error("is not an absolute URL: {0}")]
    NotUrl(#[source] url::ParseError),
    /// Neither https nor http.
    #[error("scheme {0} is not allowed; use https")]
    Scheme(String),
    /// No host (`https:///x`).
    #[error("has no host")]
    NoHost,
    /// `user:password@` in the URL.
    #[error("must not carry credentials")]
    Credentials,
    /// The policy admits no such host.
    #[error("host {0} is not on this service's allow-list")]
    HostNotAllowed(String),
    /// The name did not resolve (may resolve later).
    #[error("host {host} does not resolve: {source}")]
    Resolve {
        /// The name.
        host: String,
        /// The resolver's answer.
        #[source]
        source: ResolveError,
    },
    /// The name resolved to nothing.
    #[error("host {0} has no address")]
    NoAddress(String),
    /// An address of the host is not public, and the host is not exempt.
    #[error("points to a non-public address ({0}); not allowed")]
    NotPublic(Refusal),
    /// Plain http to a host that is not exempt.
    #[error("must use https")]
    PlainHttp,
}

/// What the resolver answered when a name did not resolve (a timeout is
/// [`std::io::ErrorKind::TimedOut`]). Two are equal when they have the same kind and text.
#[derive(Debug, Clone, thiserror::Error)]
#[error(transparent)]
pub struct ResolveError(std::sync::Arc<std::io::Error>);

impl ResolveError {
    /// Keeps the resolver's error.
    pub fn new(e: std::io::Error) -> ResolveError {
        ResolveError(std::sync::Arc::new(e))
    }

    /// The resolver's error.
    pub fn io(&self) -> &std::io::Error {
        &self.0
    }
}

impl PartialEq for ResolveError {
    fn eq(&self, other: &ResolveError) -> bool {
        self.0.kind() == other.0.kind() && self.0.to_string() == other.0.to_string()
    }
}

impl Eq for ResolveError {}

impl UrlError {
    /// True when the same URL may be allowed later (its name did not resolve now).
    pub fn is_transient(&self) -> bool {
        matches!(self, UrlError::Resolve { .. })
    }
}

/// A URL that passed the checks that need no DNS: resolve [`Unresolved::host`], then
/// [`Unresolved::pin`] the addresses.
#[derive(Debug, Clone)]
pub struct Unresolved<'p> {
    url: url::Url,
    host: String,
    port: u16,
    literal: Option<IpAddr>,
    policy: &'p HostPolicy,
}

/// Checks what can be checked of `raw` before DNS: an absolute http(s) URL without
/// credentials, whose host the policy admits by name, by wildcard, or (an address) by
/// network.
pub fn precheck<'p>(raw: &str, policy: &'p HostPolicy) -> Result<Unresolved<'p>, UrlError> {
    let url = url::Url::parse(raw).map_err(UrlError::NotUrl)?;
    match url.scheme() {
        "https" | "http" => {}
        s => return Err(UrlError::Scheme(s.to_string())),
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(UrlError::Credentials);
    }
    let (host, literal) = match url.host() {
        None => return Err(UrlError::NoHost),
        Some(url::Host::Domain("")) => return Err(UrlError::NoHost),
        Some(url::Host::Domain(d)) => (d.to_string(), None),
        Some(url::Host::Ipv4(ip)) => (ip.to_string(), Some(IpAddr::V4(ip))),
        Some(url::Host::Ipv6(ip)) => (ip.to_string(), Some(IpAddr::V6(ip))),
    };
    let port = url.port_or_known_default().ok_or(UrlError::NoHost)?;
    let exempt = &policy.exempt;
    let may_pass = policy.exempt.allows_host(&host)
        || policy.wildcard_admits(&host)
        || match literal {
            Some(ip) => exempt.allows_ip(ip),
            None => false,
        };
    if !may_pass {
        return Err(UrlError::HostNotAllowed(host));
    }
    Ok(Unresolved { url, host, port, literal, policy })
}

impl Unresolved<'_> {
    /// The host name (or address) to resolve.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The port (the scheme's default when the URL has none).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The address, when the host is an address (nothing to resolve).
    pub fn literal(&self) -> Option<IpAddr> {
        self.literal
    }

    /// Checks every address the host resolved to and returns the target pinned to the
    /// first. An address passes when the host is exempt by name, or the address is in
    /// an exempt network, or a wildcard admits the host and the address is public.
    /// Plain http passes only when every address is exempt.
    pub fn pin(self, addrs: &[SocketAddr]) -> Result<Target, UrlError> {
        let addr = *addrs.first().ok_or_else(|| UrlError::NoAddress(self.host.clone()))?;
        let exempt = &self.policy.exempt;
        let host_exempt = exempt.allows_host(&self.host);
        let wildcard = self.policy.wildcard_admits(&self.host);
        let mut all_exempt = true;
        for a in addrs {
            if embeds_ipv4(a.ip()) {
                // Not even for an exempt name: an embedded address reaches through a
                // translator or relay to somewhere nobody listed.
                return Err(UrlError::NotPublic(check_ip(a.ip()).expect_err("an embedding range is special")));
            }
            if host_exempt || exempt.allows_ip(a.ip()) {
                continue;
            }
            all_exempt = false;
            if !wildcard {
                return Err(UrlError::HostNotAllowed(self.host));
            }
            check_ip(a.ip()).map_err(UrlError::NotPublic)?;
        }
        if self.url.scheme() == "http" && !all_exempt {
            return Err(UrlError::PlainHttp);
        }
        Ok(Target { url: self.url, host: self.host, addr })
    }
}

/// A checked URL: where to connect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// The URL.
    pub url: url::Url,
    /// Its host name (for the pinned resolution).
    pub host: String,
    /// The one address checked and to be used (with the URL's port).
    pub addr: SocketAddr,
}

/// Longest wait for the resolver.
#[cfg(feature = "resolve")]
const RESOLVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Checks `raw` against `policy`, resolving its host once: [`precheck`], DNS, then
/// [`Unresolved::pin`]. Connect to the returned [`Target::addr`], never to the name.
#[cfg(feature = "resolve")]
pub async fn check_url(raw: &str, policy: &HostPolicy) -> Result<Target, UrlError> {
    let u = precheck(raw, policy)?;
    let addrs: Vec<SocketAddr> = match u.literal() {
        Some(ip) => vec![SocketAddr::new(ip, u.port())],
        None => {
            let resolve_err =
                |e: std::io::Error| UrlError::Resolve { host: u.host().to_string(), source: ResolveError::new(e) };
            let timed_out =
                || std::io::Error::new(std::io::ErrorKind::TimedOut, format!("no answer within {RESOLVE_TIMEOUT:?}"));
            let found = tokio::time::timeout(RESOLVE_TIMEOUT, tokio::net::lookup_host((u.host(), u.port())))
                .await
                .map_err(|_| resolve_err(timed_out()))?
                .map_err(resolve_err)?;
            found.collect()
        }
    };
    u.pin(&addrs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    /// One address inside each range, the range it must be refused for, and (where one
    /// exists) a public neighbour just outside.
    #[test]
    fn every_special_purpose_range_is_refused_with_its_name() {
        let table: &[(&str, &str, Option<&str>)] = &[
            ("0.1.2.3", "0.0.0.0/8", Some("1.0.0.1")),
            ("10.255.255.255", "10.0.0.0/8", Some("11.0.0.0")),
            ("100.64.0.1", "100.64.0.0/10", Some("100.128.0.0")),
            ("100.127.255.255", "100.64.0.0/10", Some("100.63.255.255")),
            ("127.0.0.1", "127.0.0.0/8", Some("128.0.0.1")),
            ("169.254.169.254", "169.254.0.0/16", Some("169.255.0.1")),
            ("172.31.255.255", "172.16.0.0/12", Some("172.32.0.0")),
            ("172.16.0.0", "172.16.0.0/12", Some("172.15.255.255")),
            ("192.0.0.9", "192.0.0.0/24", Some("192.0.1.1")),
            ("192.0.2.1", "192.0.2.0/24", Some("192.0.3.1")),
            ("192.31.196.1", "192.31.196.0/24", Some("192.31.197.1")),
            ("192.52.193.1", "192.52.193.0/24", Some("192.52.194.1")),
            ("192.88.99.1", "192.88.99.0/24", Some("192.88.98.1")),
            ("192.168.1.1", "192.168.0.0/16", Some("192.169.0.1")),
            ("192.175.48.1", "192.175.48.0/24", Some("192.175.49.1")),
            ("198.18.0.1", "198.18.0.0/15", Some("198.17.255.255")),
            ("198.19.255.255", "198.18.0.0/15", Some("198.20.0.0")),
            ("198.51.100.7", "198.51.100.0/24", Some("198.51.101.7")),
            ("203.0.113.7", "203.0.113.0/24", Some("203.0.114.7")),
            ("224.0.0.1", "224.0.0.0/4", Some("223.255.255.255")),
            ("239.255.255.250", "224.0.0.0/4", None),
            ("240.0.0.1", "240.0.0.0/4", None),
            ("255.255.255.255", "255.255.255.255/32", None),
            ("::", "::/128", None),
            ("::1", "::1/128", None),
            ("::8.8.8.8", "::/96", None),
            ("::ffff:8.8.8.8", "::ffff:0.0.0.0/96", None),
            ("::ffff:0:808:808", "::ffff:0:0:0/96", None),
            ("64:ff9b::808:808", "64:ff9b::/96", None),
            ("64:ff9b:1::808:808", "64:ff9b:1::/48", None),
            ("100::1", "100::/64", None),
            ("2001:1::1", "2001::/23", Some("2001:200::1")),
            // Teredo with a public server (8.8.4.4) and client (8.8.8.8, inverted).
            ("2001:0:808:404::f7f7:f7f7", "2001::/32", None),
            ("2001:2::1", "2001:2::/48", None),
            ("2001:3::1", "2001:3::/32", None),
            ("2001:4:112::1", "2001:4:112::/48", None),
            ("2001:10::1", "2001:10::/28", None),
            ("2001:20::1", "2001:20::/28", None),
            ("2001:30::1", "2001:30::/28", None),
            ("2001:db8::1", "2001:db8::/32", Some("2001:db9::1")),
            ("2002:808:808::1", "2002::/16", Some("2003::1")),
            ("2620:4f:8000::1", "2620:4f:8000::/48", Some("2620:4f:8001::1")),
            ("3fff:fff::1", "3fff::/20", Some("3ffe:ffff::1")),
            ("5f00::1", "5f00::/16", None),
            ("fd00::1", "fc00::/7", None),
            ("fe80::1", "fe80::/10", None),
            ("fec0::1", "fec0::/10", None),
            ("ff02::1", "ff00::/8", None),
        ];
        for (inside, net, outside) in table {
            let e = check_ip(ip(inside)).expect_err(inside);
            let Refusal::Special { range, .. } = &e else { panic!("{inside}: {e}") };
            assert_eq!(range.net.to_string(), *net, "{inside}: {e}");
            assert!(e.to_string().contains(&format!("{net} {} ({})", range.name, range.rfc)), "{e}");
            if let Some(o) = outside {
                assert_eq!(check_ip(ip(o)), Ok(()), "{o} (neighbour of {net}) is public");
            }
        }
        // Every row of the table is exercised above.
        for r in SPECIAL_PURPOSE {
            assert!(table.iter().any(|(_, n, _)| *n == r.net.to_string()), "{r} has no test row");
        }
    }

    #[test]
    fn reasons_name_the_range_and_its_rfc() {
        assert_eq!(
            check_ip(ip("198.18.0.1")).unwrap_err().to_string(),
            "198.18.0.1 is in 198.18.0.0/15 benchmarking (RFC 2544)"
        );
        assert_eq!(
            check_ip(ip("64:ff9b::a9fe:a9fe")).unwrap_err().to_string(),
            "64:ff9b::a9fe:a9fe is in 64:ff9b::/96 NAT64 well-known prefix (RFC 6052) and embeds 169.254.169.254, \
             which is in 169.254.0.0/16 link-local (RFC 3927)"
        );
        assert!(check_ip(ip("4000::1")).unwrap_err().to_string().contains("outside 2000::/3"));
    }

    #[test]
    fn public_addresses_pass() {
        for p in ["8.8.8.8", "1.1.1.1", "93.184.216.34", "2606:4700:4700::1111", "2a00:1450:4001::200e", "2001:200::1"]
        {
            assert_eq!(check_ip(ip(p)), Ok(()), "{p}");
            assert!(is_public(ip(p)));
        }
    }

    /// Addresses that are known bypasses of naive URL checks, as webhook targets.
    #[test]
    fn the_reported_bypasses_are_refused() {
        let cases: &[(&str, &str)] = &[
            ("64:ff9b::a9fe:a9fe", "169.254.0.0/16"),
            ("2002:a9fe:a9fe::", "169.254.0.0/16"),
            ("::127.0.0.1", "127.0.0.0/8"),
            ("::ffff:0:7f00:1", "127.0.0.0/8"),
            ("64:ff9b:1::a00:1", "10.0.0.0/8"),
            ("198.18.0.1", "198.18.0.0/15"),
            ("100::1", "100::/64"),
        ];
        for (addr, reason) in cases {
            let e = check_ip(ip(addr)).expect_err(addr);
            assert_eq!(e.range().unwrap().net.to_string(), *reason, "{addr}: {e}");
        }
    }

    #[test]
    fn embedded_ipv4_is_taken_out_of_every_embedding() {
        // Each embedding of a private address names the private range; the embedding
        // of a public address is refused for the prefix itself.
        let cases: &[(&str, &str, &str)] = &[
            ("::ffff:10.1.2.3", "10.0.0.0/8", "::ffff:8.8.4.4"),
            ("::10.1.2.3", "10.0.0.0/8", "::8.8.4.4"),
            ("::ffff:0:a01:203", "10.0.0.0/8", "::ffff:0:808:404"),
            ("64:ff9b::10.1.2.3", "10.0.0.0/8", "64:ff9b::8.8.4.4"),
            ("64:ff9b:1::10.1.2.3", "10.0.0.0/8", "64:ff9b:1::8.8.4.4"),
            ("2002:a01:203::1", "10.0.0.0/8", "2002:808:404::1"),
            // Teredo: client 10.1.2.3 obfuscated (!0x0a010203 = 0xf5fefdfc), server public.
            ("2001:0:808:404:0:0:f5fe:fdfc", "10.0.0.0/8", "2001:0:808:404:0:0:f7f7:fbfb"),
            // Teredo: server private, client public (8.8.4.4 obfuscated).
            ("2001:0:a01:203:0:0:f7f7:fbfb", "10.0.0.0/8", "2001:0:808:404:0:0:f7f7:fbfb"),
        ];
        for (private, inner, public) in cases {
            let e = check_ip(ip(private)).expect_err(private);
            assert!(matches!(e, Refusal::Embeds { .. }), "{private}: {e}");
            assert_eq!(e.range().unwrap().net.to_string(), *inner, "{private}: {e}");
            let e = check_ip(ip(public)).expect_err(public);
            assert!(matches!(e, Refusal::Special { .. }), "{public}: {e}");
        }
    }

    #[test]
    fn allowlist_matches_networks_with_ipnet() {
        let a = Allowlist::parse("10.1.2.3/8, [::1], fd00::/8, 192.168.5.7, Hooks.Internal, 172.16.0.0/12");
        // host bits in a CIDR are ignored
        assert!(a.allows_ip(ip("10.200.0.1")));
        assert!(!a.allows_ip(ip("11.0.0.1")));
        // a bare address is only itself
        assert!(a.allows_ip(ip("192.168.5.7")));
        assert!(!a.allows_ip(ip("192.168.5.8")));
        assert!(a.allows_ip(ip("::1")));
        assert!(!a.allows_ip(ip("::2")));
        assert!(a.allows_ip(ip("fd12:3456::1")));
        assert!(a.allows_ip(ip("172.31.255.255")));
        assert!(!a.allows_ip(ip("172.32.0.0")));
        // IPv6 addresses that embed an IPv4 address never match, not even `::/0`.
        assert!(!a.allows_ip(ip("::ffff:10.0.0.1")));
        assert!(!a.allows_ip(ip("::ffff:11.0.0.1")));
        assert!(!Allowlist::parse("::/0").allows_ip(ip("::ffff:10.0.0.1")));
        assert!(!Allowlist::parse("::/0").allows_ip(ip("64:ff9b::a00:1")));
        assert!(!Allowlist::parse("::/0").allows_ip(ip("8.8.8.8")));
        assert!(Allowlist::parse("0.0.0.0/0").allows_ip(ip("8.8.8.8")));
        // names are hosts, compared without case (or a trailing dot)
        assert!(a.allows_host("hooks.internal"));
        assert!(a.allows_host("HOOKS.internal."));
        assert!(!a.allows_ip(ip("8.8.8.8")));
        assert!(Allowlist::parse(" ,").is_empty());
    }

    fn pin(raw: &str, policy: &HostPolicy, addrs: &[&str]) -> Result<Target, UrlError> {
        let u = precheck(raw, policy)?;
        let addrs: Vec<SocketAddr> = addrs.iter().map(|a| SocketAddr::new(ip(a), u.port())).collect();
        u.pin(&addrs)
    }

    #[test]
    fn webhook_policy_admits_public_hosts_and_exempts_the_allowlist() {
        let none = HostPolicy::public(Allowlist::default());
        let t = pin("https://hooks.example.com/h", &none, &["93.184.216.34", "2606:2800:220:1::1"]).unwrap();
        assert_eq!(t.addr, "93.184.216.34:443".parse().unwrap());
        assert_eq!(t.host, "hooks.example.com");
        // One bad address among good ones refuses the name (round-robin DNS rebinding).
        let e = pin("https://hooks.example.com/h", &none, &["93.184.216.34", "10.0.0.1"]).unwrap_err();
        assert!(matches!(&e, UrlError::NotPublic(r) if r.range().unwrap().net.to_string() == "10.0.0.0/8"), "{e}");
        assert_eq!(pin("http://hooks.example.com/h", &none, &["93.184.216.34"]), Err(UrlError::PlainHttp));
        for bad in ["ftp://93.184.216.34/", "https://u:p@93.184.216.34/", "nope", "data:text/plain,x", "https://[::1/"]
        {
            assert!(precheck(bad, &none).is_err(), "{bad}");
        }
        // An allowlisted private network is still allowed, over http too.
        let local = HostPolicy::public(Allowlist::parse("127.0.0.1, 10.0.0.0/8, hooks.internal"));
        assert!(pin("http://127.0.0.1:9000/h", &local, &["127.0.0.1"]).is_ok());
        assert!(pin("http://10.9.8.7/h", &local, &["10.9.8.7"]).is_ok());
        assert!(pin("http://hooks.internal/h", &local, &["192.168.1.1"]).is_ok());
        assert!(pin("http://192.168.1.1/h", &local, &["192.168.1.1"]).is_err());
        // a name resolving into an allowlisted network is allowed
        assert!(pin("http://svc.corp/h", &local, &["10.1.1.1"]).is_ok());
        // plain http stays refused for public hosts even with an allow-list
        assert_eq!(pin("http://93.184.216.34/h", &local, &["93.184.216.34"]), Err(UrlError::PlainHttp));
    }

    #[test]
    fn audio_policy_admits_only_listed_hosts() {
        let p = HostPolicy::parse("127.0.0.1, *.songs.example.com, media.example.org").unwrap();
        // named and wildcard hosts clear the precheck; others are refused before DNS
        assert!(precheck("https://a.songs.example.com/x.wav", &p).is_ok());
        assert!(precheck("https://b.a.songs.example.com/x.wav", &p).is_ok());
        assert!(precheck("https://media.example.org/x.wav", &p).is_ok());
        for bad in ["https://songs.example.com/x.wav", "https://evilsongs.example.com/x", "https://evil.test/x"] {
            assert!(matches!(precheck(bad, &p), Err(UrlError::HostNotAllowed(_))), "{bad}");
        }
        // a wildcard host must resolve to public addresses, over https
        assert!(pin("https://a.songs.example.com/x", &p, &["93.184.216.34"]).is_ok());
        let e = pin("https://a.songs.example.com/x", &p, &["169.254.169.254"]).unwrap_err();
        assert!(e.to_string().contains("169.254.0.0/16 link-local (RFC 3927)"), "{e}");
        assert_eq!(pin("http://a.songs.example.com/x", &p, &["93.184.216.34"]), Err(UrlError::PlainHttp));
        // a named host is exempt; an allowlisted address too, over http
        assert!(pin("http://media.example.org/x", &p, &["10.0.0.9"]).is_ok());
        assert!(pin("http://127.0.0.1:8000/x.wav", &p, &["127.0.0.1"]).is_ok());
        // `*`: any public host, never a private one
        let any = HostPolicy::parse("*").unwrap();
        assert!(pin("https://cdn.example.net/x", &any, &["93.184.216.34"]).is_ok());
        let e = pin("https://localhost/x", &any, &["127.0.0.1", "::1"]).unwrap_err();
        assert!(matches!(e, UrlError::NotPublic(_)), "{e}");
        assert!(pin("https://[::ffff:0:7f00:1]/x", &any, &["::ffff:0:7f00:1"]).is_err());
        // Loopback listed next to `*`: 127.0.0.1 itself (however the URL spells it: the
        // URL parser reads `127.1` and `2130706433` as 127.0.0.1), never an IPv6 form
        // embedding it, as a literal or as what an admitted or exempt name resolves to.
        let lo = HostPolicy::parse("*,127.0.0.1, media.internal").unwrap();
        for ok in ["http://127.0.0.1:8000/x", "http://127.1:8000/x", "http://2130706433:8000/x"] {
            assert!(pin(ok, &lo, &["127.0.0.1"]).is_ok(), "{ok}");
        }
        for embedded in [
            "::ffff:127.0.0.1",
            "::ffff:7f00:1",
            "::127.0.0.1",
            "::ffff:0:127.0.0.1",
            "64:ff9b::127.0.0.1",
            "64:ff9b:1::7f00:1",
            "2002:7f00:1::1",
            "2001:0:4136:e378:8000:63bf:80ff:fffe",
        ] {
            for scheme in ["http", "https"] {
                let e = pin(&format!("{scheme}://[{embedded}]:8000/x"), &lo, &[embedded]).unwrap_err();
                assert!(matches!(e, UrlError::NotPublic(_)), "{scheme} {embedded}: {e}");
            }
            let e = pin("https://cdn.example.net/x", &lo, &[embedded]).unwrap_err();
            assert!(matches!(e, UrlError::NotPublic(_)), "{embedded} by name: {e}");
            let e = pin("http://media.internal/x", &lo, &[embedded]).unwrap_err();
            assert!(matches!(e, UrlError::NotPublic(_)), "{embedded} by an exempt name: {e}");
        }
        // a network entry admits addresses in it, not names
        let nets = HostPolicy::parse("10.0.0.0/8").unwrap();
        assert!(pin("http://10.2.3.4/x", &nets, &["10.2.3.4"]).is_ok());
        assert!(matches!(precheck("https://11.2.3.4/x", &nets), Err(UrlError::HostNotAllowed(_))));
        assert!(matches!(precheck("https://svc.corp/x", &nets), Err(UrlError::HostNotAllowed(_))));
        // ... and the addresses of names a wildcard admits
        let both = HostPolicy::parse("*.corp.example, 10.0.0.0/8").unwrap();
        assert!(pin("http://svc.corp.example/x", &both, &["10.2.3.4"]).is_ok());
        assert!(pin("https://svc.corp.example/x", &both, &["10.2.3.4", "192.168.0.1"]).is_err());
        // the empty policy admits nothing
        let empty = HostPolicy::parse("").unwrap();
        assert!(empty.is_empty());
        assert!(matches!(precheck("https://example.com/x", &empty), Err(UrlError::HostNotAllowed(_))));
        for bad in ["*.", "a*.example.com", "*.*.example.com", "**", "*.10.0.0.1"] {
            assert!(HostPolicy::parse(bad).is_err(), "{bad}");
        }
    }

    #[cfg(feature = "resolve")]
    #[tokio::test]
    async fn check_url_resolves_once_and_pins() {
        let none = HostPolicy::public(Allowlist::default());
        for bad in [
            "https://127.0.0.1/h",
            "https://169.254.169.254/latest",
            "https://[64:ff9b::a9fe:a9fe]/",
            "https://[2002:a9fe:a9fe::]/",
            "https://[::127.0.0.1]/",
            "https://[::ffff:0:7f00:1]/",
            "https://[64:ff9b:1::a00:1]/",
            "https://198.18.0.1/",
            "https://[100::1]/",
            "https://localhost/h",
        ] {
            assert!(check_url(bad, &none).await.is_err(), "{bad}");
        }
        let t = check_url("https://93.184.216.34/h", &none).await.unwrap();
        assert_eq!(t.addr, "93.184.216.34:443".parse().unwrap());
        let local = HostPolicy::public(Allowlist::parse("localhost"));
        assert!(check_url("http://localhost:1/h", &local).await.is_ok());
    }
}
