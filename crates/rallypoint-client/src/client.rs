//! The async client.
//!
//! A [`Client`] is one connection to the coordinator, shared by all its clones:
//! calls from many tasks pipeline over it, and a background task sends
//! heartbeats between calls so that the coordinator knows the process is alive.
//!
//! A cut connection is resumed: the client reconnects and re-sends what it has no
//! reply for, and the coordinator runs nothing twice (see `connection`).
//!
//! Closing: [`Client::close`] tells the coordinator that this rank leaves cleanly.
//! Dropping the last clone without `close` drops the connection abruptly, exactly
//! as if the process had been killed: if it was the rank's last connection, the
//! coordinator considers the rank lost and fails whatever its peers wait for with
//! [`crate::OpError::PeerLost`].

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use rallypoint_core::snapshot::JobSnapshot;
use rallypoint_core::{Exit, Gathered, Identity, Members, OpError, Request, Response};
use tokio::sync::{mpsc, oneshot};

use rallypoint_net::auth::Token;
use rallypoint_net::conn::Credentials;
use rallypoint_net::sync::lock;
use rallypoint_net::tls::TlsClient;

use crate::channel;
use crate::connection::{self, Command, DirectWrite, Link, Redial};
use crate::error::Error;

/// How long to keep retrying to connect, and how long blocking operations wait
/// when the caller gives no timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Extra time the client waits beyond an operation's timeout before giving up on
/// the coordinator's reply (the coordinator's own timeout error normally comes first).
const SAFETY_MARGIN: Duration = Duration::from_secs(5);

/// How long [`Client::close`] waits for the coordinator to confirm the leave.
pub const LEAVE_WAIT: Duration = Duration::from_secs(2);

/// What [`Client::barrier_in_thread`] came to.
pub enum InThread {
    /// The call ended in the caller's thread.
    Done(Result<(), Error>),
    /// The round ended, and its outcome (an error) comes on the socket: await
    /// [`BarrierConclusion::finish`] on the client's runtime.
    Conclude(BarrierConclusion),
    /// This client holds no channel seat for the barrier (yet: through a node agent,
    /// a barrier's second call asks for one): make the call with [`Client::barrier`].
    Elsewhere,
    /// The interrupt said to give up: the call is abandoned as an async call dropped
    /// mid-wait is (its seat goes back to the agent; the next call asks for another).
    Interrupted,
}

/// A barrier through a channel whose outcome comes on the socket ([`InThread::Conclude`]).
pub struct BarrierConclusion {
    client: Client,
    concluding: channel::Concluding,
}

impl BarrierConclusion {
    pub async fn finish(self) -> Result<(), Error> {
        let outcome = self.concluding.finish().await;
        self.client.barrier_ended(&outcome);
        outcome.map_err(|error| self.client.seen(error))
    }
}

#[derive(Debug, Clone)]
pub struct ConnectOptions {
    /// `host:port` of the coordinator.
    pub addr: String,
    /// Who this client is. An empty `host` is filled with this machine's hostname,
    /// a zero `pid` with this process's id, and a missing incarnation with this
    /// process's ([`crate::process_incarnation`]).
    pub identity: Identity,
    /// How long connecting retries, and the default timeout of blocking operations.
    pub timeout: Duration,
    /// Over a Unix socket (to this node's agent), take large replies (all-gather
    /// results, large values) as shared memory mapped read-only instead of copied
    /// through the socket (docs/PROTOCOL.md, section 13). Ignored over TCP.
    pub shared_replies: bool,
    /// Over a Unix socket (to this node's agent), synchronise barriers through shared
    /// memory with the agent instead of messages where it gives a channel
    /// (docs/PROTOCOL.md, section 15). Ignored over TCP.
    pub barrier_channels: bool,
    /// The token to prove (the coordinator must prove it too), and the CA that
    /// signed the coordinator's TLS certificate: neither by default.
    pub credentials: Credentials,
}

impl ConnectOptions {
    /// Options with the default timeout of 300 s, taking shared replies, with no
    /// token and no TLS ([`crate::env::Settings`] reads them from the environment).
    pub fn new(addr: impl Into<String>, identity: Identity) -> Self {
        ConnectOptions {
            addr: addr.into(),
            identity,
            timeout: DEFAULT_TIMEOUT,
            shared_replies: true,
            barrier_channels: std::env::var_os("RALLYPOINT_NO_BARRIER_CHANNELS").is_none(),
            credentials: Credentials::default(),
        }
    }

    /// These options with another connect (and default operation) timeout.
    pub fn with_timeout(self, timeout: Duration) -> Self {
        ConnectOptions { timeout, ..self }
    }

    /// These options proving `token` (or none).
    pub fn with_token(mut self, token: Option<Arc<Token>>) -> Self {
        self.credentials.token = token;
        self
    }

    /// These options over TLS, trusting `tls`'s CA for the coordinator's certificate (or plaintext).
    pub fn with_tls(mut self, tls: Option<TlsClient>) -> Self {
        self.credentials.tls = tls;
        self
    }
}

/// A connection to the coordinator; cheap to clone and share between tasks.
///
/// Its heartbeats are a task on the runtime it was made in: synchronous work that
/// holds every thread of that runtime (a current-thread runtime, a long computation
/// outside `spawn_blocking`) for a whole lease stops them, and the coordinator then
/// declares this rank lost. Run such work with `spawn_blocking`, or use
/// [`crate::blocking::Client`], whose heartbeats have a thread of their own.
///
/// Call [`Client::close`] when done. Dropping the last clone without it drops the
/// connection as a crash would: the coordinator then reports this rank as lost
/// (if it has no other connection) to everyone waiting for it. That is intended:
/// it is what makes a killed process visible at once.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

/// Who it is and where it is connected (`Client { addr: "10.0.0.1:29500", job:
/// "run42", rank: Some(3), session: 12 }`): what a `{:?}` of a result holding one,
/// or `dbg!`, shows.
impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let identity = &self.inner.identity;
        f.debug_struct("Client")
            .field("addr", &self.inner.link.addr())
            .field("job", &identity.job)
            .field("rank", &identity.rank)
            .field("session", &self.session().0)
            .finish()
    }
}

/// What every call reads first, in one cache line (see [`Link`]).
#[repr(C, align(64))]
struct Inner {
    link: Arc<Link>,
    timeout: Duration,
    commands: mpsc::UnboundedSender<Command>,
    /// A call found the coordinator silent (no reply within its timeout).
    silent: AtomicBool,
    /// Barriers may go through shared memory with the node agent (module `channel`).
    barrier_channels: bool,
    identity: Identity,
}

/// Forgets a call's reply slot if the call stops waiting before its reply
/// (the caller's future dropped, or the request not handed over).
pub(crate) struct Registered<'a> {
    pub(crate) link: &'a Link,
    pub(crate) id: u64,
    /// Its slot was filled (or dropped): the link has already forgotten the call.
    pub(crate) settled: bool,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        if !self.settled {
            self.link.unregister(self.id);
        }
    }
}

/// A barrier's future ([`Client::barrier`]), written out rather than an `async fn`:
/// a generator would keep its arguments (the name, the members) beside the call's
/// state for the whole wait, and a rank awaits one of these every round, so each
/// round would touch that much more memory. This one holds one state at a time.
pub(crate) struct BarrierCall<'a> {
    client: &'a Client,
    state: BarrierState<'a>,
}

/// The channel's part of a barrier: its outcome, or `None` (and the request back)
/// when the barrier goes through messages.
///
/// `Sync` as well as `Send`, as the `async fn` it replaced was: a caller may hold the
/// barrier's future by reference across an await.
type ThroughChannel<'a> = Pin<Box<dyn Future<Output = (Option<Result<(), Error>>, Request)> + Send + Sync + 'a>>;

enum BarrierState<'a> {
    /// Not polled yet: nothing is sent until it is.
    Start {
        name: &'a str,
        members: Members,
        timeout: Option<Duration>,
        waiting: channel::Waiting,
    },
    /// Through the node agent's barrier channel. Boxed: its future is large, and
    /// only ranks behind an agent take it.
    Channel {
        through: ThroughChannel<'a>,
        wait: Duration,
    },
    /// Sent as a request; waiting for its reply. (Dropped in this order, as an
    /// `async fn` drops them: the wait, then the call.)
    Call {
        reply: connection::WaitReply<'a>,
        registered: Registered<'a>,
    },
    Done,
}

impl<'a> BarrierState<'a> {
    /// Sends the barrier as a request: the state that waits for its reply.
    fn send(client: &'a Client, request: Request, wait: Duration) -> Result<Self, Error> {
        let (registered, reply) = client.send_call(request, wait.saturating_add(SAFETY_MARGIN)).map_err(|e| *e)?;
        let reply = connection::WaitReply::new(registered.link, registered.id, reply);
        Ok(BarrierState::Call { reply, registered })
    }
}

impl Future for BarrierCall<'_> {
    type Output = Result<(), Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let client = this.client;
        loop {
            let next = match &mut this.state {
                BarrierState::Start { .. } => {
                    let BarrierState::Start { name, members, timeout, waiting } =
                        std::mem::replace(&mut this.state, BarrierState::Done)
                    else {
                        unreachable!("matched above")
                    };
                    let (timeout_ms, wait) = client.blocking_timeout(timeout);
                    let request = Request::Barrier { name: name.into(), members, timeout_ms };
                    if client.inner.barrier_channels {
                        let caller = channel::Caller { link: &client.inner.link, commands: &client.inner.commands };
                        let limit = wait.saturating_add(SAFETY_MARGIN);
                        // It owns the request and gives it back, so that this future
                        // keeps no copy of it while the call below waits.
                        let through: ThroughChannel<'_> = Box::pin(async move {
                            let done = channel::barrier(caller, &request, limit, waiting).await;
                            (done, request)
                        });
                        BarrierState::Channel { through, wait }
                    } else {
                        BarrierState::send(client, request, wait)?
                    }
                }
                BarrierState::Channel { through, wait } => {
                    let wait = *wait;
                    let (done, request) = std::task::ready!(through.as_mut().poll(cx));
                    if let Some(done) = done {
                        this.state = BarrierState::Done;
                        client.barrier_ended(&done);
                        return Poll::Ready(done.map_err(|error| client.seen(error)));
                    }
                    BarrierState::send(client, request, wait)?
                }
                BarrierState::Call { reply, registered } => {
                    let received = std::task::ready!(Pin::new(reply).poll(cx));
                    let result = client.received(registered, received);
                    this.state = BarrierState::Done;
                    return Poll::Ready(match result? {
                        Response::Done => Ok(()),
                        other => Err(unexpected("barrier", other)),
                    });
                }
                BarrierState::Done => panic!("a barrier's future was polled after it completed"),
            };
            this.state = next;
        }
    }
}

fn bytes(b: impl AsRef<[u8]>) -> Bytes {
    Bytes::copy_from_slice(b.as_ref())
}

fn key_list(keys: &[impl AsRef<[u8]>]) -> Vec<Bytes> {
    keys.iter().map(bytes).collect()
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn unexpected(op: &str, response: Response) -> Error {
    Error::Protocol(format!("unexpected reply to {op}: {response:?}"))
}

impl Client {
    /// Connects with the default timeout (300 s), retrying until the coordinator listens.
    pub async fn connect(addr: &str, identity: Identity) -> Result<Client, Error> {
        Client::connect_with(ConnectOptions::new(addr, identity)).await
    }

    pub async fn connect_with(options: ConnectOptions) -> Result<Client, Error> {
        Client::connect_noting(options, None).await
    }

    /// Connects as [`Client::connect_with`] does, calling `waiting` after a second,
    /// and then now and again (at 1, 3, 7, 15 s, ..., then every 30 s), with a line
    /// saying that it is still trying and why its last attempt failed: a process
    /// waiting for a coordinator that is not up yet, or at a wrong address, looks
    /// hung otherwise.
    pub async fn connect_saying(options: ConnectOptions, mut waiting: impl FnMut(String)) -> Result<Client, Error> {
        let (addr, limit) = (options.addr.clone(), options.timeout.as_secs());
        let failed = Mutex::new(None);
        let connecting = Client::connect_noting(options, Some(&failed));
        tokio::pin!(connecting);
        let started = tokio::time::Instant::now();
        let mut pause = Duration::from_secs(1);
        loop {
            tokio::select! {
                connected = &mut connecting => return connected,
                () = tokio::time::sleep_until(started + pause) => {
                    let waited = started.elapsed().as_secs();
                    let why = lock(&failed).clone();
                    let why = why.map(|why| format!(": {why}")).unwrap_or_default();
                    waiting(format!("rallypoint: waiting for the coordinator at {addr} ({waited} s of {limit} s){why}"));
                    // Reassuring, not flooding.
                    pause = (pause * 2 + Duration::from_secs(1)).min(pause + Duration::from_secs(30));
                }
            }
        }
    }

    /// [`Client::connect_with`], noting in `failed` why each failed attempt failed.
    async fn connect_noting(options: ConnectOptions, failed: Option<&Mutex<Option<String>>>) -> Result<Client, Error> {
        let ConnectOptions { addr, mut identity, timeout, shared_replies, barrier_channels, credentials } = options;
        rallypoint_net::check_addr(&addr).map_err(|why| Error::Config(format!("coordinator address {why}")))?;
        if identity.host.is_empty() {
            identity.host = rallypoint_net::hostname();
        }
        if identity.pid == 0 {
            identity.pid = std::process::id();
        }
        identity.incarnation = identity.incarnation.or_else(|| Some(crate::process_incarnation()));
        identity.resume = None;
        let connected = connection::connect(&addr, &identity, timeout, shared_replies, &credentials, failed).await?;
        let redial = Redial { identity: identity.clone(), shared_replies, timeout, credentials };
        // Only a node agent of this machine, over a Unix socket, can share memory.
        let barrier_channels = barrier_channels && rallypoint_net::unix_path(&addr).is_some();
        let (link, commands) = connection::spawn(addr, connected, redial);
        let inner = Inner { identity, timeout, link, commands, silent: AtomicBool::new(false), barrier_channels };
        Ok(Client { inner: Arc::new(inner) })
    }

    /// Connects with settings from the environment (see [`crate::env::Settings`]).
    pub async fn from_env() -> Result<Client, Error> {
        let settings = crate::env::Settings::from_env()?;
        Client::connect_with(settings.connect_options()).await
    }

    pub fn identity(&self) -> &Identity {
        &self.inner.identity
    }

    /// The session the coordinator gave this client (another one after a cut
    /// connection the coordinator could not resume).
    pub fn session(&self) -> rallypoint_core::SessionId {
        self.inner.link.welcome().session
    }

    /// The incarnation the job was at when this client (last) said hello; `None` if
    /// the job was never reset and no process named one.
    pub fn job_incarnation(&self) -> Option<u64> {
        self.inner.link.welcome().job_incarnation
    }

    /// How often the client tells the coordinator it lives between calls; `None`: the
    /// coordinator keeps no lease, and no heartbeat goes.
    pub fn heartbeat_period(&self) -> Option<Duration> {
        connection::heartbeat_period(self.inner.link.welcome().lease_ms)
    }

    /// The connect timeout, which is also the default timeout of blocking operations.
    pub fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    #[cfg(test)]
    pub(crate) fn link(&self) -> &Arc<Link> {
        &self.inner.link
    }

    /// Sends one request and waits for its reply, at most `wait` plus a safety margin.
    ///
    /// Not an `async fn`, nor `call_now`: each level of `async fn` would keep its
    /// own copy of the request in the future, which every call moves and touches.
    fn call(&self, request: Request, wait: Duration) -> impl Future<Output = Result<Response, Error>> + '_ {
        self.call_within(request, wait.saturating_add(SAFETY_MARGIN))
    }

    /// Sends one request and waits for its reply at most `limit`. The request is
    /// registered and written before the future is returned, so that the future
    /// holds no copy of it while it waits (see [`Client::call`]).
    fn call_within(&self, request: Request, limit: Duration) -> impl Future<Output = Result<Response, Error>> + '_ {
        let sent = self.send_call(request, limit);
        async move {
            let (mut registered, reply) = sent.map_err(|error| *error)?;
            let received = connection::WaitReply::new(registered.link, registered.id, reply).await;
            self.received(&mut registered, received)
        }
    }

    /// What a call's wait for its reply gave, as the call's result.
    fn received(&self, registered: &mut Registered<'_>, received: connection::Received) -> Result<Response, Error> {
        // Whoever filled or dropped the slot took the call out of the link's map.
        registered.settled = true;
        match received {
            Ok(Err(Error::Timeout(limit))) => {
                self.inner.silent.store(true, Ordering::Relaxed);
                Err(Error::Timeout(limit))
            }
            Ok(result) => result.map_err(|error| self.seen(error)),
            Err(_) => Err(registered.link.disconnected()),
        }
    }

    /// An error of the coordinator's as this client shows it (see [`OpError::seen_by`]).
    fn seen(&self, error: Error) -> Error {
        match (error, self.inner.identity.rank) {
            (Error::Op(error @ OpError::Mismatch { .. }), Some(rank)) => Error::Op(error.seen_by(rank)),
            (error, _) => error,
        }
    }

    /// Registers a call (the connection task fails it past `limit`, one timer for all
    /// calls) and writes its request, or hands it to the task. The error is boxed:
    /// the call's future holds this result until it is first polled.
    fn send_call(
        &self,
        request: Request,
        limit: Duration,
    ) -> Result<(Registered<'_>, connection::CallReply), Box<Error>> {
        let link = &*self.inner.link;
        let (id, reply, written) = link.call(request, limit)?;
        let registered = Registered { link, id, settled: false };
        let handed = match written {
            DirectWrite::Written => true,
            DirectWrite::Partly => self.inner.commands.send(Command::Flush).is_ok(),
            DirectWrite::Queue(request) => self.inner.commands.send(Command::Request { id, request }).is_ok(),
        };
        if handed {
            Ok((registered, reply))
        } else {
            Err(Box::new(link.disconnected()))
        }
    }

    /// A request that does not block on the coordinator's side.
    fn call_now(&self, request: Request) -> impl Future<Output = Result<Response, Error>> + '_ {
        self.call(request, self.inner.timeout)
    }

    /// The timeout sent with a blocking request, and how long to wait for its reply.
    fn blocking_timeout(&self, timeout: Option<Duration>) -> (Option<u64>, Duration) {
        let timeout = timeout.unwrap_or(self.inner.timeout);
        (Some(millis(timeout)), timeout)
    }

    pub async fn set(&self, key: impl AsRef<[u8]>, value: impl AsRef<[u8]>) -> Result<(), Error> {
        match self.call_now(Request::Set { key: bytes(key), value: bytes(value) }).await? {
            Response::Done => Ok(()),
            other => Err(unexpected("set", other)),
        }
    }

    /// Waits until the key exists (at most `timeout`, `None` = the client's default).
    pub async fn get(&self, key: impl AsRef<[u8]>, timeout: Option<Duration>) -> Result<Bytes, Error> {
        let (timeout_ms, wait) = self.blocking_timeout(timeout);
        match self.call(Request::Get { key: bytes(key), timeout_ms }, wait).await? {
            Response::Value(value) => Ok(value),
            other => Err(unexpected("get", other)),
        }
    }

    /// Adds `delta` to a decimal integer value (a missing key counts as 0); returns the new
    /// value. A value that is not an optional sign and digits fails with
    /// [`crate::OpError::NotANumber`] and is left as it was.
    pub async fn add(&self, key: impl AsRef<[u8]>, delta: i64) -> Result<i64, Error> {
        match self.call_now(Request::Add { key: bytes(key), delta }).await? {
            Response::Int(value) => Ok(value),
            other => Err(unexpected("add", other)),
        }
    }

    /// TCPStore's compare-and-set: sets `desired` if the current value is `expected`
    /// (or the key is missing and `expected` is empty); returns the value now stored,
    /// except for a missing key and a non-empty `expected`, where nothing is stored
    /// and `expected` is returned, as TCPStore does.
    pub async fn compare_set(
        &self,
        key: impl AsRef<[u8]>,
        expected: impl AsRef<[u8]>,
        desired: impl AsRef<[u8]>,
    ) -> Result<Bytes, Error> {
        let request = Request::CompareSet { key: bytes(key), expected: bytes(expected), desired: bytes(desired) };
        match self.call_now(request).await? {
            Response::Value(value) => Ok(value),
            other => Err(unexpected("compare_set", other)),
        }
    }

    pub async fn append(&self, key: impl AsRef<[u8]>, value: impl AsRef<[u8]>) -> Result<(), Error> {
        match self.call_now(Request::Append { key: bytes(key), value: bytes(value) }).await? {
            Response::Done => Ok(()),
            other => Err(unexpected("append", other)),
        }
    }

    /// Deletes a key; returns whether it existed.
    pub async fn delete(&self, key: impl AsRef<[u8]>) -> Result<bool, Error> {
        match self.call_now(Request::Delete { key: bytes(key) }).await? {
            Response::Bool(existed) => Ok(existed),
            other => Err(unexpected("delete", other)),
        }
    }

    /// Whether every key exists, without waiting.
    pub async fn check(&self, keys: &[impl AsRef<[u8]>]) -> Result<bool, Error> {
        match self.call_now(Request::Check { keys: key_list(keys) }).await? {
            Response::Bool(all) => Ok(all),
            other => Err(unexpected("check", other)),
        }
    }

    /// Waits until every key exists.
    pub async fn wait(&self, keys: &[impl AsRef<[u8]>], timeout: Option<Duration>) -> Result<(), Error> {
        let (timeout_ms, wait) = self.blocking_timeout(timeout);
        match self.call(Request::Wait { keys: key_list(keys), timeout_ms }, wait).await? {
            Response::Done => Ok(()),
            other => Err(unexpected("wait", other)),
        }
    }

    /// Waits until every key exists; returns their values in the order asked.
    pub async fn multi_get(&self, keys: &[impl AsRef<[u8]>], timeout: Option<Duration>) -> Result<Vec<Bytes>, Error> {
        let (timeout_ms, wait) = self.blocking_timeout(timeout);
        match self.call(Request::MultiGet { keys: key_list(keys), timeout_ms }, wait).await? {
            Response::Values(values) => Ok(values),
            other => Err(unexpected("multi_get", other)),
        }
    }

    pub async fn multi_set(&self, entries: &[(impl AsRef<[u8]>, impl AsRef<[u8]>)]) -> Result<(), Error> {
        let entries = entries.iter().map(|(k, v)| (bytes(k), bytes(v))).collect();
        match self.call_now(Request::MultiSet { entries }).await? {
            Response::Done => Ok(()),
            other => Err(unexpected("multi_set", other)),
        }
    }

    /// Number of keys in this job's store.
    pub async fn num_keys(&self) -> Result<i64, Error> {
        match self.call_now(Request::NumKeys).await? {
            Response::Int(n) => Ok(n),
            other => Err(unexpected("num_keys", other)),
        }
    }

    /// What the coordinator knows or infers about this job's PyTorch (TCPStore)
    /// processes: ranks seen, ranks missing, waiting connections (docs/TCPSTORE.md).
    pub async fn status(&self) -> Result<String, Error> {
        match self.call_now(Request::Status).await? {
            Response::Value(report) => Ok(String::from_utf8_lossy(&report).into_owned()),
            other => Err(unexpected("status", other)),
        }
    }

    /// The names of the jobs the coordinator holds (at most
    /// [`rallypoint_core::MAX_JOBS_LISTED`]), sorted; this client's own job only if
    /// it holds more than this client (docs/PROTOCOL.md section 6.2).
    pub async fn jobs(&self) -> Result<Vec<String>, Error> {
        match self.call_now(Request::Jobs).await? {
            Response::Values(names) => Ok(names.iter().map(|n| String::from_utf8_lossy(n).into_owned()).collect()),
            other => Err(unexpected("jobs", other)),
        }
    }

    /// This job as data (docs/STATUS.md's `job`): its ranks, who waits where, who is
    /// missing, what is inferred of its PyTorch processes; as seen by everyone but
    /// this client.
    pub async fn snapshot(&self) -> Result<JobSnapshot, Error> {
        match self.call_now(Request::Snapshot).await? {
            Response::Value(json) => serde_json::from_slice(&json)
                .map_err(|e| Error::Protocol(format!("the coordinator's snapshot is not JSON of its schema: {e}"))),
            other => Err(unexpected("snapshot", other)),
        }
    }

    /// Keys starting with `prefix`, sorted.
    pub async fn list_keys(&self, prefix: impl AsRef<[u8]>) -> Result<Vec<Bytes>, Error> {
        match self.call_now(Request::ListKeys { prefix: bytes(prefix) }).await? {
            Response::Values(keys) => Ok(keys),
            other => Err(unexpected("list_keys", other)),
        }
    }

    /// Waits until every member has called the same barrier (the n-th call of a
    /// name meets the other members' n-th call). A barrier is its name and its
    /// members: groups that share a name wait apart. On timeout the error lists
    /// every member that had not arrived and why. The earliest deadline among the
    /// members' calls ends the generation for all of them.
    ///
    /// Not cancel-safe: the arrival is counted once the call is sent, and dropping
    /// the future (`tokio::time::timeout`, a `select!` branch not taken) does not
    /// take it back. The generation may then pass without this caller, whose next
    /// call of the name is the next generation. To do something while waiting, poll
    /// the same future again rather than call again:
    ///
    /// ```no_run
    /// # async fn f(client: rallypoint_client::Client) -> Result<(), rallypoint_client::Error> {
    /// use rallypoint_core::Members;
    /// let mut wait = std::pin::pin!(client.barrier("sync", Members::World, None));
    /// let mut tick = tokio::time::interval(std::time::Duration::from_secs(10));
    /// loop {
    ///     tokio::select! {
    ///         result = &mut wait => break result,
    ///         _ = tick.tick() => eprintln!("still waiting at barrier 'sync'"),
    ///     }
    /// }
    /// # }
    /// ```
    pub fn barrier<'a>(
        &'a self,
        name: &'a str,
        members: Members,
        timeout: Option<Duration>,
    ) -> impl Future<Output = Result<(), Error>> + Send + 'a {
        self.barrier_waiting(name, members, timeout, channel::Waiting::Task)
    }

    /// [`Client::barrier`] for a caller that blocks its thread (the blocking client,
    /// the Python package): through the channel seat this client holds for the
    /// barrier, the whole call runs in the caller's thread, outside the runtime. A
    /// release through shared memory then wakes that thread itself, with no task, no
    /// future and no hand-over to the runtime. `interrupt`: how the wait may be given
    /// up before its timeout.
    pub fn barrier_in_thread(
        &self,
        name: &str,
        members: &Members,
        timeout: Option<Duration>,
        interrupt: Option<channel::Interrupt<'_>>,
    ) -> InThread {
        if !self.inner.barrier_channels {
            return InThread::Elsewhere;
        }
        let (timeout_ms, wait) = self.blocking_timeout(timeout);
        let call = channel::BarrierCall { name, members, timeout_ms };
        match channel::barrier_on_thread(&self.inner.link, &call, wait.saturating_add(SAFETY_MARGIN), interrupt) {
            channel::OnThread::Done(outcome) => {
                self.barrier_ended(&outcome);
                InThread::Done(outcome.map_err(|error| self.seen(error)))
            }
            channel::OnThread::Conclude(concluding) => {
                InThread::Conclude(BarrierConclusion { client: self.clone(), concluding })
            }
            channel::OnThread::Elsewhere => InThread::Elsewhere,
            channel::OnThread::Interrupted => InThread::Interrupted,
        }
    }

    /// What a barrier through a channel that ended in a timeout tells the connection:
    /// the coordinator may have gone silent.
    fn barrier_ended(&self, outcome: &Result<(), Error>) {
        if matches!(outcome, Err(Error::Timeout(_))) {
            self.inner.silent.store(true, Ordering::Relaxed);
        }
    }

    /// [`Client::barrier`], waiting for a release through shared memory as `waiting` says.
    pub(crate) fn barrier_waiting<'a>(
        &'a self,
        name: &'a str,
        members: Members,
        timeout: Option<Duration>,
        waiting: channel::Waiting,
    ) -> BarrierCall<'a> {
        BarrierCall { client: self, state: BarrierState::Start { name, members, timeout, waiting } }
    }

    /// Every member contributes `value`; each gets all values in rank order, read in
    /// place from the reply's bytes (see [`Gathered`]): the `i`th value is the `i`th
    /// member's, rank `i`'s only for the whole job. A role's members are not in the
    /// reply: put the rank in the value where it matters. Not cancel-safe, as
    /// [`Client::barrier`] is not.
    pub async fn all_gather(
        &self,
        name: &str,
        members: Members,
        value: impl AsRef<[u8]>,
        timeout: Option<Duration>,
    ) -> Result<Gathered, Error> {
        let (timeout_ms, wait) = self.blocking_timeout(timeout);
        let request = Request::AllGather { name: name.into(), members, value: bytes(value), timeout_ms };
        match self.call(request, wait).await? {
            Response::Gathered(gathered) => Ok(gathered),
            other => Err(unexpected("all_gather", other)),
        }
    }

    /// Every member gets the value of `root`, which must pass `Some(value)`. The root's
    /// call returns once its value is in, waiting for nobody; the others wait for the
    /// root and fail as a barrier does if it is lost or never comes, or if their call
    /// does not match (where the root came first, only the calls after it learn of it).
    pub async fn broadcast(
        &self,
        name: &str,
        members: Members,
        root: u32,
        value: Option<&[u8]>,
        timeout: Option<Duration>,
    ) -> Result<Bytes, Error> {
        let (timeout_ms, wait) = self.blocking_timeout(timeout);
        let request = Request::Broadcast {
            name: name.into(),
            members,
            root,
            value: value.map(Bytes::copy_from_slice),
            timeout_ms,
        };
        match self.call(request, wait).await? {
            Response::Value(value) => Ok(value),
            other => Err(unexpected("broadcast", other)),
        }
    }

    /// One round trip to the coordinator (it also counts as this rank's heartbeat):
    /// checks that the coordinator is there and responsive.
    pub async fn ping(&self) -> Result<(), Error> {
        match self.call_now(Request::Heartbeat).await? {
            Response::Done => Ok(()),
            other => Err(unexpected("ping", other)),
        }
    }

    /// Aborts the job: every pending and later operation of every member fails
    /// with [`crate::OpError::Aborted`] naming this client and `reason`.
    pub async fn abort(&self, reason: &str) -> Result<(), Error> {
        match self.call_now(Request::Abort { reason: reason.to_owned() }).await? {
            Response::Done => Ok(()),
            other => Err(unexpected("abort", other)),
        }
    }

    /// Tells the coordinator that the worker process started for `rank` (`pid` on
    /// `host`) ended with `exit`, as a launcher that saw it end does: every collective
    /// waiting for the rank fails at once with [`crate::OpError::PeerLost`] naming it
    /// and that end, even before its connection is seen to close, or if it never
    /// connected.
    pub async fn rank_exited(&self, rank: u32, host: &str, pid: u32, exit: Exit) -> Result<(), Error> {
        let request = Request::RankExited { rank, host: host.to_owned(), pid, exit };
        match self.call_now(request).await? {
            Response::Done => Ok(()),
            other => Err(unexpected("rank_exited", other)),
        }
    }

    /// Starts job `incarnation` afresh (see `rallypoint reset`): the job's keys,
    /// barrier generations, abort, lost ranks and rank holders are gone; every pending
    /// operation of its processes fails with [`crate::OpError::JobReset`], and they are
    /// refused from then on (this client too: it belonged to the job before). A no-op
    /// if the job is at `incarnation` already.
    pub async fn reset(&self, incarnation: u64) -> Result<(), Error> {
        match self.call_now(Request::Reset { incarnation }).await? {
            Response::Done => Ok(()),
            other => Err(unexpected("reset", other)),
        }
    }

    /// Gives the session up as a crash would, without a clean leave: the coordinator
    /// counts this rank lost at once (if this was its last session), as it does when
    /// the last clone of a client is dropped without [`Client::close`]. For a client
    /// whose runtime goes away with it (the blocking client, the Python package's), so
    /// that the coordinator learns it before the connection task is gone.
    pub async fn abandon(self) {
        let (done, closed) = oneshot::channel();
        if self.inner.commands.send(Command::Abandon(done)).is_ok() {
            let _ = closed.await;
        }
    }

    /// Leaves cleanly: the coordinator records that this rank left (it may come
    /// back) rather than died. Then closes the connection; calls still waiting on
    /// other clones fail with [`Error::Disconnected`].
    ///
    /// The leave is waited for at most [`LEAVE_WAIT`] (a coordinator answers it at
    /// once), and not at all after a call of this client found the coordinator silent:
    /// that call already waited its whole timeout, and a process closing must not wait
    /// as long again. The leave still goes out before the connection is shut, so a
    /// coordinator that reads it counts the rank as left.
    pub async fn close(self) -> Result<(), Error> {
        let left = if self.inner.silent.load(Ordering::Relaxed) {
            tracing::debug!("closing without waiting for the leave: the coordinator was silent");
            let _ =
                self.inner.commands.send(Command::Request { id: self.inner.link.next_id(), request: Request::Leave });
            Ok(Response::Done)
        } else {
            self.call_within(Request::Leave, LEAVE_WAIT).await
        };
        let (done, closed) = oneshot::channel();
        if self.inner.commands.send(Command::Shutdown(done)).is_ok() {
            // Fails only if the connection task is already gone, which is closed too.
            let _ = closed.await;
        }
        match left? {
            Response::Done => Ok(()),
            other => Err(unexpected("leave", other)),
        }
    }
}

/// Starts a new incarnation (a random one) of the job `options` name, from a client
/// of its own (connected with `options`) that leaves at once: what a launcher does
/// before each attempt's workers start. Returns the incarnation, for the workers'
/// `RALLYPOINT_JOB_INCARNATION`.
pub async fn reset_job(options: ConnectOptions) -> Result<u64, Error> {
    let incarnation = crate::new_job_incarnation();
    let client = Client::connect_with(options).await?;
    let reset = client.reset(incarnation).await;
    let closed = client.close().await;
    reset.and(closed).map(|()| incarnation)
}

/// The incarnation the job `options` name is at (`None`: never reset nor named), from
/// a client of its own (connected with `options`) that leaves at once.
pub async fn job_incarnation(options: ConnectOptions) -> Result<Option<u64>, Error> {
    let client = Client::connect_with(options).await?;
    let incarnation = client.job_incarnation();
    client.close().await.map(|()| incarnation)
}
