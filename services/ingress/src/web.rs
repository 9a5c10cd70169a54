//! The page for people: `GET /` and its static assets, embedded in the binary.
//!
//! This module owns how the page is served, not what it does (that is the plain
//! JavaScript modules under `services/ingress/web/`, which call the same API as every
//! other client). The assets are compiled in with `include_str!`, so a release binary
//! serves the page with nothing beside it and nothing to build. Every asset goes out
//! with a strict Content-Security-Policy (own origin only; no inline script or style;
//! `blob:` media for the stem players), `nosniff`, no referrer, and no framing; the page
//! makes no third-party request.
//!
//! The routes are public: the page holds no data. It asks for an API key, keeps it in
//! the tab's session storage and sends it as `Authorization: Bearer` (never in a URL).

use crate::rejection::Path;
use crate::ErrorCode;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

/// The page's Content-Security-Policy.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
                       media-src 'self' blob:; connect-src 'self'; form-action 'self'; base-uri 'none'; \
                       frame-ancestors 'none'";

/// One embedded file: its name under `/app/`, media type and text.
struct Asset {
    name: &'static str,
    mime: &'static str,
    body: &'static str,
}

macro_rules! asset {
    ($name:literal, $mime:literal) => {
        Asset { name: $name, mime: $mime, body: include_str!(concat!("../web/", $name)) }
    };
}

const INDEX: &str = include_str!("../web/index.html");

const ASSETS: &[Asset] = &[
    asset!("app.js", "text/javascript; charset=utf-8"),
    asset!("api.js", "text/javascript; charset=utf-8"),
    asset!("player.js", "text/javascript; charset=utf-8"),
    asset!("zip.js", "text/javascript; charset=utf-8"),
    asset!("ops.js", "text/javascript; charset=utf-8"),
    asset!("words.js", "text/javascript; charset=utf-8"),
    asset!("dom.js", "text/javascript; charset=utf-8"),
    asset!("style.css", "text/css; charset=utf-8"),
    asset!("icon.svg", "image/svg+xml"),
];

fn serve(mime: &'static str, body: &'static str) -> Response {
    let mut resp = (StatusCode::OK, body).into_response();
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(mime));
    secure(h);
    // Small files that change with the binary: revalidate, never serve stale.
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

/// The headers every page response carries.
pub fn secure(h: &mut axum::http::HeaderMap) {
    h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
}

/// `GET /`.
pub async fn index() -> Response {
    serve("text/html; charset=utf-8", INDEX)
}

/// `GET /favicon.ico`: the icon (browsers ask for it whatever the page links).
pub async fn favicon() -> Response {
    asset("icon.svg").unwrap_or_else(|| StatusCode::NOT_FOUND.into_response())
}

fn asset(name: &str) -> Option<Response> {
    ASSETS.iter().find(|a| a.name == name).map(|a| serve(a.mime, a.body))
}

/// The path of `GET /app/{file}`.
#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
pub struct FilePath {
    /// One of the page's files (any other name is 404).
    #[schemars(schema_with = "asset_names")]
    pub file: String,
}

/// The schema of [`FilePath::file`]: the names of the embedded assets.
fn asset_names(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let names: Vec<&str> = ASSETS.iter().map(|a| a.name).collect();
    schemars::json_schema!({"type": "string", "enum": names})
}

/// The page's files, as (name, media type): what `GET /app/{file}` serves.
pub fn assets() -> impl Iterator<Item = (&'static str, &'static str)> {
    ASSETS.iter().map(|a| (a.name, a.mime))
}

/// `GET /app/{file}`.
pub async fn file(Path(FilePath { file: name }): Path<FilePath>) -> Response {
    asset(&name).unwrap_or_else(|| {
        crate::ApiError { code: ErrorCode::NotFound, message: format!("no page asset `{name}`"), field: None }
            .into_response()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_module_the_page_imports_is_served() {
        // A module the page imports but the binary does not carry would 404 only in a
        // browser: find every `./x.js` import in the embedded scripts and the page.
        let mut texts: Vec<&str> = ASSETS.iter().map(|a| a.body).collect();
        texts.push(INDEX);
        for text in texts {
            for part in text.split("\"./").chain(text.split("'./")).skip(1) {
                let name = part.split(['"', '\'']).next().unwrap_or_default();
                if name.ends_with(".js") {
                    assert!(asset(name).is_some(), "`{name}` is imported but not embedded");
                }
            }
            for part in text.split("/app/").skip(1) {
                let name = part.split(['"', '\'', ')']).next().unwrap_or_default();
                assert!(asset(name).is_some(), "`/app/{name}` is linked but not embedded");
            }
        }
    }

    #[test]
    fn the_page_has_no_inline_script_or_style_and_no_other_origin() {
        for a in ASSETS.iter().map(|a| a.body).chain([INDEX]) {
            let a = a.replace("http://www.w3.org/2000/svg", "");
            assert!(!a.contains("<script>") && !a.contains("style=\"") && !a.contains("onclick="));
            assert!(!a.contains("http://") && !a.contains("https://"), "a third-party address in an asset");
        }
    }
}
