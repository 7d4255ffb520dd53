//! The TCPStore reactor: one thread with a plain `mio` event loop that serves every
//! PyTorch TCPStore connection of the server, the way torch's own server runs one
//! libuv loop.
//!
//! Why not a tokio task per connection, as for native clients: torch clients send
//! one small request at a time and wait for its answer, so a round trip is mostly
//! fixed costs. On a request, a tokio task is woken through the runtime's I/O
//! driver and scheduler (readiness bookkeeping, the run queue, timing statistics);
//! here the thread that returns from `epoll_wait` reads, answers and writes
//! directly. A torch round trip is mostly these fixed costs, so they decide whether
//! rallypoint keeps up with torch's own server (figures: docs/BENCHMARKS.md, "The
//! TCPStore reactor"). Native clients pipeline and batch, where a multi-threaded
//! runtime pays off instead (the crate docs say how the threads fit together).
//!
//! Connections arrive from the tokio side once their first byte showed them to be
//! TCPStore clients. Replies the engine produces later for a connection (a WAIT
//! released by another client's SET) are signalled through the connection's
//! outbox, whose waker puts it on the reactor's to-do list.

use std::collections::HashSet;
use std::io;
use std::net::SocketAddr;
use std::panic::{self, AssertUnwindSafe};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Wake, Waker};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use bytes::BytesMut;
use mio::net::TcpStream;
use mio::{Events, Interest, Poll, Token};
use rallypoint_proto::tcpstore::TcpLimits;
use slab::Slab;
use tracing::{debug, error};

use rallypoint_net::budget::Charge;
use rallypoint_net::conn::Buffering;
use rallypoint_net::meter::{Account, Counted};
use rallypoint_net::sync::lock;

use crate::shared::Shared;
use crate::tcpstore::{Conn, End, Progress};

/// The token of the reactor's own waker; connections use their slab index.
const WAKE: Token = Token(usize::MAX);
/// Reads per connection before others get their turn (a client that floods
/// pipelined requests must not starve the rest).
const MAX_READS_PER_TURN: usize = 16;

/// The handle the tokio side holds: hands connections over, stops the loop.
pub(crate) struct Reactor {
    mailbox: Arc<Mailbox>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// What other threads tell the loop; the loop takes it all at each wake-up.
struct Mailbox {
    inbox: Mutex<Inbox>,
    waker: mio::Waker,
}

#[derive(Default)]
struct Inbox {
    adopt: Vec<(std::net::TcpStream, Account, SocketAddr, BytesMut, Charge)>,
    /// Connections whose outbox received replies.
    dirty: Vec<usize>,
    stop: bool,
}

impl Mailbox {
    fn lock(&self) -> MutexGuard<'_, Inbox> {
        lock(&self.inbox)
    }

    fn wake(&self) {
        if let Err(error) = self.waker.wake() {
            error!(%error, "cannot wake the TCPStore reactor");
        }
    }
}

/// A connection's outbox waker: puts the connection on the loop's to-do list.
struct ConnWaker {
    mailbox: Arc<Mailbox>,
    key: usize,
}

impl Wake for ConnWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let mut inbox = self.mailbox.lock();
        let first = inbox.dirty.is_empty();
        inbox.dirty.push(self.key);
        drop(inbox);
        // The loop takes the whole list per wake-up: only the first entry needs one.
        if first {
            self.mailbox.wake();
        }
    }
}

impl Reactor {
    pub(crate) fn start(shared: Arc<Shared>, limits: TcpLimits, read_timeout: Duration) -> io::Result<Reactor> {
        let poll = Poll::new()?;
        let waker = mio::Waker::new(poll.registry(), WAKE)?;
        let mailbox = Arc::new(Mailbox { inbox: Mutex::default(), waker });
        let thread = thread::Builder::new().name("rallypoint-tcpstore".into()).spawn({
            let mailbox = Arc::clone(&mailbox);
            move || {
                let stalls = Stalls { timeout: read_timeout, mid_request: HashSet::new(), next_check: None };
                Loop { poll, mailbox, shared, limits, conns: Slab::new(), runnable: Vec::new(), stalls }.run()
            }
        })?;
        Ok(Reactor { mailbox, thread: Mutex::new(Some(thread)) })
    }

    /// Serves `stream` from now on; `rbuf` holds the bytes already read from it,
    /// counted in `charge`.
    pub(crate) fn adopt(
        &self,
        stream: Counted<tokio::net::TcpStream>,
        peer: SocketAddr,
        rbuf: BytesMut,
        charge: Charge,
    ) -> io::Result<()> {
        // Leaves tokio's driver; stays non-blocking (and counted).
        let (stream, account) = stream.into_parts();
        let stream = stream.into_std()?;
        let mut inbox = self.mailbox.lock();
        if inbox.stop {
            return Err(io::Error::other("the server is shutting down"));
        }
        inbox.adopt.push((stream, account, peer, rbuf, charge));
        drop(inbox);
        self.mailbox.wake();
        Ok(())
    }

    /// Closes every connection (their sessions count as lost) and ends the thread.
    pub(crate) async fn stop(&self) {
        self.signal_stop();
        let thread = lock(&self.thread).take();
        if let Some(thread) = thread {
            // Joining blocks (for at most one turn of the loop), so not on a runtime worker.
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
    }

    fn signal_stop(&self) {
        self.mailbox.lock().stop = true;
        self.mailbox.wake();
    }
}

impl Drop for Reactor {
    fn drop(&mut self) {
        self.signal_stop();
    }
}

struct Loop {
    poll: Poll,
    mailbox: Arc<Mailbox>,
    shared: Arc<Shared>,
    limits: TcpLimits,
    conns: Slab<Entry>,
    /// Connections to service in this turn.
    runnable: Vec<usize>,
    stalls: Stalls,
}

/// Connections holding part of a request, checked for the read timeout. The loop
/// has no timer of its own while none does: it wakes for these checks only.
struct Stalls {
    timeout: Duration,
    mid_request: HashSet<usize>,
    next_check: Option<std::time::Instant>,
}

impl Stalls {
    /// How often the connections mid-request are checked: a fraction of the timeout,
    /// so that one is closed at most that much late.
    fn interval(&self) -> Duration {
        (self.timeout / 4).clamp(Duration::from_millis(10), Duration::from_secs(1))
    }
}

struct Entry {
    conn: Conn,
    waker: Waker,
}

impl Loop {
    fn run(mut self) {
        let mut events = Events::with_capacity(1024);
        // One read buffer for the whole loop.
        let mut read_buf = vec![0u8; Buffering::TORCH.chunk];
        // Connections whose read budget ran out: serviced again without sleeping.
        let mut again = Vec::new();
        loop {
            let timeout = if again.is_empty() {
                self.stalls.next_check.map(|at| at.saturating_duration_since(std::time::Instant::now()))
            } else {
                Some(Duration::ZERO)
            };
            if let Err(error) = self.poll.poll(&mut events, timeout) {
                if error.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                // Without the loop no TCPStore client is served: say so loudly, refuse
                // new ones, close these.
                error!(%error, "the TCPStore reactor cannot poll; closing its connections");
                self.mailbox.lock().stop = true;
                return;
            }
            self.runnable.append(&mut again);
            let mut woken = false;
            for event in &events {
                if event.token() == WAKE {
                    woken = true;
                    continue;
                }
                let key = event.token().0;
                if let Some(entry) = self.conns.get_mut(key) {
                    if event.is_readable() || event.is_read_closed() || event.is_error() {
                        entry.conn.set_readable();
                    }
                    self.runnable.push(key);
                }
            }
            if woken && !self.take_mail() {
                return; // stopping: dropping `self` closes every connection
            }
            for key in std::mem::take(&mut self.runnable) {
                if self.service(key, &mut read_buf) {
                    again.push(key);
                }
            }
            self.close_stalled();
        }
    }

    /// Closes the connections that stopped in the middle of a request for longer
    /// than the read timeout, when a check is due.
    fn close_stalled(&mut self) {
        let now = std::time::Instant::now();
        if self.stalls.next_check.is_some_and(|at| at > now) {
            return;
        }
        let stalled: Vec<(usize, End)> = self
            .stalls
            .mid_request
            .iter()
            .filter_map(|&key| Some((key, self.conns.get(key)?.conn.stalled(now, self.stalls.timeout)?)))
            .collect();
        for (key, end) in stalled {
            self.close(key, Some(Err(end)));
        }
        self.stalls.next_check = (!self.stalls.mid_request.is_empty()).then(|| now + self.stalls.interval());
    }

    /// Adopts new connections and queues the dirty ones; false once told to stop.
    fn take_mail(&mut self) -> bool {
        let Inbox { adopt, dirty, stop } = std::mem::take(&mut *self.mailbox.lock());
        if stop {
            // Keep refusing hand-overs while the connections close.
            self.mailbox.lock().stop = true;
            return false;
        }
        self.runnable.extend(dirty);
        for (stream, account, peer, rbuf, charge) in adopt {
            let mut stream = Counted::from_parts(TcpStream::from_std(stream), account);
            let entry = self.conns.vacant_entry();
            let key = entry.key();
            if let Err(error) =
                self.poll.registry().register(stream.get_mut(), Token(key), Interest::READABLE | Interest::WRITABLE)
            {
                debug!(%peer, %error, "cannot watch a TCPStore connection; closing it");
                continue;
            }
            let waker = Waker::from(Arc::new(ConnWaker { mailbox: Arc::clone(&self.mailbox), key }));
            let conn = Conn::new(stream, peer, rbuf, charge, Arc::clone(&self.shared), self.limits);
            entry.insert(Entry { conn, waker });
            self.runnable.push(key);
        }
        true
    }

    /// Services one connection, closing it when it ends; true if it has more to read.
    fn service(&mut self, key: usize, read_buf: &mut [u8]) -> bool {
        let Some(Entry { conn, waker }) = self.conns.get_mut(key) else { return false };
        // A panic (a bug in the engine) costs only this connection, as a panicking
        // tokio task would.
        let end = match panic::catch_unwind(AssertUnwindSafe(|| conn.service(read_buf, MAX_READS_PER_TURN, waker))) {
            Ok(Ok(progress @ (Progress::Idle | Progress::More))) => {
                if conn.is_mid_request() {
                    if self.stalls.mid_request.insert(key) && self.stalls.next_check.is_none() {
                        self.stalls.next_check = Some(std::time::Instant::now() + self.stalls.interval());
                    }
                } else {
                    self.stalls.mid_request.remove(&key);
                }
                return matches!(progress, Progress::More);
            }
            Ok(Ok(Progress::Closed)) => Some(Ok(())),
            Ok(Err(end)) => Some(Err(end)),
            Err(_) => {
                error!("a TCPStore connection panicked; closing it");
                conn.abandon();
                None
            }
        };
        self.close(key, end);
        false
    }

    /// Closes connection `key`, logging how it ended (`None`: it panicked, logged).
    fn close(&mut self, key: usize, end: Option<Result<(), End>>) {
        self.stalls.mid_request.remove(&key);
        let Some(mut entry) = self.conns.try_remove(key) else { return };
        if let Some(end) = end {
            entry.conn.log_end(end);
        }
        let _ = self.poll.registry().deregister(entry.conn.stream());
    }
}
