//! Access control over HTTP and the NATS submit path, tried as an attacker would: no
//! key, a bad key, a key in the URL, the wrong role, another owner's jobs, another
//! owner's uploads, a revoked key, and floods against the per-key limits — across two
//! ingress replicas sharing one nats-server.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::{json, Value};
use stemq_accounts::auth::{self, Limits, Role};
use stemq_core::JobStatus;
use stemq_nats as names;
use stemq_tests::{job_body, job_id, Stack, StackOptions};
use tokio_util::sync::CancellationToken;

const T: Duration = Duration::from_secs(30);

/// A key of `owner` with `role` (and generous limits unless given).
async fn key(stack: &Stack, owner: &str, role: Role, limits: Option<Limits>) -> String {
    let limits = limits.unwrap_or(Limits::NONE);
    auth::create(&stack.keys, owner, role, limits, "test").await.expect("key").0.expose()
}

/// One HTTP call with an optional bearer key: (status, headers, JSON body or Null).
async fn call(
    base: &str,
    method: Method,
    path: &str,
    key: Option<&str>,
    body: Option<&Value>,
) -> (u16, reqwest::header::HeaderMap, Value) {
    let mut r = reqwest::Client::new().request(method, format!("{base}{path}"));
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    if let Some(b) = body {
        r = r.json(b);
    }
    let resp = r.send().await.expect("http");
    let (status, headers) = (resp.status().as_u16(), resp.headers().clone());
    (status, headers, resp.json().await.unwrap_or(Value::Null))
}

/// A request body for `owner`'s upload `name`.
fn body_of(stack: &Stack, owner: &str, name: &str) -> Value {
    json!({"audio_uri": stack.store.uri(&format!("uploads/{owner}/{name}.wav")), "model": "dsp",
           "metadata": {"fake": {"sleep_ms": 0}}})
}

/// A second ingress replica on the stack's NATS; stopped with the token.
async fn second_ingress(stack: &Stack, stop: &CancellationToken) -> String {
    let listener = stemq_ingress::bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    let c = stack.connect_as(stemq_nats::users::INGRESS).await;
    let config = stemq_ingress::Config {
        listen: addr,
        nats_submit: true,
        storage: Some(stemq_ingress::uploads::StorageConfig::new(stack.store.clone())),
        auth: true,
        tls: None,
        audio_urls: None,
        queue_metrics: false,
        refuse_unserved: false,
        signin: None,
        public_url: None,
        cors_origins: Vec::new(),
        readiness: Default::default(),
        http_timeouts: Default::default(),
    };
    let s = stop.clone();
    tokio::spawn(async move { stemq_ingress::run(c, listener, config, s).await.expect("ingress 2 runs") });
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_route_needs_a_valid_key_and_the_right_role() {
    let stack = Stack::start(StackOptions::default()).await;
    let base = stack.url("");
    let (code, _, v) =
        call(&base, Method::POST, "/v1/separations", Some(&stack.key), Some(&job_body(&stack, "a", None))).await;
    assert_eq!(code, 202, "{v}");
    let id = v["job_id"].as_str().unwrap().to_string();
    let routes: Vec<(Method, String)> = vec![
        (Method::POST, "/v1/separations".into()),
        (Method::GET, "/v1/separations".into()),
        (Method::GET, format!("/v1/separations/{id}")),
        (Method::GET, format!("/v1/separations/{id}/stems/vocals")),
        (Method::POST, "/v1/uploads".into()),
        (Method::POST, format!("/v1/separations/{id}/cancel")),
        (Method::POST, format!("/v1/separations/{id}/retry")),
        (Method::GET, format!("/v1/separations/{id}/events")),
        (Method::GET, format!("/v1/separations/{id}/deliveries")),
        (Method::POST, format!("/v1/separations/{id}/deliveries/1/replay")),
        (Method::GET, "/v1/webhooks/secret".into()),
        (Method::POST, "/v1/webhooks/secret/rotate".into()),
        (Method::POST, "/v1/webhooks/enable".into()),
        (Method::GET, "/metrics".into()),
        (Method::GET, "/v1/workers".into()),
        (Method::GET, "/v1/overview".into()),
        (Method::GET, "/v1/models".into()),
        (Method::GET, "/v1/me".into()),
        (Method::GET, "/v1/no-such-route".into()),
    ];
    let revoked = key(&stack, "acme", Role::Admin, None).await;
    auth::revoke(&stack.keys, &revoked).await.unwrap();
    let malformed = "sk_0123_nothex";
    // The operator's key with its last hex digit changed (to one it is not: a fixed `0`
    // left the key intact, and valid, once in 16 runs).
    let (head, last) = stack.key.split_at(stack.key.len() - 1);
    let forged = format!("{head}{}", if last == "0" { "1" } else { "0" });
    for (m, path) in &routes {
        let (code, h, body) = call(&base, m.clone(), path, None, None).await;
        assert_eq!(code, 401, "{m} {path} without a key: {body}");
        assert!(h["www-authenticate"].to_str().unwrap().starts_with("Bearer"), "{m} {path}");
        assert_eq!(body["error"]["code"], "unauthorized");
        for bad in [malformed, forged.as_str(), revoked.as_str()] {
            let (code, h, _) = call(&base, m.clone(), path, Some(bad), None).await;
            assert_eq!(code, 401, "{m} {path} with a bad key");
            assert!(h["www-authenticate"].to_str().unwrap().contains("invalid_token"));
        }
    }
    // The public routes.
    for path in ["/healthz", "/readyz", "/openapi.json", "/asyncapi.json"] {
        assert_eq!(call(&base, Method::GET, path, None, None).await.0, 200, "{path}");
    }
    // The page: public (it holds no data), under a strict CSP; nothing else is public
    // under /app/, and no path escapes it.
    for path in ["/", "/app/app.js", "/app/style.css", "/favicon.ico"] {
        let resp = reqwest::get(format!("{base}{path}")).await.unwrap();
        assert_eq!(resp.status(), 200, "{path}");
        let csp = resp.headers()["content-security-policy"].to_str().unwrap().to_string();
        assert!(csp.contains("default-src 'none'") && csp.contains("script-src 'self'"), "{path}: {csp}");
        assert_eq!(resp.headers()["x-content-type-options"], "nosniff", "{path}");
    }
    for path in ["/app/nope.js", "/app/..%2Fadmin.key", "/app/Cargo.toml", "/app/index.html"] {
        let (code, _, body) = call(&base, Method::GET, path, None, None).await;
        assert_eq!((code, body["error"]["code"].as_str()), (404, Some("not_found")), "{path}: {body}");
    }
    // Sign-in links: public, but only where one is configured (`stemq dev`), and never
    // for a wrong token.
    let (code, _, body) = call(&base, Method::POST, "/v1/signin", None, Some(&json!({"token": "00"}))).await;
    assert_eq!(code, 404, "{body}");
    assert!(body.get("key").is_none());
    // The document says so: the scheme, and 401/403 on every operation but the public ones.
    let (_, _, doc) = call(&base, Method::GET, "/openapi.json", None, None).await;
    assert_eq!(doc["components"]["securitySchemes"]["bearerAuth"]["scheme"], "bearer");
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            let public = [
                "/healthz",
                "/readyz",
                "/openapi.json",
                "/asyncapi.json",
                "/v1/signin",
                "/",
                "/app/{file}",
                "/favicon.ico",
            ]
            .contains(&path.as_str());
            assert_eq!(op["security"] == json!([]), public, "{method} {path}");
            // A sign-in link's 401 is its own (a wrong or used token), not a key's.
            let own_401 = path == "/v1/signin";
            assert_eq!(op["responses"].get("401").is_some(), !public || own_401, "{method} {path}");
            assert_eq!(op.get("x-stemq-roles").is_some(), !public, "{method} {path}");
        }
    }
    // Every documented operation that needs a key refuses a call without one (401) and a
    // key whose role it does not allow (403): the document and the access table agree.
    let reader = key(&stack, "acme", Role::Read, None).await;
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            if op["security"] == json!([]) {
                continue;
            }
            let concrete = path.replace("{id}", &id).replace("{stem}", "vocals").replace("{n}", "1");
            let m: Method = method.to_uppercase().parse().unwrap();
            let (code, _, body) = call(&base, m.clone(), &concrete, None, None).await;
            assert_eq!((code, body["error"]["code"].as_str()), (401, Some("unauthorized")), "{method} {path}");
            if op["x-stemq-roles"] != "any role" {
                let (code, _, body) = call(&base, m, &concrete, Some(&reader), None).await;
                assert_eq!((code, body["error"]["code"].as_str()), (403, Some("forbidden")), "{method} {path}");
            }
        }
    }
    // A key in the URL is refused, even with a good header.
    for q in [format!("?api_key={}", stack.key), format!("?x={}", stack.key), "?token=abc".into()] {
        let (code, _, v) = call(&base, Method::GET, &format!("/v1/separations{q}"), Some(&stack.key), None).await;
        assert_eq!((code, v["error"]["code"].as_str()), (400, Some("key_in_query")), "{q}");
    }
    // Roles.
    let read = key(&stack, "acme", Role::Read, None).await;
    let submit = key(&stack, "acme", Role::Submit, None).await;
    let admin = key(&stack, "acme", Role::Admin, None).await;
    let forbidden = |code: u16| code == 403;
    let acme_body = body_of(&stack, "acme", "r");
    assert!(forbidden(call(&base, Method::POST, "/v1/separations", Some(&read), Some(&acme_body)).await.0));
    assert!(forbidden(call(&base, Method::POST, "/v1/uploads", Some(&read), None).await.0));
    assert_eq!(call(&base, Method::GET, "/v1/separations", Some(&read), None).await.0, 200);
    for k in [&read, &submit] {
        assert!(forbidden(call(&base, Method::GET, "/v1/webhooks/secret", Some(k), None).await.0));
        assert!(forbidden(call(&base, Method::POST, "/v1/webhooks/secret/rotate", Some(k), None).await.0));
    }
    // The operators' routes: /metrics, and the fleet (every owner's workload and the
    // workers' names, devices and memory) — 403 for any role of an owner, admin included.
    for k in [&read, &submit, &admin] {
        assert!(forbidden(call(&base, Method::GET, "/metrics", Some(k), None).await.0));
        let (code, _, body) = call(&base, Method::GET, "/v1/workers", Some(k), None).await;
        assert!(forbidden(code), "GET /v1/workers with a non-operator key: {code} {body}");
        assert!(body.get("workers").is_none() && body.get("pools").is_none(), "{body}");
        let (code, _, body) = call(&base, Method::GET, "/v1/overview", Some(k), None).await;
        assert!(forbidden(code), "GET /v1/overview with a non-operator key: {code} {body}");
        assert!(body.get("counts").is_none(), "{body}");
    }
    // Any key may see the models and who it is, and nothing of other owners.
    let (code, _, models) = call(&base, Method::GET, "/v1/models", Some(&read), None).await;
    assert_eq!(code, 200, "{models}");
    assert!(models["models"].as_array().unwrap().iter().any(|m| m["name"] == "dsp"), "{models}");
    assert!(models.get("workers").is_none() && !models.to_string().contains("\"devices\""), "{models}");
    let (_, _, me) = call(&base, Method::GET, "/v1/me", Some(&read), None).await;
    assert_eq!((me["owner"].as_str(), me["role"].as_str()), (Some("acme"), Some("read")), "{me}");
    assert_eq!((me["can"]["read"].as_bool(), me["can"]["write"].as_bool()), (Some(true), Some(false)), "{me}");
    assert_eq!(me["can"]["operate"], false, "{me}");
    assert_eq!(call(&base, Method::POST, "/v1/separations", Some(&submit), Some(&acme_body)).await.0, 202);
    assert_eq!(call(&base, Method::GET, "/v1/webhooks/secret", Some(&admin), None).await.0, 200);
    assert_eq!(call(&base, Method::GET, "/metrics", Some(&stack.key), None).await.0, 200);
    let operator = key(&stack, "ops", Role::Operator, None).await;
    let (code, _, fleet) = call(&base, Method::GET, "/v1/workers", Some(&operator), None).await;
    assert_eq!(code, 200, "{fleet}");
    assert!(fleet["workers"].is_array() && fleet["pools"].is_array(), "{fleet}");
    let (code, _, overview) = call(&base, Method::GET, "/v1/overview", Some(&operator), None).await;
    assert_eq!(code, 200, "{overview}");
    assert_eq!(overview["throughput"].as_array().map(Vec::len), Some(15), "{overview}");
    assert!(overview["counts"].is_object(), "{overview}");

    // Revocation takes effect within seconds (the ring re-reads records every 2 s).
    assert_eq!(call(&base, Method::GET, "/v1/separations", Some(&submit), None).await.0, 200);
    auth::revoke(&stack.keys, &submit).await.unwrap();
    let t0 = Instant::now();
    while call(&base, Method::GET, "/v1/separations", Some(&submit), None).await.0 != 401 {
        assert!(t0.elapsed() < Duration::from_secs(5), "revocation not seen after 5 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!("revocation took effect after {:?}", t0.elapsed());
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn owners_never_see_or_touch_each_others_jobs() {
    // The receiver below is on loopback (the ingress reads this at each submit).
    std::env::set_var("STEMQ_WEBHOOK_ALLOW", "127.0.0.1");
    let mut stack = Stack::start(StackOptions { workers: 1, ..Default::default() }).await;
    stack
        .start_relay(stemq_relay::Config { allow: stemq_webhook::Allowlist::parse("127.0.0.1"), ..Default::default() })
        .await;
    let base = stack.url("");
    let alice = key(&stack, "alice", Role::Admin, None).await;
    let bob = key(&stack, "bob", Role::Admin, None).await;
    let operator = stack.key.clone();

    // Alice uploads and submits (with a webhook, so there is a delivery).
    let (code, _, up) = call(&base, Method::POST, "/v1/uploads?filename=a.wav", Some(&alice), None).await;
    assert_eq!(code, 422, "an empty upload is refused: {up}");
    let resp = reqwest::Client::new()
        .post(format!("{base}/v1/uploads?filename=a.wav"))
        .bearer_auth(&alice)
        .body(vec![1u8; 64])
        .send()
        .await
        .unwrap();
    let up: Value = resp.json().await.unwrap();
    let alice_uri = up["audio_uri"].as_str().unwrap().to_string();
    assert!(alice_uri.starts_with("upload:"), "an opaque name, no server path: {alice_uri}");
    let hook = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hook_url = format!("http://{}/hook", hook.local_addr().unwrap());
    tokio::spawn(async move {
        let app = axum::Router::new().route("/hook", axum::routing::post(|| async { "ok" }));
        axum::serve(hook, app).await.unwrap();
    });
    let body = json!({"audio_uri": alice_uri, "model": "dsp", "webhook": {"url": hook_url}});
    let (code, _, v) = call(&base, Method::POST, "/v1/separations", Some(&alice), Some(&body)).await;
    assert_eq!(code, 202, "{v}");
    let id = job_id(&v);
    let view = stack.wait_terminal(&id, T).await;
    assert_eq!(view.status, JobStatus::Succeeded);
    assert_eq!(view.request.as_ref().unwrap().owner, "alice", "the owner comes from the key");
    assert!(view.request.as_ref().unwrap().audio_uri.contains("/uploads/alice/"), "her upload, in the store");

    // The owner in a body is ignored: Bob cannot submit as Alice.
    let mut as_alice = body.clone();
    as_alice["owner"] = json!("alice");
    let (code, _, v) = call(&base, Method::POST, "/v1/separations", Some(&bob), Some(&as_alice)).await;
    assert_eq!(code, 422, "an `owner` field is not part of a request: {v}");

    // Bob: every route of Alice's job is a 404, exactly like a job that does not exist.
    let missing = "0".repeat(64);
    for (m, path) in [
        (Method::GET, "/v1/separations/{}"),
        (Method::GET, "/v1/separations/{}/stems/vocals"),
        (Method::GET, "/v1/separations/{}/events"),
        (Method::GET, "/v1/separations/{}/deliveries"),
        (Method::POST, "/v1/separations/{}/deliveries/1/replay"),
        (Method::POST, "/v1/separations/{}/cancel"),
        (Method::POST, "/v1/separations/{}/retry"),
    ] {
        let theirs = call(&base, m.clone(), &path.replace("{}", id.as_str()), Some(&bob), None).await;
        let nobody = call(&base, m.clone(), &path.replace("{}", &missing), Some(&bob), None).await;
        assert_eq!(theirs.0, 404, "{m} {path}: {}", theirs.2);
        assert_eq!(theirs.2["error"]["code"], nobody.2["error"]["code"], "{m} {path}");
        assert_eq!(
            theirs.2["error"]["message"].as_str().unwrap().replace(id.as_str(), "ID"),
            nobody.2["error"]["message"].as_str().unwrap().replace(&missing, "ID"),
            "{m} {path}: the answers must not tell the two apart"
        );
    }
    // Alice sees it, on every read route.
    assert_eq!(call(&base, Method::GET, &format!("/v1/separations/{id}"), Some(&alice), None).await.0, 200);
    assert_eq!(
        call(&base, Method::GET, &format!("/v1/separations/{id}/stems/vocals"), Some(&alice), None).await.0,
        200
    );
    // Lists: each owner sees only its jobs; the operator sees both.
    let (_, _, v) = call(&base, Method::POST, "/v1/separations", Some(&bob), Some(&body_of(&stack, "bob", "b"))).await;
    let bob_id = job_id(&v);
    stack.wait_terminal(&bob_id, T).await;
    let ids = |v: &Value| -> Vec<String> {
        v["jobs"].as_array().unwrap().iter().map(|j| j["job_id"].as_str().unwrap().to_string()).collect()
    };
    let (_, _, a) = call(&base, Method::GET, "/v1/separations", Some(&alice), None).await;
    let (_, _, b) = call(&base, Method::GET, "/v1/separations", Some(&bob), None).await;
    let (_, _, o) = call(&base, Method::GET, "/v1/separations", Some(&operator), None).await;
    assert_eq!(ids(&a), vec![id.to_string()]);
    assert_eq!(ids(&b), vec![bob_id.to_string()]);
    assert!(ids(&o).contains(&id.to_string()) && ids(&o).contains(&bob_id.to_string()));
    assert_eq!(call(&base, Method::GET, &format!("/v1/separations/{id}"), Some(&operator), None).await.0, 200);

    // Bob may not read Alice's upload (by its name or its store URI) or Alice's stems as
    // input: her upload's name is no upload of his.
    let stolen_upload = json!({"audio_uri": alice_uri, "model": "dsp"});
    let stolen_uri = json!({"audio_uri": view.request.as_ref().unwrap().audio_uri, "model": "dsp"});
    let stem_uri = view.outputs[0].uri.clone();
    for b in [stolen_upload, stolen_uri, json!({"audio_uri": stem_uri, "model": "dsp"})] {
        let (code, _, v) = call(&base, Method::POST, "/v1/separations", Some(&bob), Some(&b)).await;
        assert_eq!((code, v["error"]["field"].as_str()), (422, Some("audio_uri")), "{b}: {v}");
    }
    // Webhook secrets are per owner.
    let (_, _, sa) = call(&base, Method::GET, "/v1/webhooks/secret", Some(&alice), None).await;
    let (_, _, sb) = call(&base, Method::GET, "/v1/webhooks/secret", Some(&bob), None).await;
    assert_ne!(sa["secret"], sb["secret"]);

    // Replays of one delivery are rate-limited: 3 at once, then one per 10 s.
    let replay = format!("/v1/separations/{id}/deliveries/1/replay");
    let t0 = Instant::now();
    loop {
        let (_, _, d) = call(&base, Method::GET, &format!("/v1/separations/{id}/deliveries"), Some(&alice), None).await;
        if d["deliveries"].as_array().is_some_and(|a| !a.is_empty()) {
            break;
        }
        assert!(t0.elapsed() < T, "no delivery recorded");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut codes = Vec::new();
    for _ in 0..20 {
        codes.push(call(&base, Method::POST, &replay, Some(&alice), None).await.0);
    }
    assert_eq!(codes.iter().filter(|c| **c == 202).count(), 3, "{codes:?}");
    assert_eq!(codes.iter().filter(|c| **c == 429).count(), 17, "{codes:?}");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_nats_submit_path_obeys_the_same_rules() {
    let stack = Stack::start(StackOptions::default()).await;
    let submit = key(&stack, "acme", Role::Submit, None).await;
    let read = key(&stack, "acme", Role::Read, None).await;
    let ask = |k: Option<String>, body: Value| {
        let client = stack.client.clone();
        async move {
            let mut h = async_nats::HeaderMap::new();
            if let Some(k) = k {
                h.insert("Authorization", format!("Bearer {k}").as_str());
            }
            let m = client
                .request_with_headers(names::SUBMIT_SUBJECT, h, serde_json::to_vec(&body).unwrap().into())
                .await
                .expect("reply");
            serde_json::from_slice::<Value>(&m.payload).unwrap()
        }
    };
    let body = body_of(&stack, "acme", "n");
    assert_eq!(ask(None, body.clone()).await["http_status"], 401);
    assert_eq!(ask(Some("sk_x".into()), body.clone()).await["http_status"], 401);
    assert_eq!(ask(Some(read), body.clone()).await["http_status"], 403);
    // The owner comes from the key: acme may not use another owner's upload.
    let theirs = body_of(&stack, "other", "n");
    assert_eq!(ask(Some(submit.clone()), theirs).await["http_status"], 422);
    let ok = ask(Some(submit.clone()), body).await;
    assert_eq!(ok["http_status"], 202, "{ok}");
    let v = stack.wait_terminal(&job_id(&ok), T).await;
    assert_eq!(v.request.unwrap().owner, "acme");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn limits_hold_across_two_ingress_replicas() {
    // No workers: every admitted job stays queued.
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let stop = CancellationToken::new();
    let bases = [stack.url(""), second_ingress(&stack, &stop).await];
    let jobs_before = stack.count_on("stemq.jobs.*.requested.>").await;

    // The rate: burst 4, then 1 per 10 s, spent alternately on the two replicas.
    let k = key(&stack, "flood", Role::Submit, Some(Limits { rate: 0.1, burst: 4, max_in_flight: 1000 })).await;
    let mut codes = Vec::new();
    let mut limited = None;
    for i in 0..10 {
        let (code, h, v) = call(
            &bases[i % 2],
            Method::POST,
            "/v1/separations",
            Some(&k),
            Some(&body_of(&stack, "flood", &format!("r{i}"))),
        )
        .await;
        codes.push(code);
        if code == 429 && limited.is_none() {
            limited = Some((h, v));
        }
    }
    assert_eq!(codes.iter().filter(|c| **c == 202).count(), 4, "{codes:?}");
    let (h, v) = limited.expect("a refusal");
    assert_eq!(v["error"]["code"], "rate_limited");
    let retry: u64 = h["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=10).contains(&retry), "{retry}");
    assert_eq!(h["ratelimit-policy"].to_str().unwrap(), "\"rate\";q=4;w=40");
    assert!(h["ratelimit"].to_str().unwrap().starts_with("\"rate\";r=0;t="));

    // The cap: 3 jobs in flight, however the submits are spread.
    let k = key(&stack, "capped", Role::Submit, Some(Limits { rate: 0.0, burst: 0, max_in_flight: 3 })).await;
    let mut codes = Vec::new();
    for i in 0..10 {
        let (code, _, v) = call(
            &bases[i % 2],
            Method::POST,
            "/v1/separations",
            Some(&k),
            Some(&body_of(&stack, "capped", &format!("c{i}"))),
        )
        .await;
        if code == 429 {
            assert_eq!(v["error"]["code"], "too_many_in_flight");
        }
        codes.push(code);
    }
    assert_eq!(codes.iter().filter(|c| **c == 202).count(), 3, "{codes:?}");
    // Resubmitting an admitted job is not a new job: it is answered, not refused.
    let (code, _, _) =
        call(&bases[1], Method::POST, "/v1/separations", Some(&k), Some(&body_of(&stack, "capped", "c0"))).await;
    assert_eq!(code, 200);
    // Nothing refused reached the log: 4 + 3 requests, no more.
    let published = stack.count_on("stemq.jobs.*.requested.>").await - jobs_before;
    assert_eq!(published, 7);
    stop.cancel();
    stack.shutdown().await;
}

/// Submits of one key that arrive at once on two replicas (each replica settles its
/// concurrent checks in batches) still get exactly the burst, and exactly the cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn limits_hold_when_submits_arrive_at_once_on_two_replicas() {
    const AT_ONCE: usize = 64;
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let stop = CancellationToken::new();
    let bases = [stack.url(""), second_ingress(&stack, &stop).await];
    let jobs_before = stack.count_on("stemq.jobs.*.requested.>").await;
    let flood = |k: String, owner: &'static str, tag: &'static str| {
        let calls = (0..AT_ONCE).map(|i| {
            let (base, k, body) = (bases[i % 2].clone(), k.clone(), body_of(&stack, owner, &format!("{tag}{i}")));
            async move { call(&base, Method::POST, "/v1/separations", Some(&k), Some(&body)).await }
        });
        futures::future::join_all(calls)
    };
    let count = |answers: &[(u16, reqwest::header::HeaderMap, Value)], code: u16| {
        answers.iter().filter(|a| a.0 == code).count()
    };

    let k = key(&stack, "burst", Role::Submit, Some(Limits { rate: 0.001, burst: 10, max_in_flight: 0 })).await;
    let answers = flood(k, "burst", "b").await;
    assert_eq!((count(&answers, 202), count(&answers, 429)), (10, AT_ONCE - 10), "the burst");
    assert!(answers.iter().filter(|a| a.0 == 429).all(|a| a.2["error"]["code"] == "rate_limited"));

    let k = key(&stack, "cap", Role::Submit, Some(Limits { rate: 0.0, burst: 0, max_in_flight: 7 })).await;
    let answers = flood(k, "cap", "c").await;
    assert_eq!((count(&answers, 202), count(&answers, 429)), (7, AT_ONCE - 7), "the cap");
    assert!(answers.iter().filter(|a| a.0 == 429).all(|a| a.2["error"]["code"] == "too_many_in_flight"));

    let published = stack.count_on("stemq.jobs.*.requested.>").await - jobs_before;
    assert_eq!(published, 17, "nothing refused reached the log");
    stop.cancel();
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flooding_owner_cannot_starve_another() {
    const CAP: u32 = 20;
    const FLOOD: usize = 2000;
    let stack = Stack::start(StackOptions { workers: 2, ..Default::default() }).await;
    let base = stack.url("");
    let a = key(&stack, "flooder", Role::Submit, Some(Limits { rate: 0.0, burst: 0, max_in_flight: CAP })).await;
    let b = key(&stack, "patient", Role::Submit, None).await;
    // Owner A submits 2 000 jobs (20 ms each) as fast as it can, 32 at a time.
    let t0 = Instant::now();
    let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(32));
    let mut handles = Vec::new();
    for i in 0..FLOOD {
        let permit = sem.clone().acquire_owned().await.unwrap();
        let (base, a) = (base.clone(), a.clone());
        let mut body = body_of(&stack, "flooder", &format!("f{i}"));
        body["metadata"] = json!({"fake": {"sleep_ms": 20}});
        handles.push(tokio::spawn(async move {
            let r = call(&base, Method::POST, "/v1/separations", Some(&a), Some(&body)).await;
            drop(permit);
            (r.0, r.2["job_id"].as_str().map(str::to_string))
        }));
    }
    let mut codes: HashMap<u16, usize> = HashMap::new();
    let mut accepted = Vec::new();
    for h in handles {
        let (code, id) = h.await.unwrap();
        *codes.entry(code).or_default() += 1;
        if code == 202 {
            accepted.push(id.unwrap());
        }
    }
    let flood_took = t0.elapsed();
    assert_eq!(codes.keys().filter(|c| ![202u16, 429].contains(c)).count(), 0, "{codes:?}");
    // Then owner B submits one.
    let b_submitted = chrono::Utc::now();
    let (code, _, v) =
        call(&base, Method::POST, "/v1/separations", Some(&b), Some(&body_of(&stack, "patient", "one"))).await;
    assert_eq!(code, 202);
    let b_view = stack.wait_terminal(&job_id(&v), T).await;
    let b_started = b_view.started_at.expect("B's job ran");
    let mut ahead = 0;
    let mut before_total = 0;
    for id in &accepted {
        let view = stack.wait_terminal(&stemq_core::JobId::parse(id).unwrap(), T).await;
        let started = view.started_at.unwrap();
        if started < b_started {
            before_total += 1;
            if view.created_at.unwrap() <= b_submitted && view.finished_at.unwrap() > b_submitted {
                ahead += 1;
            }
        }
    }
    println!(
        "flood: {FLOOD} submits in {flood_took:?} -> {codes:?}; {} of A's jobs accepted in all; \
         {before_total} of them started before B's job, {ahead} were still queued or running when B submitted \
         (cap {CAP}); B waited {:?} from submit to start",
        accepted.len(),
        (b_started - b_submitted).to_std().unwrap_or_default()
    );
    assert!(ahead <= CAP as usize, "{ahead} of A's jobs were ahead of B's, more than A's cap {CAP}");
    assert!(codes.get(&429).copied().unwrap_or(0) > 0, "the flood was never limited: {codes:?}");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turning_keys_off_is_for_loopback_only() {
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let config = |listen| stemq_ingress::Config {
        listen,
        nats_submit: false,
        storage: None,
        auth: false,
        tls: None,
        audio_urls: None,
        queue_metrics: false,
        refuse_unserved: false,
        signin: None,
        public_url: None,
        cors_origins: Vec::new(),
        readiness: Default::default(),
        http_timeouts: Default::default(),
    };
    // On every interface: refused at start, before serving anything.
    let listener = stemq_ingress::bind("0.0.0.0:0".parse().unwrap()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let c = stack.connect_as(stemq_nats::users::INGRESS).await;
    let err = stemq_ingress::run(c, listener, config(addr), CancellationToken::new()).await.unwrap_err();
    assert!(matches!(err, stemq_ingress::IngressError::NoAuthOnNetwork(_)), "{err}");
    assert!(err.to_string().contains("loopback"), "{err}");
    // On loopback: served, every caller an operator of `local`.
    let listener = stemq_ingress::bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let c = stack.connect_as(stemq_nats::users::INGRESS).await;
    let stop = CancellationToken::new();
    let s = stop.clone();
    tokio::spawn(async move { stemq_ingress::run(c, listener, config(addr), s).await.unwrap() });
    let (code, _, _) = call(&format!("http://{addr}"), Method::GET, "/v1/separations", None, None).await;
    assert_eq!(code, 200);
    stop.cancel();
    stack.shutdown().await;
}

/// A node restarting under the ingress must not turn away callers it has just served:
/// while the keys bucket cannot be read, a key read in the last
/// `KeyRing::STALE_IF_ERROR` authenticates from the cache, a key never read is refused
/// as unavailable (not unknown), and once the bucket answers again a revocation takes
/// effect within `KeyRing::TTL`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_read_recently_still_authenticate_while_the_bucket_is_down() {
    use async_nats::jetstream;
    use stemq_accounts::auth::{KeyError, KeyRing};
    use stemq_devkit::nats_server::NatsServer;

    let dir = tempfile::tempdir().unwrap();
    let mut server = NatsServer::start_async(dir.path().join("nats"), 0).await.expect("nats-server");
    let js = jetstream::new(server.connect_as(stemq_nats::users::OPERATOR, "test").await.unwrap());
    names::apply(&js, &names::Settings::default()).await.unwrap();
    let bucket = js.get_key_value(names::KEYS_BUCKET).await.unwrap();
    let (seen, _) = auth::create(&bucket, "acme", Role::Submit, Limits::NONE, "seen").await.unwrap();
    let (unseen, _) = auth::create(&bucket, "acme", Role::Submit, Limits::NONE, "unseen").await.unwrap();
    let ring = KeyRing::new(bucket.clone());
    assert_eq!(ring.authenticate(&seen.expose()).await.unwrap().owner, "acme");

    server.kill();
    tokio::time::sleep(KeyRing::TTL + Duration::from_millis(200)).await;
    let t = Instant::now();
    let caller = ring.authenticate(&seen.expose()).await.expect("a recently read key, from the cache");
    assert_eq!((caller.owner.as_str(), caller.role), ("acme", Role::Submit));
    let bound = 2 * KeyRing::READ_TIMEOUT + Duration::from_secs(1);
    assert!(t.elapsed() < bound, "the stale answer took {:?}", t.elapsed());
    let t = Instant::now();
    match ring.authenticate(&unseen.expose()).await {
        Err(KeyError::Store(_)) => {}
        other => panic!("a key never read, with the bucket down: {other:?}"),
    }
    assert!(t.elapsed() < bound, "the refusal took {:?}", t.elapsed());
    // Malformed keys are still refused as such, without a read.
    assert!(matches!(ring.authenticate("sk_nope").await, Err(KeyError::Malformed)));

    // Back up: a revocation is seen within the TTL (polled; the client reconnects).
    let mut server = tokio::task::spawn_blocking(move || {
        server.restart().expect("restart");
        server
    })
    .await
    .unwrap();
    let deadline = Instant::now() + T;
    loop {
        match auth::revoke(&bucket, seen.id()).await {
            Ok(_) => break,
            Err(e) if Instant::now() < deadline => {
                eprintln!("revoke while reconnecting: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("revoke: {e}"),
        }
    }
    let deadline = Instant::now() + T;
    loop {
        match ring.authenticate(&seen.expose()).await {
            Err(KeyError::Revoked(id)) => {
                assert_eq!(id, seen.id());
                break;
            }
            other if Instant::now() < deadline => {
                let _ = other;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            other => panic!("a revoked key after the bucket came back: {other:?}"),
        }
    }
    assert_eq!(ring.authenticate(&unseen.expose()).await.unwrap().owner, "acme");
    server.kill();
}
