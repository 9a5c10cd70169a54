//! Issue 17, the command line: parsed arguments are validated types, each subcommand's
//! help shows its own flags, errors print each cause once, and the client commands work
//! against the HTTP API alone (`--api`), with no NATS URL or store.

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use serde_json::json;
use stemq_core::JobStatus;
use stemq_devkit::nats_server::NatsServer;
use stemq_tests::{job_body, job_id, Stack, StackOptions};

const T: Duration = Duration::from_secs(30);

/// `stemq ARGS` in `dir`, with none of the caller's stemq settings.
fn stemq(args: &[&str], dir: &Path) -> Command {
    let mut cmd = Command::new(Stack::stemq_bin());
    cmd.args(args).current_dir(dir).env("STEMQ_DATA_DIR", dir.join(".stemq"));
    for var in ["NATS_URL", "STEMQ_NATS_CREDS", "STEMQ_STORE", "STEMQ_API", "STEMQ_API_KEY", "STEMQ_LOG_FORMAT"] {
        cmd.env_remove(var);
    }
    cmd
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn ok(out: &Output, what: &str) -> String {
    assert!(out.status.success(), "{what} failed:\n{}\n{}", text(&out.stdout), text(&out.stderr));
    text(&out.stdout)
}

#[test]
fn an_unknown_log_format_is_an_error_that_names_the_choices() {
    let dir = tempfile::tempdir().unwrap();
    let out = stemq(&["--log-format", "xml", "schemas", "--write", "s"], dir.path()).output().unwrap();
    assert!(!out.status.success(), "an unknown --log-format was accepted");
    let err = text(&out.stderr);
    assert!(err.contains("'xml'") && err.contains("--log-format") && err.contains("json, text"), "{err}");
    assert!(!dir.path().join("s").exists(), "the command ran anyway");

    // The same through the environment.
    let out = stemq(&["schemas", "--write", "s"], dir.path()).env("STEMQ_LOG_FORMAT", "yaml").output().unwrap();
    assert!(!out.status.success(), "an unknown STEMQ_LOG_FORMAT was accepted");
    assert!(text(&out.stderr).contains("'yaml'"), "{}", text(&out.stderr));
}

/// Issue 14: cross-job batching runs inside one process; asking for it with process
/// isolation (the default), or with a batch of 1, is refused before anything starts.
#[test]
fn batching_across_jobs_is_refused_where_it_cannot_share() {
    let dir = tempfile::tempdir().unwrap();
    for sub in ["worker", "dev"] {
        let help = ok(&stemq(&[sub, "--help"], dir.path()).output().unwrap(), sub);
        assert!(help.contains("--batch-across-jobs") && help.contains("--batch-linger-ms"), "{sub}:\n{help}");
        for (args, says) in [
            (vec!["--batch-across-jobs", "4"], "needs --isolation shared"),
            (vec!["--batch-across-jobs", "4", "--isolation", "process"], "needs --isolation shared"),
            (vec!["--batch-across-jobs", "1", "--isolation", "none"], "shares nothing"),
        ] {
            let mut all = vec![sub];
            all.extend(&args);
            let out = stemq(&all, dir.path()).env("NATS_URL", "nats://127.0.0.1:1").output().unwrap();
            assert!(!out.status.success(), "stemq {all:?} was accepted");
            let err = text(&out.stderr);
            assert!(err.contains(says) && !err.contains("127.0.0.1:1"), "stemq {all:?}: {err}");
        }
    }
    assert!(!dir.path().join(".stemq/nats").exists(), "stemq dev started its server first");
}

#[test]
fn public_url_and_cors_origins_are_checked_before_anything_starts() {
    let dir = tempfile::tempdir().unwrap();
    for sub in ["ingress", "dev"] {
        let help = ok(&stemq(&[sub, "--help"], dir.path()).output().unwrap(), sub);
        assert!(help.contains("--public-url") && help.contains("--cors-origin"), "`stemq {sub} --help`:\n{help}");
        for (flag, value, says) in [
            ("--cors-origin", "*", "list each web page origin exactly"),
            ("--cors-origin", "https://app.example/page", "has no path"),
            ("--public-url", "ftp://files.example", "http:// or https://"),
        ] {
            let out = stemq(&[sub, flag, value], dir.path()).env("NATS_URL", "nats://127.0.0.1:1").output().unwrap();
            assert!(!out.status.success(), "stemq {sub} {flag} {value} was accepted");
            let err = text(&out.stderr);
            assert!(err.contains(flag) && err.contains(says), "stemq {sub} {flag} {value}: {err}");
        }
        // The environment's comma list is read one origin at a time.
        let out = stemq(&[sub], dir.path())
            .env("NATS_URL", "nats://127.0.0.1:1")
            .env("STEMQ_CORS_ORIGINS", "https://a.example,*")
            .output()
            .unwrap();
        assert!(!out.status.success() && text(&out.stderr).contains("`*` is not an origin"), "{}", text(&out.stderr));
    }
}

#[test]
fn server_settings_show_on_the_services_and_not_on_the_client_commands() {
    let dir = tempfile::tempdir().unwrap();
    let help = |sub: &str| ok(&stemq(&[sub, "--help"], dir.path()).output().unwrap(), sub);
    let worker = help("worker");
    for flag in
        ["--ack-wait-ms", "--max-deliver", "--dedupe-window-ms", "--replicas", "--store", "--metrics", "--engine"]
    {
        assert!(worker.contains(flag), "`stemq worker --help` lacks {flag}:\n{worker}");
    }
    assert!(worker.contains("dsp") && worker.contains("demucs") && worker.contains("fake"), "{worker}");
    let submit = help("submit");
    for flag in ["--ack-wait-ms", "--max-deliver", "--dedupe-window-ms", "--metrics", "--engine"] {
        assert!(!submit.contains(flag), "`stemq submit --help` shows {flag}:\n{submit}");
    }
    for flag in ["--api", "--api-key", "--flac", "--int24", "--float32", "--clip-mode", "--two-stems"] {
        assert!(submit.contains(flag), "`stemq submit --help` lacks {flag}:\n{submit}");
    }
    let separate = help("separate");
    assert!(!separate.contains("--ack-wait-ms") && !separate.contains("--store"), "{separate}");
}

/// Issue 17: "Address already in use (os error 98): Address already in use (os error
/// 98)" — each cause once.
#[test]
fn a_busy_http_port_is_reported_with_each_cause_once() {
    let dir = tempfile::tempdir().unwrap();
    let server = NatsServer::start(&dir.path().join("nats"), 0).expect("nats-server >= 2.11 on PATH");
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = busy.local_addr().unwrap().to_string();
    let out = stemq(&["ingress", "--http", &addr], dir.path())
        .env("NATS_URL", server.url())
        .env("STEMQ_NATS_CREDS", server.credentials(stemq_nats::users::INGRESS))
        .env("STEMQ_LOG_FORMAT", "json")
        .output()
        .unwrap();
    assert!(!out.status.success(), "the ingress started on a busy port");
    let err = text(&out.stderr);
    let line = err.lines().find(|l| l.starts_with("error: ")).unwrap_or_else(|| panic!("no error line in {err}"));
    assert!(line.contains(&format!("cannot listen on {addr}")), "{line}");
    let cause = std::io::Error::from(std::io::ErrorKind::AddrInUse).kind().to_string();
    let in_use = line.matches("in use").count();
    assert_eq!(in_use, 1, "the cause ({cause}) should print once: {line}");
    drop(busy);
}

/// Issue 17: a user with the API's address and a key, and nothing else, uploads,
/// submits, waits, downloads the stems, reads status and the list, cancels and retries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_commands_work_over_the_http_api_alone() {
    let stack = Stack::start(StackOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let api = format!("http://{}", stack.http);
    // Settings that would fail if the CLI used NATS or a store of its own.
    let cli = |args: &[&str]| {
        let dir = dir.path().to_path_buf();
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        let api = api.clone();
        let key = stack.key.clone();
        async move {
            tokio::task::spawn_blocking(move || {
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                stemq(&args, &dir)
                    .env("NATS_URL", "nats://127.0.0.1:1")
                    .env("STEMQ_STORE", "file:///nonexistent/store/")
                    .env("STEMQ_API", &api)
                    .env("STEMQ_API_KEY", key)
                    .output()
                    .unwrap()
            })
            .await
            .unwrap()
        }
    };
    ok(&cli(&["synth", "--seconds", "1", "-o", "song.wav"]).await, "synth");

    // submit FILE --wait -o DIR, in separate's spellings.
    let out = cli(&["submit", "song.wav", "--name", "dsp", "--flac", "--wait", "--out", "stems"]).await;
    let stdout = ok(&out, "submit --api");
    let start = stdout.find('{').expect("the submit answer");
    // The answer is the first JSON document (it nests: `urls`); the download report follows.
    let answer: serde_json::Value = serde_json::Deserializer::from_str(&stdout[start..])
        .into_iter()
        .next()
        .expect("the submit answer")
        .expect(&stdout);
    let id = job_id(&answer);
    let view = stack.wait_terminal(&id, T).await;
    assert_eq!(view.status, JobStatus::Succeeded);
    let request = view.request.as_ref().unwrap();
    assert!(request.audio_uri.starts_with(stack.store.base_url()), "uploaded into the API's store: {request:?}");
    assert_eq!(serde_json::to_value(request.output_format).unwrap(), "flac");
    assert!(!view.outputs.is_empty());
    for o in &view.outputs {
        let file = dir.path().join(format!("stems/{}.flac", o.stem));
        let bytes = std::fs::read(&file).unwrap_or_else(|_| panic!("{} not downloaded", file.display()));
        assert_eq!(bytes.len() as u64, o.bytes, "{}", file.display());
        let want = format!("fake stem {} of job {id}", o.stem);
        assert!(text(&bytes).starts_with(&want), "{}: {}", file.display(), text(&bytes));
    }

    let status = ok(&cli(&["status", id.as_str()]).await, "status --api");
    assert!(status.contains("\"succeeded\""), "{status}");
    let list = ok(&cli(&["list", "--status", "succeeded"]).await, "list --api");
    assert!(list.contains(id.as_str()), "{list}");

    // cancel and retry (and retry again: the same new job).
    let (_, b) = stack.submit(&job_body(&stack, "api-cancel", Some(json!({"sleep_ms": 60_000})))).await;
    let slow = job_id(&b);
    ok(&cli(&["cancel", slow.as_str()]).await, "cancel --api");
    assert_eq!(stack.wait_terminal(&slow, T).await.status, JobStatus::Cancelled);
    let retried = ok(&cli(&["retry", slow.as_str()]).await, "retry --api");
    assert!(retried.starts_with(&format!("retrying {slow} as ")), "{retried}");
    let new_id = stemq_core::JobId::parse(retried.trim().rsplit(' ').next().unwrap()).expect(&retried);
    let again = ok(&cli(&["dlq", "replay", slow.as_str()]).await, "dlq replay --api");
    assert!(again.contains("already") && again.contains(new_id.as_str()), "{again}");
    ok(&cli(&["cancel", new_id.as_str()]).await, "cancel --api");

    // The API's own error, once, with its code.
    let missing = cli(&["status", &"0".repeat(64)]).await;
    assert!(!missing.status.success());
    let err = text(&missing.stderr);
    assert!(err.contains("404 not_found") && err.matches("no job").count() == 1, "{err}");
    stack.shutdown().await;
}

/// `--api-key` goes out as a bearer token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_key_is_sent_as_a_bearer_token() {
    use axum::http::HeaderMap;
    let seen = std::sync::Arc::new(std::sync::Mutex::new(None::<String>));
    let s = seen.clone();
    let app = axum::Router::new().route(
        "/v1/separations/{id}",
        axum::routing::get(move |headers: HeaderMap| {
            let s = s.clone();
            async move {
                *s.lock().unwrap() = headers.get("authorization").and_then(|v| v.to_str().ok()).map(str::to_string);
                (axum::http::StatusCode::NOT_FOUND, axum::Json(json!({"error": {"code": "not_found", "message": "x"}})))
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let dir = tempfile::tempdir().unwrap();
    let api = format!("http://{addr}");
    let path = dir.path().to_path_buf();
    let out = tokio::task::spawn_blocking(move || {
        stemq(&["status", &"a".repeat(64), "--api", &api, "--api-key", "k-123"], &path).output().unwrap()
    })
    .await
    .unwrap();
    assert!(!out.status.success());
    assert_eq!(seen.lock().unwrap().as_deref(), Some("Bearer k-123"), "{}", text(&out.stderr));
}

/// `stemq keys create / list / revoke` against a real server: the key is printed once,
/// works at once, is listed without its secret, and stops working when revoked. A key
/// in `<data-dir>/admin.key` is used when no `--api-key` is given.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_are_created_listed_and_revoked_from_the_command_line() {
    let stack = Stack::start(StackOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let (nats, api) = (stack.server.url(), format!("http://{}", stack.http));
    // API keys live in NATS: the operator's NATS user manages them.
    let creds = stack.server.credentials(stemq_nats::users::OPERATOR);
    let run = |args: Vec<String>| {
        let (dir, nats, creds) = (dir.path().to_path_buf(), nats.clone(), creds.clone());
        tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            stemq(&args, &dir).env("NATS_URL", nats).env("STEMQ_NATS_CREDS", creds).output().unwrap()
        })
    };
    let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let out = run(args(&["keys", "create", "--owner", "band", "--role", "admin", "--name", "ci"])).await.unwrap();
    let key = ok(&out, "keys create").trim().to_string();
    assert!(key.starts_with("sk_"), "{key}");
    let id = key.split('_').nth(1).unwrap().to_string();
    assert!(text(&out.stderr).contains(&id));
    let bad = run(args(&["keys", "create", "--owner", "Not Valid"])).await.unwrap();
    assert!(!bad.status.success() && text(&bad.stderr).contains("owner"), "{}", text(&bad.stderr));

    // Issue 12: a key with a default lane (`--priority batch`).
    let out = run(args(&["keys", "create", "--owner", "archive", "--role", "submit", "--priority", "batch"])).await;
    let archive = ok(&out.unwrap(), "keys create --priority").trim().to_string();
    let archive_id = archive.split('_').nth(1).unwrap().to_string();
    let bad = run(args(&["keys", "create", "--owner", "archive", "--priority", "urgent"])).await.unwrap();
    assert!(!bad.status.success() && text(&bad.stderr).contains("urgent"), "{}", text(&bad.stderr));

    // A sign-in link's session key (as `stemq dev`'s page gets one): listed with its end.
    let (_, session) = stemq_accounts::auth::create_session(
        &stack.keys,
        "local",
        stemq_accounts::auth::Role::Operator,
        stemq_accounts::auth::Limits::NONE,
        "page session (sign-in link)",
        Duration::from_secs(3600),
    )
    .await
    .unwrap();

    let list = ok(&run(args(&["keys", "list"])).await.unwrap(), "keys list");
    assert!(list.contains(&id) && list.contains("band") && list.contains("admin") && list.contains("active"), "{list}");
    assert!(!list.contains(&key), "the key itself is never listed");
    let line =
        |id: &str| list.lines().find(|l| l.starts_with(id)).unwrap_or_else(|| panic!("{id} in {list}")).to_string();
    assert!(line(&archive_id).contains(" batch "), "{list}");
    assert!(line(&id).contains("interactive (default)"), "{list}");
    assert!(line(&session.id).contains("active, expires ") && line(&session.id).contains("page session"), "{list}");

    // Its jobs wait in the batch lane unless they ask for another (`submit --priority`).
    let submit = |extra: &[&str]| {
        let mut a = args(&["submit", "song.wav", "--api", &api, "--api-key", &archive]);
        a.extend(args(extra));
        run(a)
    };
    ok(&run(args(&["synth", "--seconds", "1", "-o", "song.wav"])).await.unwrap(), "synth");
    for (extra, lane) in [
        (&[][..], stemq_core::request::Priority::Batch),
        (&["--priority", "interactive", "--two-stems", "vocals"][..], stemq_core::request::Priority::Interactive),
    ] {
        let stdout = ok(&submit(extra).await.unwrap(), "submit --api with the archive key");
        let answer: serde_json::Value =
            serde_json::from_str(&stdout[stdout.find('{').expect(&stdout)..]).expect(&stdout);
        let view = stack.wait_terminal(&job_id(&answer), T).await;
        assert_eq!((view.status, view.priority), (JobStatus::Succeeded, Some(lane)), "{extra:?}: {view:#?}");
    }

    // The key from <data-dir>/admin.key, with no --api-key.
    std::fs::create_dir_all(dir.path().join(".stemq")).unwrap();
    std::fs::write(dir.path().join(".stemq/admin.key"), format!("{key}\n")).unwrap();
    let listed = run(args(&["list", "--api", &api])).await.unwrap();
    ok(&listed, "list --api with admin.key");

    ok(&run(args(&["keys", "revoke", &id])).await.unwrap(), "keys revoke");
    let list = ok(&run(args(&["keys", "list"])).await.unwrap(), "keys list");
    assert!(list.contains("revoked"), "{list}");
    let t0 = std::time::Instant::now();
    loop {
        let out = run(args(&["list", "--api", &api])).await.unwrap();
        if !out.status.success() {
            assert!(text(&out.stderr).contains("401"), "{}", text(&out.stderr));
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "the revoked key still works");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stack.shutdown().await;
}

/// `stemq bench pipeline --raw --repeat 2` runs raw JetStream and the pipeline on fresh
/// servers of its own in each round, and ends with the medians and the median ratio
/// (issue 18: the ratio to raw JetStream is one command). Figures are not checked: a
/// benchmark is not a timed test.
#[test]
fn the_pipeline_bench_repeats_rounds_and_reports_medians_and_ratios() {
    let dir = tempfile::tempdir().unwrap();
    let out = stemq(&["bench", "pipeline", "--raw", "--repeat", "2", "--jobs", "40", "--workers", "8"], dir.path())
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let stdout = ok(&out, "stemq bench pipeline --raw --repeat 2");
    assert_eq!(stdout.matches("completed       40").count(), 2, "raw JetStream in each round:\n{stdout}");
    assert_eq!(stdout.matches("(40 completed, 0 failed submits)").count(), 2, "the pipeline in each round:\n{stdout}");
    let summary = stdout.split("over 2 rounds (median)").nth(1).unwrap_or_else(|| panic!("no summary:\n{stdout}"));
    // What a job costs in NATS messages, by part: the parts add up, and a submit is at
    // least its publish and the publish's ack.
    let rounds = stdout.split("over 2 rounds (median)").next().unwrap_or_default();
    let messages: Vec<&str> = rounds.lines().filter(|l| l.trim_start().starts_with("messages a job  ")).collect();
    assert_eq!(messages.len(), 4, "raw JetStream's and the pipeline's, in each round:\n{stdout}");
    for line in messages.iter().filter(|l| l.contains("submit ")) {
        let numbers: Vec<f64> =
            line.split(|c: char| !(c.is_ascii_digit() || c == '.')).filter_map(|w| w.parse().ok()).collect();
        let (total, parts) = numbers.split_first().unwrap_or_else(|| panic!("{line}"));
        assert_eq!(parts.len(), 4, "submit, worker, projector, watch: {line}");
        assert!((parts.iter().sum::<f64>() - total).abs() < 0.03, "the parts add up: {line}");
        assert!(parts[0] >= 2.0 && parts.iter().all(|n| *n > 0.0), "{line}");
    }
    for label in
        ["end to end", "latency p99", "messages a job", "raw end to end", "raw messages", "ratio e2e", "ratio p99"]
    {
        let line = summary.lines().find(|l| l.trim_start().starts_with(label)).unwrap_or_else(|| panic!("{label}"));
        assert!(line.contains("(rounds: ") && line.matches(", ").count() == 1, "{line}");
    }
    let refused = stemq(&["bench", "pipeline", "--repeat", "0"], dir.path()).output().unwrap();
    assert!(!refused.status.success(), "--repeat 0 was accepted");
}

/// `stemq bench http` offers submits at a fixed rate to a running ingress: every
/// request is a new job (a distinct body, so a distinct job id), and the report gives
/// the statuses and the latency from each request's due time. A request answered with
/// a status outside `--accept` (202 by default) fails the command.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_bench_offers_distinct_submits_at_a_rate() {
    let stack = Stack::start(StackOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let api = format!("http://{}", stack.http);
    let before = stack.count_on("stemq.jobs.*.requested.>").await;
    let run = |key: String, owner: &'static str, accept: &'static str| {
        let (dir, api, base) = (dir.path().to_path_buf(), api.clone(), stack.store.base_url().to_string());
        tokio::task::spawn_blocking(move || {
            let args = [
                "bench",
                "http",
                "--rate",
                "100",
                "--seconds",
                "1",
                "--connections",
                "4",
                "--owner",
                owner,
                "--accept",
                accept,
            ];
            stemq(&args, &dir)
                .env("STEMQ_API", &api)
                .env("STEMQ_API_KEY", key)
                .env("STEMQ_STORE_BASE", base)
                .env("RUST_LOG", "warn")
                .output()
                .unwrap()
        })
    };
    let out = run(stack.key.clone(), stemq_tests::TEST_OWNER, "202").await.unwrap();
    let stdout = ok(&out, "stemq bench http");
    assert!(stdout.contains("offered         100 requests at 100/s"), "{stdout}");
    assert!(stdout.contains("statuses        202: 100\n"), "{stdout}");
    for label in ["latency", "service time"] {
        let line = stdout.lines().find(|l| l.trim_start().starts_with(label)).unwrap_or_else(|| panic!("{stdout}"));
        assert!(line.contains(" p99 ") && line.ends_with(" ms"), "{line}");
    }
    assert_eq!(stack.count_on("stemq.jobs.*.requested.>").await - before, 100, "one new job per request");
    // Another owner's uploads are refused (422): the command says so and fails.
    let out = run(stack.key.clone(), "someone-else", "202").await.unwrap();
    assert!(!out.status.success(), "refused submits counted as a success");
    assert!(text(&out.stdout).contains("422: 100"), "{}", text(&out.stdout));
    assert!(text(&out.stderr).contains("100 of 100 requests were not accepted"), "{}", text(&out.stderr));
    // Unless the refusal is named as an expected answer (as 429 is, to measure limits).
    let out = run(stack.key.clone(), "someone-else", "202,422").await.unwrap();
    let stdout = ok(&out, "stemq bench http --accept 202,422");
    assert!(stdout.contains("statuses        422: 100\n"), "{stdout}");
    assert!(stdout.contains("accepted (202)  0 requests/s"), "{stdout}");
    stack.shutdown().await;
}
