//! The live page of a coordinator, its JSON API and its Prometheus metrics, served
//! over HTTP/1 next to the coordinator (`rallypoint serve --http`, `rallypoint
//! launch --http`):
//!
//! - `/`: one page, with its script and style inside it (no build step, nothing
//!   fetched from elsewhere): the jobs, each job's ranks as a grid of coloured
//!   cells, the barriers and collectives being waited in, key waits, what is known
//!   of torch processes, the launcher's workers and grouped stacks when present. It
//!   polls `/api/status` every second;
//! - `/api/status?job=NAME`: the document `rallypoint status --json` prints
//!   (`rallypoint_core::snapshot::StatusDocument`, docs/STATUS.md);
//! - `/metrics`: Prometheus metrics, in the OpenMetrics text format (module
//!   `metrics`, docs/METRICS.md);
//! - `/login?token=TOKEN`: with a token, sets the cookie that lets a browser in.
//!
//! # What it may cost the coordinator
//!
//! Nothing a client does reaches the engine but through [`Cache`]: one snapshot per
//! job (and one set of metrics) per refresh period, made by one task at a time off
//! the runtime's threads, whatever the number of clients; everything else (auth,
//! encoding, writing) is the HTTP connection's own work. Connections are limited in
//! number ([`HttpConfig::max_connections`]; past it a new one is closed at once),
//! must send their request headers in time, and are closed when they stop moving
//! (module `io`). A refused request (no or a wrong token) is answered before
//! anything is looked up.
//!
//! # Who may look
//!
//! Like the native listener: on a loopback address anything local may connect; on
//! another address a token is required unless `insecure` says otherwise. With a
//! token (the coordinator's own), every request must carry it: `Authorization:
//! Bearer TOKEN`, or the cookie `/login?token=TOKEN` sets (an HMAC of the token, so
//! the cookie is not the token). Compared in constant time. A page on loopback
//! only answers requests that name it by address or as `localhost`, so that a web
//! page elsewhere cannot reach it through a DNS name that points at 127.0.0.1.

mod io;
mod metrics;

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use hmac::{Hmac, Mac};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use rallypoint_core::snapshot::{LauncherView, StacksView, StatusDocument, STATUS_SCHEMA};
use rallypoint_net::sync::lock;
use rallypoint_net::warn_limit::{admit_shared, WarnLimit};
use rallypoint_server::{Observer, Token};
use serde::Deserialize;
use sha2::Sha256;
use subtle::ConstantTimeEq;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, Semaphore};
use tokio::task::{JoinHandle, JoinSet};
use tracing::{debug, info, warn};

/// How long a status document or the metrics are served before they are made again.
const REFRESH: Duration = Duration::from_millis(500);
/// Jobs whose documents are kept at once (a client asking for many costs no more).
const CACHED_JOBS: usize = 64;
/// The name of the cookie `/login` sets.
const COOKIE: &str = "rallypoint_session";

/// The page: HTML with its style and script put in at build time.
const PAGE_HTML: &str = include_str!("page/index.html");
const PAGE_CSS: &str = include_str!("page/page.css");
const PAGE_JS: &str = include_str!("page/page.js");

#[derive(Debug, Clone)]
pub struct HttpConfig {
    /// Where to listen, exactly as given (port 0: a free one).
    pub listen: SocketAddr,
    /// Every request must carry this token (see the crate docs).
    pub token: Option<Arc<Token>>,
    /// Serve beyond loopback without a token.
    pub insecure: bool,
    /// Connections served at once; more are closed as they come.
    pub max_connections: usize,
    /// A client must send its request headers within this.
    pub header_timeout: Duration,
    /// A connection that neither sends nor takes a byte for this long is closed.
    pub stall_timeout: Duration,
}

impl HttpConfig {
    pub const DEFAULT_MAX_CONNECTIONS: usize = 64;
    pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
    pub const DEFAULT_STALL_TIMEOUT: Duration = Duration::from_secs(30);

    pub fn new(listen: SocketAddr, token: Option<Arc<Token>>) -> HttpConfig {
        HttpConfig {
            listen,
            token,
            insecure: false,
            max_connections: Self::DEFAULT_MAX_CONNECTIONS,
            header_timeout: Self::DEFAULT_HEADER_TIMEOUT,
            stall_timeout: Self::DEFAULT_STALL_TIMEOUT,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error(
        "refusing to serve the live page on {addr}, beyond this machine, without a token: anyone who can reach it \
         could read every job's state; give the coordinator a token (--token-file, RALLYPOINT_TOKEN_FILE or \
         RALLYPOINT_TOKEN), listen on 127.0.0.1, or pass --insecure"
    )]
    Exposed { addr: SocketAddr },
    #[error("cannot listen on {addr} for the live page: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
}

/// What a launcher adds to the page: its workers and, once captured, their stacks.
#[derive(Debug, Default)]
pub struct Panel {
    launcher: Mutex<Option<LauncherView>>,
    stacks: Mutex<Option<StacksView>>,
}

impl Panel {
    pub fn set_launcher(&self, view: LauncherView) {
        *lock(&self.launcher) = Some(view);
    }

    pub fn set_stacks(&self, stacks: StacksView) {
        *lock(&self.stacks) = Some(stacks);
    }

    fn launcher(&self) -> Option<LauncherView> {
        lock(&self.launcher).clone()
    }

    fn stacks(&self) -> Option<StacksView> {
        lock(&self.stacks).clone()
    }
}

/// A bound, not yet serving, HTTP server.
pub struct HttpServer {
    listener: TcpListener,
    local_addr: SocketAddr,
    app: Arc<App>,
    max_connections: usize,
    header_timeout: Duration,
    stall_timeout: Duration,
}

struct App {
    observer: Observer,
    panel: Option<Arc<Panel>>,
    token: Option<Arc<Token>>,
    /// The cookie value a logged-in browser sends back.
    cookie: Option<String>,
    /// Requests must name the server by address or as localhost (see the crate docs).
    check_host: bool,
    cache: Cache,
}

impl HttpServer {
    /// Binds `config.listen` for `observer`'s coordinator (and `panel`'s launcher).
    /// Refuses an address beyond loopback without a token unless `insecure`.
    /// Call it within a tokio runtime (the listener is registered with it).
    pub fn bind(config: HttpConfig, observer: Observer, panel: Option<Arc<Panel>>) -> Result<HttpServer, HttpError> {
        let loopback = config.listen.ip().is_loopback();
        if !loopback && config.token.is_none() && !config.insecure {
            return Err(HttpError::Exposed { addr: config.listen });
        }
        let bind_error = |source| HttpError::Bind { addr: config.listen, source };
        let listener = std::net::TcpListener::bind(config.listen).map_err(bind_error)?;
        listener.set_nonblocking(true).map_err(bind_error)?;
        let listener = TcpListener::from_std(listener).map_err(bind_error)?;
        let local_addr = listener.local_addr().map_err(bind_error)?;
        let cookie = config.token.as_deref().map(cookie_value);
        let app = App { observer, panel, token: config.token, cookie, check_host: loopback, cache: Cache::default() };
        Ok(HttpServer {
            listener,
            local_addr,
            app: Arc::new(app),
            max_connections: config.max_connections.max(1),
            header_timeout: config.header_timeout,
            stall_timeout: config.stall_timeout,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The page's address, for a person to open.
    pub fn url(&self) -> String {
        format!("http://{}/", self.local_addr)
    }

    /// Serves until `shutdown` completes.
    pub async fn run_until(self, shutdown: impl Future<Output = ()>) {
        let HttpServer { listener, local_addr, app, max_connections, header_timeout, stall_timeout } = self;
        let router = Router::new()
            .route("/", get(page))
            .route("/api/status", get(status))
            .route("/metrics", get(metrics_text))
            .route("/login", get(login))
            .fallback(not_found)
            .with_state(Arc::clone(&app));
        let slots = Arc::new(Semaphore::new(max_connections));
        let mut connections = JoinSet::new();
        info!(%local_addr, auth = app.token.is_some(), "live page listening");
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                accepted = listener.accept() => {
                    let (stream, peer) = match accepted {
                        Ok(accepted) => accepted,
                        Err(error) => {
                            debug!(%error, "live page: accept failed");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            continue;
                        }
                    };
                    let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
                        if let Some(held_back) = admit_shared(&REFUSALS) {
                            warn!(%peer, max_connections, held_back, "live page: too many connections; closing a new one");
                        }
                        continue;
                    };
                    let _ = stream.set_nodelay(true);
                    let service = TowerToHyperService::new(router.clone());
                    connections.spawn(async move {
                        let _slot = slot;
                        let io = TokioIo::new(io::Stalling::new(stream, stall_timeout));
                        let mut http = hyper::server::conn::http1::Builder::new();
                        http.timer(TokioTimer::new()).header_read_timeout(header_timeout).max_buf_size(64 * 1024);
                        if let Err(error) = http.serve_connection(io, service).await {
                            debug!(%peer, %error, "live page: connection ended");
                        }
                    });
                }
                Some(_) = connections.join_next() => {}
            }
        }
        connections.shutdown().await;
        info!(%local_addr, "live page stopped");
    }

    /// Serves in the background; dropping the handle stops it.
    #[must_use = "dropping the handle stops the server"]
    pub fn spawn(self) -> HttpHandle {
        let (stop, stopped) = oneshot::channel::<()>();
        let local_addr = self.local_addr;
        let app = Arc::clone(&self.app);
        let task = tokio::spawn(self.run_until(async move {
            let _ = stopped.await;
        }));
        HttpHandle { local_addr, app, _stop: stop, task }
    }
}

/// A server running in the background (see [`HttpServer::spawn`]).
pub struct HttpHandle {
    local_addr: SocketAddr,
    app: Arc<App>,
    _stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl HttpHandle {
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// How many times the server looked at the coordinator (status documents and
    /// metrics made): what its clients cost the coordinator, whatever their number.
    pub fn lookups(&self) -> u64 {
        self.app.cache.lookups.load(Ordering::Relaxed)
    }

    /// Stops serving and waits until every connection is closed.
    pub async fn shutdown(self) {
        let HttpHandle { _stop, task, .. } = self;
        drop(_stop);
        let _ = task.await;
    }
}

static REFUSALS: std::sync::Mutex<WarnLimit> = std::sync::Mutex::new(WarnLimit::new());

/// The cookie value for `token`: an HMAC of it, so that the cookie is not the token.
fn cookie_value(token: &Token) -> String {
    let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(token.secret()) else { return String::new() };
    mac.update(b"rallypoint live page session");
    mac.finalize().into_bytes().iter().map(|b| format!("{b:02x}")).collect()
}

/// Why a request is not served.
enum Refusal {
    /// No or a wrong token.
    Unauthorized,
    /// A loopback page asked for under a DNS name.
    Host,
}

impl App {
    fn admit(&self, headers: &HeaderMap) -> Result<(), Refusal> {
        if self.check_host && !host_is_local(headers) {
            return Err(Refusal::Host);
        }
        let (Some(token), Some(cookie)) = (&self.token, &self.cookie) else { return Ok(()) };
        let bearer = headers
            .get_all(header::AUTHORIZATION)
            .iter()
            .filter_map(|v| v.to_str().ok()?.strip_prefix("Bearer ").map(str::trim))
            .any(|given| bool::from(given.as_bytes().ct_eq(token.secret())));
        let cookie = headers
            .get_all(header::COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(';'))
            .filter_map(|pair| pair.trim().strip_prefix(COOKIE)?.strip_prefix('='))
            .any(|given| bool::from(given.as_bytes().ct_eq(cookie.as_bytes())));
        if bearer || cookie {
            Ok(())
        } else {
            Err(Refusal::Unauthorized)
        }
    }

    /// The job a request without `?job=` is shown: the launcher's attempt, else
    /// the TCPStore clients' job if it exists, else the first job that is not a
    /// launchers' one, else the first.
    fn default_job(&self, jobs: &[String]) -> Option<String> {
        if let Some(view) = self.panel.as_ref().and_then(|p| p.launcher()) {
            return Some(view.attempt_job);
        }
        let tcpstore = self.observer.tcpstore_job();
        if jobs.contains(&tcpstore) {
            return Some(tcpstore);
        }
        jobs.iter().find(|j| !j.ends_with("/launch")).or(jobs.first()).cloned()
    }

    /// The status document of `job` (or the default one), as JSON.
    fn document(&self, job: Option<&str>) -> String {
        let (jobs, jobs_complete) = self.observer.jobs();
        let job = job.map(str::to_owned).or_else(|| self.default_job(&jobs));
        let document = StatusDocument {
            schema: STATUS_SCHEMA,
            coordinator: self.observer.local_addr().to_string(),
            generated_unix_ms: unix_ms(),
            jobs,
            jobs_complete,
            job: job.and_then(|job| self.observer.snapshot(&job)),
            launcher: self.panel.as_ref().and_then(|p| p.launcher()),
            stacks: self.panel.as_ref().and_then(|p| p.stacks()),
        };
        serde_json::to_string(&document).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }
}

/// Whether the request's Host names the server by IP address or as localhost.
fn host_is_local(headers: &HeaderMap) -> bool {
    let Some(host) = headers.get(header::HOST).and_then(|h| h.to_str().ok()) else { return false };
    let name = match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or_default(),
        None => host.rsplit_once(':').map_or(host, |(name, _)| name),
    };
    name.eq_ignore_ascii_case("localhost") || name.parse::<IpAddr>().is_ok()
}

fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Status documents and metrics, made at most once per [`REFRESH`] whatever the
/// number of clients, by one task at a time, off the runtime's threads.
/// A document made at some time, by the job it was asked for (`None`: the default).
type Documents = HashMap<Option<String>, (Instant, Arc<str>)>;

#[derive(Default)]
struct Cache {
    documents: Mutex<Documents>,
    metrics: Mutex<Option<(Instant, Arc<str>)>>,
    /// Held while something is made: requests meanwhile wait, then find it made.
    making: tokio::sync::Mutex<()>,
    /// Documents and metrics made so far.
    lookups: AtomicU64,
}

impl Cache {
    async fn document(app: &Arc<App>, job: Option<String>) -> Arc<str> {
        let fresh = |app: &App| {
            let documents = lock(&app.cache.documents);
            documents.get(&job).filter(|(at, _)| at.elapsed() < REFRESH).map(|(_, doc)| Arc::clone(doc))
        };
        if let Some(doc) = fresh(app) {
            return doc;
        }
        let _making = app.cache.making.lock().await;
        if let Some(doc) = fresh(app) {
            return doc;
        }
        app.cache.lookups.fetch_add(1, Ordering::Relaxed);
        let made = {
            let (app, job) = (Arc::clone(app), job.clone());
            tokio::task::spawn_blocking(move || Arc::<str>::from(app.document(job.as_deref()))).await
        };
        let doc = made.unwrap_or_else(|e| Arc::from(format!("{{\"error\":\"{e}\"}}")));
        let mut documents = lock(&app.cache.documents);
        if documents.len() >= CACHED_JOBS {
            documents.retain(|_, (at, _)| at.elapsed() < REFRESH);
            if documents.len() >= CACHED_JOBS {
                documents.clear();
            }
        }
        documents.insert(job, (Instant::now(), Arc::clone(&doc)));
        doc
    }

    async fn metrics(app: &Arc<App>) -> Arc<str> {
        let fresh = |app: &App| {
            lock(&app.cache.metrics).as_ref().filter(|(at, _)| at.elapsed() < REFRESH).map(|(_, m)| Arc::clone(m))
        };
        if let Some(text) = fresh(app) {
            return text;
        }
        let _making = app.cache.making.lock().await;
        if let Some(text) = fresh(app) {
            return text;
        }
        app.cache.lookups.fetch_add(1, Ordering::Relaxed);
        let made = {
            let app = Arc::clone(app);
            tokio::task::spawn_blocking(move || Arc::<str>::from(metrics::render(&app.observer.metrics()))).await
        };
        let text = made.unwrap_or_else(|e| Arc::from(format!("# the metrics could not be made: {e}\n# EOF\n")));
        *lock(&app.cache.metrics) = Some((Instant::now(), Arc::clone(&text)));
        text
    }
}

type AppState = State<Arc<App>>;

#[derive(Deserialize)]
struct JobQuery {
    job: Option<String>,
}

#[derive(Deserialize)]
struct LoginQuery {
    token: Option<String>,
}

/// A response that is never cached and never sniffed.
fn respond(status: StatusCode, content_type: &'static str, body: impl Into<axum::body::Body>) -> Response {
    let mut response = (status, body.into()).into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    response
}

fn refused(refusal: Refusal, html: bool) -> Response {
    match refusal {
        Refusal::Host => respond(
            StatusCode::MISDIRECTED_REQUEST,
            "text/plain; charset=utf-8",
            "this page answers only requests naming it by IP address or as localhost\n",
        ),
        Refusal::Unauthorized => {
            let (content_type, body) = if html {
                ("text/html; charset=utf-8", UNAUTHORIZED_HTML)
            } else {
                (
                    "text/plain; charset=utf-8",
                    "no token, or a wrong one: send the coordinator's token as Authorization: Bearer TOKEN\n",
                )
            };
            let mut response = respond(StatusCode::UNAUTHORIZED, content_type, body);
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer realm=\"rallypoint\""));
            response
        }
    }
}

const UNAUTHORIZED_HTML: &str = "<!doctype html><meta charset=utf-8><title>rallypoint: log in</title>\
<p>This coordinator has a token. Open <code>/login?token=TOKEN</code> with it (the token of the job: the file \
<code>RALLYPOINT_TOKEN_FILE</code> names, or what <code>--token-file</code> was given), or send \
<code>Authorization: Bearer TOKEN</code>.</p>";

async fn page(State(app): AppState, headers: HeaderMap) -> Response {
    if let Err(refusal) = app.admit(&headers) {
        return refused(refusal, true);
    }
    static PAGE: std::sync::LazyLock<String> =
        std::sync::LazyLock::new(|| PAGE_HTML.replace("/*PAGE_CSS*/", PAGE_CSS).replace("/*PAGE_JS*/", PAGE_JS));
    let mut response = respond(StatusCode::OK, "text/html; charset=utf-8", PAGE.as_str());
    // Nothing but what the page itself holds, and its own API.
    response.headers_mut().insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; \
             img-src data:; frame-ancestors 'none'",
        ),
    );
    response
}

async fn status(State(app): AppState, headers: HeaderMap, Query(query): Query<JobQuery>) -> Response {
    if let Err(refusal) = app.admit(&headers) {
        return refused(refusal, false);
    }
    let doc = Cache::document(&app, query.job.filter(|j| !j.is_empty())).await;
    respond(StatusCode::OK, "application/json", doc.to_string())
}

async fn metrics_text(State(app): AppState, headers: HeaderMap) -> Response {
    if let Err(refusal) = app.admit(&headers) {
        return refused(refusal, false);
    }
    let text = Cache::metrics(&app).await;
    respond(StatusCode::OK, "application/openmetrics-text; version=1.0.0; charset=utf-8", text.to_string())
}

async fn login(State(app): AppState, headers: HeaderMap, Query(query): Query<LoginQuery>) -> Response {
    if app.check_host && !host_is_local(&headers) {
        return refused(Refusal::Host, true);
    }
    let (Some(token), Some(cookie)) = (&app.token, &app.cookie) else {
        return redirect_home(None);
    };
    let given = query.token.unwrap_or_default();
    if !bool::from(given.trim().as_bytes().ct_eq(token.secret())) {
        return refused(Refusal::Unauthorized, true);
    }
    redirect_home(Some(cookie))
}

/// To the page, setting the session cookie if given.
fn redirect_home(cookie: Option<&str>) -> Response {
    let mut response = respond(StatusCode::SEE_OTHER, "text/plain; charset=utf-8", "");
    let headers = response.headers_mut();
    headers.insert(header::LOCATION, HeaderValue::from_static("/"));
    if let Some(cookie) = cookie {
        if let Ok(value) = HeaderValue::from_str(&format!("{COOKIE}={cookie}; Path=/; HttpOnly; SameSite=Strict")) {
            headers.insert(header::SET_COOKIE, value);
        }
    }
    response
}

async fn not_found() -> Response {
    respond(
        StatusCode::NOT_FOUND,
        "text/plain; charset=utf-8",
        "not found: the page is /, its data /api/status?job=NAME, the metrics /metrics\n",
    )
}
