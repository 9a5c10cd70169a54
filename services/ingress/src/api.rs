//! The route table: every operation of the HTTP API, next to the handler that serves it.
//!
//! This module owns *what* the API serves. Each [`Route`] is an [`Operation`] (method,
//! path, `operationId`, parameters, body and answers, by the handler's own Rust types;
//! described in [`crate::openapi::operations`]) and its handler; [`crate::router()`]
//! routes exactly these, and `/openapi.json` is generated from exactly these
//! ([`crate::openapi`]), so the two cannot disagree. Who may call each route is decided
//! by [`crate::access::permission`], which the document reads too.
//!
//! `operationId`s are camelCase and stable: generated clients name their functions
//! after them (docs/api.md lists them). A test checks they are unique, and that every
//! path parameter is documented.

use axum::handler::Handler;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodFilter, MethodRouter};

// One description per route: the table below reads as method, path and handler.
use crate::openapi::operations::*;
use crate::openapi::Operation;
use crate::AppState;

/// One route: its description and its handler.
pub struct Route {
    /// What `/openapi.json` says of it.
    pub op: Operation,
    /// What serves it (for `op.method` only).
    pub handler: MethodRouter<AppState>,
}

/// `op`, served by `handler`.
fn serve<H, T>(op: Operation, handler: H) -> Route
where
    H: Handler<T, AppState>,
    T: 'static,
{
    let filter = MethodFilter::try_from(op.method.clone()).expect("a method axum routes");
    Route { handler: axum::routing::on(filter, handler), op }
}

/// Every route the ingress serves, in the order `/openapi.json` lists them.
pub fn routes() -> Vec<Route> {
    vec![
        serve(separations_create(), crate::separations::create),
        serve(separations_list(), crate::separations::list),
        serve(separations_get(), crate::separations::status),
        serve(separations_cancel(), crate::control::cancel_http),
        serve(separations_retry(), crate::control::retry_http),
        serve(separations_events(), crate::events::sse),
        serve(stems_get(), crate::stems::download),
        serve(batches_create(), crate::batches::create),
        serve(batches_get(), crate::batches::status),
        serve(uploads_create(), crate::uploads::upload),
        serve(deliveries_list(), crate::webhooks::list),
        serve(deliveries_replay(), crate::webhooks::replay),
        serve(webhook_secret_get(), crate::webhooks::get_secret),
        serve(webhook_secret_rotate(), crate::webhooks::rotate_secret),
        serve(webhook_enable(), crate::webhooks::enable),
        serve(models_list(), crate::workers::models),
        serve(me_get(), crate::session::me),
        serve(account_get(), crate::credits::account),
        serve(signin(), crate::session::signin),
        serve(workers_list(), crate::workers::list),
        serve(overview_get(), crate::workers::overview),
        serve(metrics_get(), crate::ops::metrics_text),
        serve(health_get(), crate::ops::healthz),
        serve(ready_get(), crate::ops::ready),
        serve(openapi_get(), openapi_json),
        serve(asyncapi_get(), asyncapi_json),
        serve(page_get(), crate::web::index),
        serve(page_file(), crate::web::file),
        serve(favicon_get(), crate::web::favicon),
    ]
}

/// `GET /openapi.json`: the document of [`routes`], made once.
async fn openapi_json() -> Response {
    static DOC: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    let body = DOC.get_or_init(|| serde_json::to_vec(&crate::openapi::document()).expect("the document serialises"));
    ([(header::CONTENT_TYPE, "application/json")], axum::body::Bytes::from_static(body)).into_response()
}

/// `GET /asyncapi.json`: the NATS side's AsyncAPI document
/// ([`crate::asyncapi::document`]), made once.
async fn asyncapi_json() -> Response {
    static DOC: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    let body = DOC.get_or_init(|| serde_json::to_vec(&crate::asyncapi::document()).expect("the document serialises"));
    ([(header::CONTENT_TYPE, "application/json")], axum::body::Bytes::from_static(body)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operation_ids_are_unique_camel_case_and_routes_are_distinct() {
        let routes = routes();
        let mut ids = std::collections::BTreeSet::new();
        let mut routes_seen = std::collections::BTreeSet::new();
        for r in &routes {
            let id = r.op.id;
            assert!(ids.insert(id), "operationId {id} twice");
            assert!(id.chars().next().is_some_and(|c| c.is_ascii_lowercase()), "{id}");
            assert!(id.chars().all(|c| c.is_ascii_alphanumeric()), "{id} is not camelCase");
            assert!(routes_seen.insert((r.op.method.to_string(), r.op.path)), "{} {} twice", r.op.method, r.op.path);
        }
    }

    #[test]
    fn every_path_parameter_is_documented_and_every_documented_one_is_in_the_path() {
        for r in routes() {
            let in_path: Vec<String> =
                r.op.path
                    .split('/')
                    .filter_map(|s| s.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
                    .map(str::to_string)
                    .collect();
            let mut documented = r.op.param_names("path");
            documented.sort();
            let mut expected = in_path.clone();
            expected.sort();
            assert_eq!(documented, expected, "{} {}", r.op.method, r.op.path);
        }
    }
}
