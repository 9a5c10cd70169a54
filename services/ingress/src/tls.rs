//! TLS on the HTTP listener (optional): the certificate, the key, and client
//! certificates (mTLS) when a client CA is given.
//!
//! This module owns turning the operator's PEM files into a rustls server configuration
//! (ring provider, TLS 1.2 and 1.3, ALPN `h2` and `http/1.1`); [`crate::serve`] serves
//! the router over it. The files are read once at start: a missing or bad file stops
//! the ingress before it listens, never at the first connection.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};

/// Where the TLS material is (`--tls-cert`, `--tls-key`, `--tls-client-ca`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsConfig {
    /// PEM file with the certificate chain, the server's own certificate first.
    pub cert: PathBuf,
    /// PEM file with the private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// PEM file with the CA certificates that sign client certificates. When set, every
    /// client must present a certificate signed by one of them (mutual TLS); when not,
    /// clients are not asked for one.
    pub client_ca: Option<PathBuf>,
}

/// Why the TLS material cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A PEM file cannot be read or parsed.
    #[error("reading {path}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    /// A PEM file holds no certificate.
    #[error("{0} holds no certificate")]
    NoCertificate(PathBuf),
    /// The client CA file's certificates make no verifier.
    #[error("client CA {path}")]
    ClientCa {
        /// The file.
        path: PathBuf,
        /// Why (a certificate rustls refuses as a trust anchor, or no usable one).
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The certificate and key do not make a server configuration (a key that does not
    /// match the certificate, an unsupported key type).
    #[error("certificate {cert} with key {key}")]
    Config {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// Why.
        #[source]
        source: rustls::Error,
    },
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = |source| TlsError::Pem { path: path.to_path_buf(), source };
    let certs = CertificateDer::pem_file_iter(path).map_err(pem)?.collect::<Result<Vec<_>, _>>().map_err(pem)?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate(path.to_path_buf()));
    }
    Ok(certs)
}

/// Reads the files of `c` into a rustls server configuration.
pub fn server_config(c: &TlsConfig) -> Result<Arc<ServerConfig>, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let chain = certs(&c.cert)?;
    let key = PrivateKeyDer::from_pem_file(&c.key).map_err(|source| TlsError::Pem { path: c.key.clone(), source })?;
    let config_err = |source| TlsError::Config { cert: c.cert.clone(), key: c.key.clone(), source };
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(config_err)?;
    let builder = match &c.client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for cert in certs(ca)? {
                roots.add(cert).map_err(|e| TlsError::ClientCa { path: ca.clone(), source: Box::new(e) })?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| TlsError::ClientCa { path: ca.clone(), source: Box::new(e) })?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_single_cert(chain, key).map_err(config_err)?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}
