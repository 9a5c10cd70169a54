//! The client commands over the HTTP API (`--api URL`, `--api-key KEY`): submit (with
//! upload, wait and download), status, list, watch, cancel and retry, for users who
//! have the API's address and a key but no NATS URL or store credentials.
//!
//! This module owns the HTTP client side of the API: the routes it calls
//! (`POST /v1/uploads`, `POST /v1/separations`, `GET /v1/separations[/{id}]`,
//! `GET …/stems/{stem}`, `POST …/cancel`, `POST …/retry`), the bearer key on every
//! request, and [`ApiError`], which keeps the API's own error code and message.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Result};
use futures::StreamExt;
use reqwest::{Method, RequestBuilder};
use serde::de::DeserializeOwned;
use serde_json::Value;
use stemq_core::{JobId, JobStatus, JobView};
use stemq_ingress::submit::SubmitResponse;
use stemq_ingress::uploads::UploadResponse;
use tokio::io::AsyncWriteExt;

use crate::client::{print_list_header, print_list_row, JobBar, SubmitArgs};
use crate::global::ApiArgs;

// `ApiArgs` is one of the option groups of `global`; this is how it becomes a client.
impl ApiArgs {
    /// The API client, when `--api` is given.
    pub fn client(&self, data_dir: &Path) -> Option<Api> {
        let base = self.api.as_ref()?.as_str().trim_end_matches('/').to_string();
        let key = crate::keys::client_key(self.api_key.as_deref(), data_dir);
        Some(Api { base, key, http: reqwest::Client::new() })
    }
}

/// Why an API call failed.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// No answer (connection refused, timeout, ...).
    #[error("{method} {url}: no answer")]
    Send {
        /// The method.
        method: Method,
        /// The URL.
        url: String,
        /// Why.
        #[source]
        source: reqwest::Error,
    },
    /// The API answered with an error (its `{"error": {"code", "message"}}` body).
    #[error("{method} {url}: {status} {code}: {message}")]
    Status {
        /// The method.
        method: Method,
        /// The URL.
        url: String,
        /// The HTTP status.
        status: u16,
        /// The API's error code (`not_found`, `invalid_request`, ...).
        code: String,
        /// The API's message.
        message: String,
    },
    /// The answer was not what the API describes.
    #[error("{method} {url}: unexpected answer")]
    Body {
        /// The method.
        method: Method,
        /// The URL.
        url: String,
        /// Why.
        #[source]
        source: reqwest::Error,
    },
    /// A local file could not be read or written.
    #[error("{}", path.display())]
    File {
        /// Which file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// A client of one stemq HTTP API.
pub struct Api {
    base: String,
    key: Option<String>,
    http: reqwest::Client,
}

impl Api {
    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn request(&self, method: Method, url: &str) -> RequestBuilder {
        let rb = self.http.request(method, url);
        match &self.key {
            Some(k) => rb.bearer_auth(k),
            None => rb,
        }
    }

    /// Sends `rb` and returns the successful answer, or the API's error.
    async fn send(&self, method: Method, url: &str, rb: RequestBuilder) -> Result<reqwest::Response, ApiError> {
        let resp = rb.send().await.map_err(|e| ApiError::Send {
            method: method.clone(),
            url: url.into(),
            source: e.without_url(),
        })?;
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status().as_u16();
        let body: Value = resp.json().await.unwrap_or(Value::Null);
        let text = |k: &str| body["error"][k].as_str().map(str::to_string);
        Err(ApiError::Status {
            method,
            url: url.into(),
            status,
            code: text("code").unwrap_or_else(|| "error".into()),
            message: text("message").unwrap_or_else(|| "no error message".into()),
        })
    }

    /// Calls `method path` with an optional JSON body and decodes the JSON answer.
    pub(crate) async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<T, ApiError> {
        let url = self.url(path);
        let mut rb = self.request(method.clone(), &url);
        if let Some(b) = body {
            rb = rb.json(b);
        }
        let resp = self.send(method.clone(), &url, rb).await?;
        resp.json().await.map_err(|e| ApiError::Body { method, url, source: e.without_url() })
    }

    /// `POST /v1/uploads`: streams a local file into the API's store; returns its URI.
    pub async fn upload(&self, file: &Path) -> Result<UploadResponse, ApiError> {
        let io = |source| ApiError::File { path: file.to_path_buf(), source };
        let f = tokio::fs::File::open(file).await.map_err(io)?;
        let len = f.metadata().await.map_err(io)?.len();
        let name = file.file_name().and_then(|n| n.to_str()).unwrap_or("upload");
        let mut url = reqwest::Url::parse(&self.url("/v1/uploads")).expect("the API URL parsed before");
        url.query_pairs_mut().append_pair("filename", name);
        let url = url.to_string();
        let body = reqwest::Body::wrap_stream(tokio_util::io::ReaderStream::new(f));
        let rb = self.request(Method::POST, &url).header(reqwest::header::CONTENT_LENGTH, len).body(body);
        let resp = self.send(Method::POST, &url, rb).await?;
        resp.json().await.map_err(|e| ApiError::Body { method: Method::POST, url, source: e.without_url() })
    }

    /// `GET /v1/separations/{id}`.
    pub async fn view(&self, id: &JobId) -> Result<JobView, ApiError> {
        self.call(Method::GET, &format!("/v1/separations/{id}"), None).await
    }

    /// `GET /v1/separations/{id}/stems/{stem}` into `dest` (written whole, then moved
    /// into place); returns the bytes written.
    pub async fn download(&self, id: &JobId, stem: &str, dest: &Path) -> Result<u64, ApiError> {
        let url = self.url(&format!("/v1/separations/{id}/stems/{stem}"));
        let resp = self.send(Method::GET, &url, self.request(Method::GET, &url)).await?;
        let tmp = dest.with_extension("part");
        let io = |source| ApiError::File { path: tmp.clone(), source };
        let mut f = tokio::fs::File::create(&tmp).await.map_err(io)?;
        let mut body = resp.bytes_stream();
        let mut bytes = 0u64;
        while let Some(chunk) = body.next().await {
            let chunk =
                chunk.map_err(|e| ApiError::Body { method: Method::GET, url: url.clone(), source: e.without_url() })?;
            f.write_all(&chunk).await.map_err(io)?;
            bytes += chunk.len() as u64;
        }
        f.flush().await.map_err(io)?;
        drop(f);
        tokio::fs::rename(&tmp, dest).await.map_err(|source| ApiError::File { path: dest.to_path_buf(), source })?;
        Ok(bytes)
    }

    /// Polls the job's view with a progress bar until it ends; returns the final view.
    pub async fn watch(&self, id: &JobId) -> Result<JobView, ApiError> {
        let bar = JobBar::new();
        loop {
            let v = self.view(id).await?;
            if bar.show(&v) {
                return Ok(v);
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

/// `stemq submit --api`: upload (a local file), submit, and with `--wait` follow the job
/// and download its stems into `-o DIR`.
pub async fn submit(api: &Api, a: SubmitArgs) -> Result<()> {
    let uri = if a.input_is_uri() { a.input.clone() } else { api.upload(Path::new(&a.input)).await?.audio_uri };
    let resp: SubmitResponse = api.call(Method::POST, "/v1/separations", Some(&a.request(&uri))).await?;
    println!("{}", serde_json::to_string_pretty(&resp)?);
    if !a.wait {
        return Ok(());
    }
    let id = &resp.job_id;
    let view = api.watch(id).await?;
    if view.status != JobStatus::Succeeded {
        bail!("job ended {}", view.status.as_str());
    }
    if let Some(dir) = &a.output_dir {
        tokio::fs::create_dir_all(dir).await.map_err(|source| ApiError::File { path: dir.clone(), source })?;
        for o in &view.outputs {
            let ext = o.uri.rsplit_once('.').map(|(_, e)| e).filter(|e| !e.contains('/')).unwrap_or("bin");
            let dest = dir.join(format!("{}.{ext}", o.stem));
            let bytes = api.download(id, &o.stem, &dest).await?;
            if bytes != o.bytes {
                bail!("{}: got {bytes} bytes, the job recorded {}", dest.display(), o.bytes);
            }
            println!("{:<12} {}", o.stem, dest.display());
        }
    }
    Ok(())
}

/// `stemq status --api`.
pub async fn status(api: &Api, id: &JobId) -> Result<()> {
    let v = api.view(id).await?;
    println!("{}", serde_json::to_string_pretty(&v)?);
    Ok(())
}

/// `stemq list --api` (and `stemq dlq list --api`).
pub async fn list(api: &Api, status: Option<JobStatus>, limit: usize) -> Result<()> {
    let mut path = format!("/v1/separations?limit={limit}");
    if let Some(s) = status {
        path.push_str(&format!("&status={}", s.as_str()));
    }
    let page: Value = api.call(Method::GET, &path, None).await?;
    let jobs: Vec<JobView> = serde_json::from_value(page["jobs"].clone())?;
    print_list_header();
    for v in &jobs {
        print_list_row(v);
    }
    Ok(())
}

/// `stemq watch --api`.
pub async fn watch(api: &Api, id: &JobId) -> Result<()> {
    api.watch(id).await?;
    Ok(())
}

/// `stemq cancel --api`.
pub async fn cancel(api: &Api, id: &JobId) -> Result<()> {
    let resp: Value = api.call(Method::POST, &format!("/v1/separations/{id}/cancel"), None).await?;
    match resp["status"].as_str() {
        Some("cancelling") => println!("{id} is running; its worker stops it within about a second"),
        _ if resp["outcome"] == "already_cancelled" => println!("{id} was already cancelled"),
        _ => println!("{id} cancelled"),
    }
    Ok(())
}

/// `stemq retry --api` (and `stemq dlq replay --api`).
pub async fn retry(api: &Api, id: &JobId) -> Result<()> {
    let resp: SubmitResponse = api.call(Method::POST, &format!("/v1/separations/{id}/retry"), None).await?;
    if resp.cached {
        println!("{id} was already retried as {}", resp.job_id);
    } else {
        println!("retrying {id} as {}", resp.job_id);
    }
    Ok(())
}
