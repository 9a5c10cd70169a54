//! The listener: accepting connections and how long a client may take.
//!
//! This module owns serving the router on a TCP listener, over plain HTTP or TLS
//! (HTTP/1.1, and HTTP/2 by ALPN or prior knowledge), and the time limits that keep a
//! slow or silent client from holding a connection ([`HttpTimeouts`]):
//!
//! - **request head**: a connection must finish its TLS handshake, if any, within
//!   [`HttpTimeouts::header`], deliver a whole request head within that time after it
//!   opened (or after the handshake), and again
//!   within that time after each answer: the same limit caps an idle keep-alive
//!   connection, HTTP/1.1 or HTTP/2 ([`IdleAcceptor`]: a connection with no request in
//!   flight for that long is closed, however it keeps itself alive, pings included).
//!   Past it the connection is closed without an answer: there is no request to answer
//!   yet, and a client that reuses an idle connection would take an unsolicited 408 for
//!   the answer to its next request;
//! - **request body**: a body must keep arriving ([`body_deadline`]): no gap longer
//!   than [`HttpTimeouts::body`], and all of it within [`HttpTimeouts::body`] plus the
//!   time its bytes take at [`HttpTimeouts::body_min_rate`] (so a 2 MiB JSON body has
//!   about 30 s and a 1 GiB upload may take its time at a usable rate). Past it the
//!   request answers 408 `request_timeout` and the connection closes;
//! - a declared `Content-Length` above what the route reads ([`rejection::BODY_LIMIT`] for
//!   every route but uploads, which check their own limit) answers 413 at once, without
//!   waiting for a byte of the body.
//!
//! A connection that closes lingers ([`IdleIo`]): it reads and drops what the client
//! still sends, within bounds, so that a client cut off mid-body reads its answer.
//!
//! Shutdown: no new connection is accepted, requests in flight finish (within
//! [`DRAIN`]), idle connections close.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Version};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use axum_server::accept::{Accept, DefaultAcceptor};
use axum_server::tls_rustls::{RustlsAcceptor, RustlsConfig};
use bytes::Bytes;
use futures::task::AtomicWaker;
use http_body::{Body as HttpBody, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::CancellationToken;

use crate::{rejection, ApiError, AppState, ErrorCode};

/// Longest wait for requests in flight once shutdown starts; streams still open then
/// (Server-Sent Events) are cut.
pub const DRAIN: Duration = Duration::from_secs(10);

/// How long a client may take (`--http-header-timeout-ms`, `--http-body-timeout-ms`,
/// `--http-body-min-rate`); see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpTimeouts {
    /// To deliver a request head, from the connection's start or the last answer (so
    /// also the longest idle keep-alive). Default 20 s.
    pub header: Duration,
    /// The longest gap in a request body, and the time a body has beyond what its bytes
    /// take at [`HttpTimeouts::body_min_rate`]. Default 30 s.
    pub body: Duration,
    /// The slowest sustained body rate, in bytes per second. Default 16 KiB/s.
    pub body_min_rate: u64,
}

impl Default for HttpTimeouts {
    fn default() -> HttpTimeouts {
        HttpTimeouts { header: Duration::from_secs(20), body: Duration::from_secs(30), body_min_rate: 16 << 10 }
    }
}

/// When a body that started at `start`, last delivered bytes at `last`, and has
/// delivered `received` bytes so far times out: the earlier of `last + body` and
/// `start + body + received / body_min_rate`.
pub fn body_deadline(t: &HttpTimeouts, start: Instant, last: Instant, received: u64) -> Instant {
    let allowance = Duration::from_secs_f64(received as f64 / t.body_min_rate.max(1) as f64);
    (last + t.body).min(start + t.body + allowance)
}

/// Serves `app` on `listener` until `shutdown` (over TLS with `tls`), with `timeouts`
/// on every connection; then drains (see the module docs).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    tls: Option<Arc<rustls::ServerConfig>>,
    timeouts: HttpTimeouts,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let handle = axum_server::Handle::<SocketAddr>::new();
    let mut server = axum_server::Server::<SocketAddr>::from_listener(listener)
        // Covers the protocol detection before the first request too, which reads the
        // first bytes without a timer of its own.
        .first_request_timeout(timeouts.header)
        .handle(handle.clone());
    server.http_builder().http1().header_read_timeout(timeouts.header);
    // An HTTP/2 peer that stops answering pings is gone.
    server.http_builder().http2().keep_alive_interval(timeouts.header).keep_alive_timeout(timeouts.header);
    let app = app.into_make_service();
    let run = async move {
        match tls {
            Some(config) => {
                let tls = RustlsAcceptor::new(RustlsConfig::from_config(config)).handshake_timeout(timeouts.header);
                server.acceptor(IdleAcceptor { inner: tls, idle: timeouts.header }).serve(app).await
            }
            None => server.acceptor(IdleAcceptor { inner: DefaultAcceptor, idle: timeouts.header }).serve(app).await,
        }
    };
    tokio::pin!(run);
    tokio::select! {
        r = &mut run => return r,
        _ = shutdown.cancelled() => handle.graceful_shutdown(Some(DRAIN)),
    }
    run.await
}

/// One connection's requests: how many are in flight (until their answer's body is
/// sent) and when the last one ended.
struct Activity {
    epoch: Instant,
    in_flight: AtomicUsize,
    /// Milliseconds after `epoch`.
    last_done_ms: AtomicU64,
    /// The connection's reader, woken when a request ends (its idle time starts).
    reader: AtomicWaker,
}

impl Activity {
    fn new() -> Activity {
        Activity {
            epoch: Instant::now(),
            in_flight: AtomicUsize::new(0),
            last_done_ms: AtomicU64::new(0),
            reader: AtomicWaker::new(),
        }
    }

    /// Since when the connection has had no request in flight; `None` while one is.
    fn idle_since(&self) -> Option<Instant> {
        (self.in_flight.load(Ordering::SeqCst) == 0)
            .then(|| self.epoch + Duration::from_millis(self.last_done_ms.load(Ordering::SeqCst)))
    }
}

/// A request in flight on its connection ([`Activity`]); dropped with its answer's body.
struct InFlight(Arc<Activity>);

impl InFlight {
    fn start(a: Arc<Activity>) -> InFlight {
        a.in_flight.fetch_add(1, Ordering::SeqCst);
        InFlight(a)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let a = &self.0;
        a.last_done_ms.store(a.epoch.elapsed().as_millis() as u64, Ordering::SeqCst);
        a.in_flight.fetch_sub(1, Ordering::SeqCst);
        a.reader.wake();
    }
}

/// Closes a connection that has had no request in flight for `idle`, whatever the
/// protocol: its reader sees the end of the stream then ([`IdleIo`]). Wraps the
/// acceptor of plain TCP or TLS.
#[derive(Clone)]
pub struct IdleAcceptor<A> {
    inner: A,
    idle: Duration,
}

impl<I, S, A> Accept<I, S> for IdleAcceptor<A>
where
    A: Accept<I, S>,
    A::Future: Send + 'static,
    A::Stream: Send + 'static,
    A::Service: Send + 'static,
{
    type Stream = IdleIo<A::Stream>;
    type Service = WithActivity<A::Service>;
    type Future = Pin<Box<dyn Future<Output = io::Result<(Self::Stream, Self::Service)>> + Send>>;

    fn accept(&self, stream: I, service: S) -> Self::Future {
        let (accepted, idle) = (self.inner.accept(stream, service), self.idle);
        Box::pin(async move {
            let (stream, service) = accepted.await?;
            let activity = Arc::new(Activity::new());
            let sleep = Box::pin(tokio::time::sleep_until(activity.epoch + idle));
            let io = IdleIo { inner: stream, activity: activity.clone(), idle, sleep, linger: None };
            Ok((io, WithActivity { inner: service, activity }))
        })
    }
}

/// A connection's byte stream that ends once the connection has been idle too long,
/// and that lingers when it closes: after its write side is shut, what the client still
/// sends is read and dropped (at most [`LINGER_BYTES`], for at most [`LINGER`]) until
/// the client closes too. A client still writing a body the server refused (413 at
/// once, 408) then reads the answer instead of a reset connection.
pub struct IdleIo<T> {
    inner: T,
    activity: Arc<Activity>,
    idle: Duration,
    sleep: Pin<Box<Sleep>>,
    linger: Option<Linger>,
}

/// How long a closing connection reads what its client still sends ([`IdleIo`]).
pub const LINGER: Duration = Duration::from_secs(2);

/// How much a closing connection reads and drops before it closes anyway ([`IdleIo`]).
pub const LINGER_BYTES: usize = 64 << 20;

/// A closing connection's limits: its deadline and the bytes it may still drop.
struct Linger {
    until: Pin<Box<Sleep>>,
    left: usize,
}

impl<T: AsyncRead + Unpin> AsyncRead for IdleIo<T> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Pending => {}
            other => return other,
        }
        this.activity.reader.register(cx.waker());
        if let Some(since) = this.activity.idle_since() {
            let deadline = since + this.idle;
            if this.sleep.deadline() != deadline {
                this.sleep.as_mut().reset(deadline);
            }
            if this.sleep.as_mut().poll(cx).is_ready() {
                // Nothing read: the end of the stream, and the connection closes.
                return Poll::Ready(Ok(()));
            }
        }
        Poll::Pending
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> AsyncWrite for IdleIo<T> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let linger = match &mut this.linger {
            Some(linger) => linger,
            None => {
                std::task::ready!(Pin::new(&mut this.inner).poll_shutdown(cx))?;
                this.linger.insert(Linger { until: Box::pin(tokio::time::sleep(LINGER)), left: LINGER_BYTES })
            }
        };
        let mut scratch = [0u8; 16 << 10];
        loop {
            if linger.left == 0 || linger.until.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Ok(()));
            }
            let mut buf = ReadBuf::new(&mut scratch);
            match Pin::new(&mut this.inner).poll_read(cx, &mut buf) {
                // The client closed (or the connection broke): nothing is left to drop.
                Poll::Ready(Ok(())) if buf.filled().is_empty() => return Poll::Ready(Ok(())),
                Poll::Ready(Err(_)) => return Poll::Ready(Ok(())),
                Poll::Ready(Ok(())) => linger.left = linger.left.saturating_sub(buf.filled().len()),
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// A connection's service: hands each request its connection's [`Activity`], which
/// [`hold_connection`] counts it in.
#[derive(Clone)]
pub struct WithActivity<S> {
    inner: S,
    activity: Arc<Activity>,
}

impl<S, B> tower_service::Service<axum::http::Request<B>> for WithActivity<S>
where
    S: tower_service::Service<axum::http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: axum::http::Request<B>) -> S::Future {
        req.extensions_mut().insert(ActivityOf(self.activity.clone()));
        self.inner.call(req)
    }
}

/// The request extension carrying its connection's [`Activity`].
#[derive(Clone)]
struct ActivityOf(Arc<Activity>);

/// The middleware that counts a request in flight on its connection until its answer's
/// body is sent (a stream of events too), so [`IdleAcceptor`] never closes a busy
/// connection.
pub(crate) async fn hold_connection(req: Request, next: Next) -> Response {
    let Some(ActivityOf(activity)) = req.extensions().get::<ActivityOf>().cloned() else {
        return next.run(req).await;
    };
    let held = InFlight::start(activity);
    next.run(req).await.map(|body| Body::new(Held { inner: body, _held: held }))
}

/// An answer's body that keeps its request in flight until it is dropped.
struct Held {
    inner: Body,
    _held: InFlight,
}

impl HttpBody for Held {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The middleware of request bodies: 413 at once for a declared length past what the
/// route reads, and the body's time limits ([`body_deadline`]); a request whose body
/// timed out answers 408, whatever its handler made of the failed read.
pub(crate) async fn limit_bodies(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let http11 = req.version() <= Version::HTTP_11;
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    // Uploads stream their body and check their own (larger) limit.
    if !req.uri().path().starts_with("/v1/uploads") && declared.is_some_and(|n| n > rejection::BODY_LIMIT as u64) {
        let refusal = ApiError {
            code: ErrorCode::TooLarge,
            message: format!("request bodies are limited to {} bytes", rejection::BODY_LIMIT),
            field: None,
        };
        return closing(refusal.into_response(), http11);
    }
    let timed_out = Arc::new(AtomicBool::new(false));
    let ended = Arc::new(AtomicBool::new(req.body().is_end_stream()));
    let timeouts = state.http_timeouts;
    let req = req.map(|body| Body::new(TimedBody::new(body, timeouts, timed_out.clone(), ended.clone())));
    let resp = next.run(req).await;
    if timed_out.load(Ordering::Relaxed) {
        let refusal = ApiError {
            code: ErrorCode::RequestTimeout,
            message: format!(
                "the request body did not arrive in time: no gap may exceed {:?}, and a body may take {:?} plus \
                 {} bytes per second",
                timeouts.body, timeouts.body, timeouts.body_min_rate
            ),
            field: None,
        };
        return closing(refusal.into_response(), http11);
    }
    // A handler that answered before reading the whole body (an upload refused part way):
    // the connection ends with this answer, and the client is told so, or it would send
    // its next request on a connection the server is closing.
    if !ended.load(Ordering::Relaxed) {
        return closing(resp, http11);
    }
    resp
}

/// `resp` with `Connection: close` on HTTP/1 (the unread rest of the body cannot be
/// told from the next request).
fn closing(mut resp: Response, http11: bool) -> Response {
    if http11 {
        resp.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    resp
}

/// Why a request body stopped: it did not arrive in time.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive in time")]
pub struct BodyTimedOut;

/// A request body under [`body_deadline`]: past it, an error (and `timed_out` set).
struct TimedBody {
    inner: Body,
    timeouts: HttpTimeouts,
    start: Instant,
    last: Instant,
    received: u64,
    sleep: Pin<Box<Sleep>>,
    timed_out: Arc<AtomicBool>,
    /// Set once the body has been read to its end.
    ended: Arc<AtomicBool>,
}

impl TimedBody {
    fn new(inner: Body, timeouts: HttpTimeouts, timed_out: Arc<AtomicBool>, ended: Arc<AtomicBool>) -> TimedBody {
        let now = Instant::now();
        let sleep = Box::pin(tokio::time::sleep_until(body_deadline(&timeouts, now, now, 0)));
        TimedBody { inner, timeouts, start: now, last: now, received: 0, sleep, timed_out, ended }
    }
}

impl HttpBody for TimedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    if !data.is_empty() {
                        this.received += data.len() as u64;
                        this.last = Instant::now();
                        let deadline = body_deadline(&this.timeouts, this.start, this.last, this.received);
                        this.sleep.as_mut().reset(deadline);
                    }
                }
                if this.inner.is_end_stream() {
                    this.ended.store(true, Ordering::Relaxed);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => {
                this.ended.store(true, Ordering::Relaxed);
                Poll::Ready(None)
            }
            Poll::Pending => match this.sleep.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    this.timed_out.store(true, Ordering::Relaxed);
                    Poll::Ready(Some(Err(axum::Error::new(BodyTimedOut))))
                }
                Poll::Pending => Poll::Pending,
            },
            other => other,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_has_its_gap_and_its_rate() {
        let t = HttpTimeouts { header: Duration::from_secs(1), body: Duration::from_secs(10), body_min_rate: 1000 };
        let s = Instant::now();
        // Nothing yet: the gap.
        assert_eq!(body_deadline(&t, s, s, 0), s + Duration::from_secs(10));
        // 5 000 bytes by 4 s: the gap from then, within the allowance (10 + 5 s).
        let last = s + Duration::from_secs(4);
        assert_eq!(body_deadline(&t, s, last, 5_000), s + Duration::from_secs(14));
        // 5 000 bytes, the last at 9 s: the rate's allowance ends first.
        let last = s + Duration::from_secs(9);
        assert_eq!(body_deadline(&t, s, last, 5_000), s + Duration::from_secs(15));
    }
}
