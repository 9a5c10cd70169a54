//! The HTTP API's conventions, as a client that knows other APIs expects them: jobs link
//! their resources with absolute URLs (`urls`), `Prefer: wait=N` holds an answer until
//! the job ends, the framework's own refusals (unknown route, wrong method, body too
//! large, bad query or path) answer in the API's error shape, and CORS is off unless
//! origins are configured, then exact. Against a real nats-server, with the fake engine.

use std::time::{Duration, Instant};

use reqwest::header::HeaderMap;
use reqwest::Method;
use serde_json::{json, Value};
use stemq_accounts::auth::{self, Limits, Role};
use stemq_core::JobStatus;
use stemq_tests::{job_body, job_id, Stack, StackOptions};

const T: Duration = Duration::from_secs(30);

/// One call: (status, headers, JSON body or Null).
async fn call(rb: reqwest::RequestBuilder) -> (u16, HeaderMap, Value) {
    let resp = rb.send().await.expect("http");
    let (status, headers) = (resp.status().as_u16(), resp.headers().clone());
    (status, headers, resp.json().await.unwrap_or(Value::Null))
}

/// A key of `owner` (admin: it may submit and read, only its own jobs).
async fn key(stack: &Stack, owner: &str) -> String {
    auth::create(&stack.keys, owner, Role::Admin, Limits::NONE, "test").await.expect("key").0.expose()
}

/// A body for `owner`'s upload `name`, with a fake-engine script.
fn body_of(stack: &Stack, owner: &str, name: &str, fake: Value) -> Value {
    json!({"audio_uri": stack.store.uri(&format!("uploads/{owner}/{name}.wav")), "model": "dsp",
           "metadata": {"fake": fake}})
}

fn header<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name).and_then(|v| v.to_str().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn job_views_link_their_resources() {
    let stack = Stack::start(StackOptions::default()).await;
    let (code, h, sub) = call(stack.request(Method::POST, "/v1/separations").json(&job_body(
        &stack,
        "linked",
        Some(json!({"sleep_ms": 300})),
    )))
    .await;
    assert_eq!(code, 202, "{sub}");
    let id = job_id(&sub);
    let base = stack.url(&format!("/v1/separations/{id}"));
    // The submit answer: absolute links built from the request's Host.
    assert_eq!(sub["urls"]["get"], base, "{sub}");
    assert_eq!(sub["urls"]["cancel"], format!("{base}/cancel"));
    assert_eq!(sub["urls"]["events"], format!("{base}/events"));
    assert!(sub["urls"].get("stems").is_none(), "no stems before the job succeeded: {sub}");
    assert_eq!(header(&h, "location"), Some(base.as_str()));
    assert_eq!(sub["status_url"], format!("/v1/separations/{id}"), "the relative link stays");

    // The event stream: every message is the job with its links; the last one has the stems.
    let resp = stack.request(Method::GET, &format!("/v1/separations/{id}/events")).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let text = tokio::time::timeout(T, resp.text()).await.expect("the stream ends with the job").unwrap();
    let datas: Vec<Value> =
        text.lines().filter_map(|l| l.strip_prefix("data:")).map(|d| serde_json::from_str(d.trim()).unwrap()).collect();
    assert!(!datas.is_empty(), "{text}");
    for d in &datas {
        assert_eq!(d["urls"]["get"], base, "{d}");
    }
    let last = datas.last().unwrap();
    assert_eq!(last["status"], "succeeded", "{text}");
    assert_eq!(last["urls"]["stems"].as_object().map(|s| s.len()), Some(4), "{last}");

    // The view: links to every stem, each one downloadable there.
    let (code, _, view) = call(stack.request(Method::GET, &format!("/v1/separations/{id}"))).await;
    assert_eq!(code, 200);
    assert_eq!(view["status"], "succeeded");
    let stems = view["urls"]["stems"].as_object().expect("stems linked").clone();
    let names: Vec<&str> = view["outputs"].as_array().unwrap().iter().map(|o| o["stem"].as_str().unwrap()).collect();
    assert_eq!(stems.len(), names.len());
    for name in names {
        let url = stems[name].as_str().unwrap();
        assert_eq!(url, format!("{base}/stems/{name}"));
        let resp = reqwest::Client::new().get(url).bearer_auth(&stack.key).send().await.unwrap();
        assert_eq!(resp.status(), 200, "{url}");
        assert!(resp.text().await.unwrap().starts_with(&format!("fake stem {name}")));
    }

    // The list links each job the same way.
    let (_, _, page) = call(stack.request(Method::GET, "/v1/separations")).await;
    let listed = page["jobs"].as_array().unwrap().iter().find(|j| j["job_id"] == id.as_str()).expect("listed");
    assert_eq!(listed["urls"], view["urls"]);

    // Reached under another name, the links follow it.
    let (_, _, other) =
        call(stack.request(Method::GET, &format!("/v1/separations/{id}")).header("host", "api.example.test:9443"))
            .await;
    assert_eq!(other["urls"]["get"], format!("http://api.example.test:9443/v1/separations/{id}"));

    // The same submit again (cached), and a retry: linked too.
    let (code, _, again) = call(stack.request(Method::POST, "/v1/separations").json(&job_body(
        &stack,
        "linked",
        Some(json!({"sleep_ms": 300})),
    )))
    .await;
    assert_eq!((code, &again["cached"]), (200, &json!(true)));
    assert_eq!(again["urls"]["get"], base);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_public_url_names_every_link() {
    let public = "https://stemq.example.com/api/";
    let stack = Stack::start(StackOptions { public_url: Some(public.parse().unwrap()), ..Default::default() }).await;
    let (code, _, sub) =
        call(stack.request(Method::POST, "/v1/separations").json(&job_body(&stack, "public", None))).await;
    assert_eq!(code, 202, "{sub}");
    let id = job_id(&sub);
    let base = format!("https://stemq.example.com/api/v1/separations/{id}");
    assert_eq!(sub["urls"]["get"], base);
    let view = stack.wait_terminal(&id, T).await;
    assert_eq!(view.status, JobStatus::Succeeded);
    let (_, _, got) =
        call(stack.request(Method::GET, &format!("/v1/separations/{id}")).header("host", "evil.example.test")).await;
    assert_eq!(got["urls"]["get"], base, "the Host header does not move links off the public URL");
    assert_eq!(got["urls"]["stems"]["vocals"], format!("{base}/stems/vocals"));
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prefer_wait_answers_when_the_job_ends() {
    let stack = Stack::start(StackOptions::default()).await;

    // A quick job: the submit answers with its succeeded view.
    let t0 = Instant::now();
    let (code, h, job) =
        call(stack.request(Method::POST, "/v1/separations").header("prefer", "wait=10").json(&job_body(
            &stack,
            "quick",
            Some(json!({"sleep_ms": 100})),
        )))
        .await;
    assert_eq!(code, 200, "{job}");
    assert!(t0.elapsed() < Duration::from_secs(10), "answered when the job ended, not at the deadline");
    assert_eq!(job["status"], "succeeded", "{job}");
    assert_eq!(job["urls"]["stems"].as_object().map(|s| s.len()), Some(4), "{job}");
    assert_eq!(header(&h, "preference-applied"), Some("wait=10"));
    assert!(header(&h, "vary").is_some_and(|v| v.contains("prefer")), "{h:?}");
    assert_eq!(header(&h, "location"), job["urls"]["get"].as_str());
    // Asked again: it has ended, so the answer is at once.
    let t0 = Instant::now();
    let (code, h, again) =
        call(stack.request(Method::GET, &format!("/v1/separations/{}", job_id(&job))).header("prefer", "wait=30"))
            .await;
    assert_eq!((code, &again["status"]), (200, &json!("succeeded")));
    assert!(t0.elapsed() < Duration::from_secs(2));
    assert_eq!(header(&h, "preference-applied"), Some("wait=30"));

    // A slow job: the submit answers after about the wait, with the job still going.
    let slow = job_body(&stack, "slow", Some(json!({"sleep_ms": 20_000})));
    let t0 = Instant::now();
    let (code, h, job) =
        call(stack.request(Method::POST, "/v1/separations").header("prefer", "wait=1").json(&slow)).await;
    let took = t0.elapsed();
    assert_eq!(code, 202, "{job}");
    assert!(took >= Duration::from_secs(1) && took < Duration::from_secs(4), "answered after {took:?}");
    assert!(["queued", "running"].contains(&job["status"].as_str().unwrap()), "{job}");
    assert_eq!(header(&h, "preference-applied"), Some("wait=1"));
    let slow_id = job_id(&job);
    // The same on a read.
    let t0 = Instant::now();
    let (code, h, view) = call(
        stack.request(Method::GET, &format!("/v1/separations/{slow_id}")).header("prefer", "respond-async, wait=1"),
    )
    .await;
    let took = t0.elapsed();
    assert_eq!(code, 200);
    assert!(took >= Duration::from_secs(1) && took < Duration::from_secs(4), "answered after {took:?}");
    assert!(!JobStatus::parse(view["status"].as_str().unwrap()).unwrap().is_terminal(), "{view}");
    assert_eq!(header(&h, "preference-applied"), Some("wait=1"));
    // No preference, no wait and no Preference-Applied.
    let (_, h, _) = call(stack.request(Method::GET, &format!("/v1/separations/{slow_id}"))).await;
    assert_eq!(header(&h, "preference-applied"), None);
    assert!(header(&h, "vary").is_some_and(|v| v.contains("prefer")));

    // A long wait is capped at 60 s, and ends with the job: cancel it while waiting.
    let reader = {
        let rb = stack.request(Method::GET, &format!("/v1/separations/{slow_id}")).header("prefer", "wait=3600");
        tokio::spawn(async move {
            let t0 = Instant::now();
            let resp = rb.send().await.unwrap();
            let h = resp.headers().clone();
            (t0.elapsed(), h, resp.json::<Value>().await.unwrap())
        })
    };
    // Give the read a moment to start waiting (a cancel that comes first is answered the
    // same way: the job has ended, at once).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (code, _, _) = call(stack.request(Method::POST, &format!("/v1/separations/{slow_id}/cancel"))).await;
    assert!(code == 200 || code == 202, "cancel: {code}");
    let (took, h, view) = tokio::time::timeout(T, reader).await.expect("the wait ends with the job").unwrap();
    assert_eq!(view["status"], "cancelled", "{view}");
    assert!(took < Duration::from_secs(15), "answered {took:?} after the cancel");
    assert_eq!(header(&h, "preference-applied"), Some("wait=60"));

    // Another owner's job is a 404 at once, whatever the wait.
    let alice = key(&stack, "alice").await;
    let bob = key(&stack, "bob").await;
    let body = body_of(&stack, "alice", "hers", json!({"sleep_ms": 20_000}));
    let (code, _, hers) =
        call(reqwest::Client::new().post(stack.url("/v1/separations")).bearer_auth(&alice).json(&body)).await;
    assert_eq!(code, 202, "{hers}");
    let hers = job_id(&hers);
    for (method, path) in [(Method::GET, format!("/v1/separations/{hers}")), (Method::POST, "/v1/separations".into())] {
        let mut rb = reqwest::Client::new()
            .request(method.clone(), stack.url(&path))
            .bearer_auth(&bob)
            .header("prefer", "wait=5");
        if method == Method::POST {
            // Bob submits Alice's upload: refused before any wait.
            rb = rb.json(&body);
        }
        let t0 = Instant::now();
        let (code, h, v) = call(rb).await;
        if method == Method::GET {
            assert_eq!(code, 404, "{v}");
            assert!(t0.elapsed() < Duration::from_secs(2), "refused before any wait");
            assert_eq!(header(&h, "preference-applied"), None);
            assert!(v.get("urls").is_none() && v["error"]["code"] == "not_found", "{v}");
        } else {
            assert_eq!(code, 422, "Alice's upload is not Bob's: {v}");
            assert_eq!(header(&h, "preference-applied"), None);
        }
    }
    let (code, _, v) = call(
        reqwest::Client::new()
            .get(stack.url(&format!("/v1/separations/{hers}")))
            .bearer_auth(&alice)
            .header("prefer", "wait=1"),
    )
    .await;
    assert_eq!((code, &v["job_id"]), (200, &json!(hers.as_str())), "the owner waits on her own job: {v}");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn framework_errors_use_the_api_error_shape() {
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let (_, _, sub) = call(stack.request(Method::POST, "/v1/separations").json(&job_body(&stack, "errs", None))).await;
    let id = job_id(&sub);
    let raw = |method: Method, path: &str| stack.request(method, path);
    let cases: Vec<(reqwest::RequestBuilder, u16, &str)> = vec![
        (raw(Method::GET, "/v1/no-such-route"), 404, "not_found"),
        (raw(Method::POST, "/nowhere/at/all"), 404, "not_found"),
        (raw(Method::DELETE, "/v1/separations"), 405, "method_not_allowed"),
        (raw(Method::PUT, &format!("/v1/separations/{id}")), 405, "method_not_allowed"),
        (raw(Method::GET, &format!("/v1/separations/{id}/cancel")), 405, "method_not_allowed"),
        (
            raw(Method::POST, "/v1/separations").header("content-type", "application/json").body(vec![b' '; 3 << 20]),
            413,
            "too_large",
        ),
        (
            raw(Method::POST, "/v1/webhooks/enable")
                .header("content-type", "application/json")
                .body(vec![b' '; 3 << 20]),
            413,
            "too_large",
        ),
        (raw(Method::GET, "/v1/separations?limit=lots"), 422, "invalid_request"),
        (raw(Method::GET, "/v1/separations?limit=5000"), 422, "invalid_request"),
        (raw(Method::GET, "/v1/separations?limit=1&limit=2"), 400, "bad_request"),
        (raw(Method::POST, &format!("/v1/separations/{id}/deliveries/first/replay")), 400, "bad_request"),
        (
            raw(Method::POST, "/v1/separations").header("content-type", "application/json").body("{not json"),
            422,
            "invalid_request",
        ),
        (raw(Method::POST, "/v1/separations").json(&json!(["a", "list"])), 422, "invalid_request"),
        (raw(Method::POST, "/v1/webhooks/enable").body("{not json"), 422, "invalid_request"),
    ];
    for (rb, want, code) in cases {
        let req = rb.build().unwrap();
        let what = format!("{} {}", req.method(), req.url().path());
        let resp = reqwest::Client::new().execute(req).await.unwrap();
        let (status, headers) = (resp.status().as_u16(), resp.headers().clone());
        let body: Value = resp.json().await.unwrap_or(Value::Null);
        assert_eq!(status, want, "{what}: {body}");
        assert_eq!(header(&headers, "content-type"), Some("application/json"), "{what}");
        assert_eq!(body["error"]["code"], code, "{what}: {body}");
        assert!(body["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{what}: {body}");
        if status == 405 {
            assert!(header(&headers, "allow").is_some_and(|a| !a.is_empty()), "{what}: Allow says what is");
        }
    }
    // The list names the bad parameter.
    let (_, _, v) = call(raw(Method::GET, "/v1/separations?limit=lots")).await;
    assert_eq!(v["error"]["field"], "limit", "{v}");
    // Without a key, an unknown route is still a 401 first: nothing is told to strangers.
    let resp = reqwest::Client::new().get(stack.url("/v1/no-such-route")).send().await.unwrap();
    assert_eq!(resp.status(), 401);
    stack.shutdown().await;
}

/// A CORS preflight from `origin` for a POST with the headers a page sends.
async fn preflight(stack: &Stack, origin: &str) -> (u16, HeaderMap) {
    let resp = reqwest::Client::new()
        .request(Method::OPTIONS, stack.url("/v1/separations"))
        .header("origin", origin)
        .header("access-control-request-method", "POST")
        .header("access-control-request-headers", "authorization, content-type, prefer")
        .send()
        .await
        .unwrap();
    (resp.status().as_u16(), resp.headers().clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cors_is_off_by_default_and_exact_when_on() {
    let app = "https://app.example.test";
    // Off: no CORS header on a preflight or on an answer.
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let (_, h) = preflight(&stack, app).await;
    assert!(h.get("access-control-allow-origin").is_none(), "{h:?}");
    let (code, h, _) = call(stack.request(Method::GET, "/v1/separations").header("origin", app)).await;
    assert_eq!(code, 200);
    assert!(h.keys().all(|k| !k.as_str().starts_with("access-control-")), "{h:?}");
    stack.shutdown().await;

    // On for one origin.
    let stack =
        Stack::start(StackOptions { workers: 0, cors_origins: vec![app.parse().unwrap()], ..Default::default() }).await;
    let (code, h) = preflight(&stack, app).await;
    assert!((200..300).contains(&code), "preflight {code}: {h:?}");
    assert_eq!(header(&h, "access-control-allow-origin"), Some(app));
    let methods = header(&h, "access-control-allow-methods").unwrap_or_default().to_ascii_lowercase();
    assert!(methods.contains("post") && methods.contains("get"), "{methods}");
    let allowed = header(&h, "access-control-allow-headers").unwrap_or_default().to_ascii_lowercase();
    for name in ["authorization", "content-type", "prefer", "last-event-id"] {
        assert!(allowed.contains(name), "{name} in {allowed}");
    }
    assert_eq!(header(&h, "access-control-max-age"), Some("600"));
    assert!(h.get("access-control-allow-credentials").is_none(), "keys, not cookies");
    // Another origin: no allow-origin (the browser then refuses the page).
    let (_, h) = preflight(&stack, "https://evil.example.test").await;
    assert!(h.get("access-control-allow-origin").is_none(), "{h:?}");

    // Actual requests: the origin is allowed and the API's headers are readable, errors
    // included; another origin gets nothing.
    let (code, h, _) = call(
        stack
            .request(Method::POST, "/v1/separations")
            .header("origin", app)
            .header("prefer", "wait=0")
            .json(&job_body(&stack, "cors", None)),
    )
    .await;
    assert_eq!(code, 202);
    assert_eq!(header(&h, "access-control-allow-origin"), Some(app));
    let exposed = header(&h, "access-control-expose-headers").unwrap_or_default().to_ascii_lowercase();
    for name in ["ratelimit", "ratelimit-policy", "retry-after", "preference-applied", "location"] {
        assert!(exposed.split(',').any(|e| e.trim() == name), "{name} in {exposed}");
    }
    assert_eq!(header(&h, "preference-applied"), Some("wait=0"));
    let resp = reqwest::Client::new().get(stack.url("/v1/separations")).header("origin", app).send().await.unwrap();
    assert_eq!(resp.status(), 401);
    assert_eq!(header(resp.headers(), "access-control-allow-origin"), Some(app), "a page can read why it failed");
    let (_, h, _) =
        call(stack.request(Method::GET, "/v1/separations").header("origin", "https://evil.example.test")).await;
    assert!(h.get("access-control-allow-origin").is_none(), "{h:?}");
    stack.shutdown().await;
}
