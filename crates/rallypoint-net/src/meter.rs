//! Bytes and connections, counted where a connection's bytes pass: a [`Counted`]
//! stream wraps the socket of every connection a server serves and adds what it
//! reads and writes to the server's [`Traffic`], by protocol, and by job once the
//! connection's session is known. The serving code only says what the connection
//! turned out to be ([`Counted::classify`]) and whose job it carries
//! ([`Counted::set_job`]); however its I/O loop reads and writes, the wrapper sees
//! every byte (TLS records included, as they cross the wire).
//!
//! The counters are relaxed atomics: a read or write adds to two of them. Jobs are
//! user-named, so the per-job meters are capped ([`Traffic::MAX_JOBS`]); connections
//! of jobs past the cap share one meter (shown as job `_other`).

use std::collections::HashMap;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::sync::lock;

/// What a connection turned out to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// A client of rallypoint's own protocol (over TCP or TLS).
    Native,
    /// A node agent's link, carrying its node's ranks.
    Agent,
    /// A PyTorch TCPStore client.
    TcpStore,
    /// Closed or refused before it could be told apart (a failed TLS or token
    /// handshake, an unknown protocol).
    Unrecognised,
}

impl Protocol {
    pub const ALL: [Protocol; 4] = [Protocol::Native, Protocol::Agent, Protocol::TcpStore, Protocol::Unrecognised];

    /// Its name in the metrics' `protocol` label.
    pub fn label(self) -> &'static str {
        match self {
            Protocol::Native => "native",
            Protocol::Agent => "agent",
            Protocol::TcpStore => "tcpstore",
            Protocol::Unrecognised => "unrecognised",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Counts of one protocol's connections.
#[derive(Debug, Default)]
pub struct ProtocolMeter {
    open: AtomicU64,
    opened: AtomicU64,
    received: AtomicU64,
    sent: AtomicU64,
}

/// Bytes of one job's connections (those carrying one session of it).
#[derive(Debug, Default)]
pub struct JobMeter {
    received: AtomicU64,
    sent: AtomicU64,
}

impl JobMeter {
    /// (bytes received, bytes sent).
    pub fn bytes(&self) -> (u64, u64) {
        (self.received.load(Ordering::Relaxed), self.sent.load(Ordering::Relaxed))
    }
}

/// What a server's connections moved, as [`Traffic::snapshot`] reads it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrafficSnapshot {
    /// Per protocol, in the order of [`Protocol::ALL`].
    pub protocols: Vec<ProtocolCounts>,
    /// Per job with a meter, by name; `OTHER_JOBS` holds the jobs past the cap.
    pub jobs: Vec<(String, u64, u64)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProtocolCounts {
    pub protocol: Protocol,
    /// Connections open now.
    pub open: u64,
    /// Connections ever opened (for `Unrecognised`: ever closed unrecognised).
    pub opened: u64,
    pub received: u64,
    pub sent: u64,
}

/// The name under which the jobs past [`Traffic::MAX_JOBS`] are counted together.
pub const OTHER_JOBS: &str = "_other";

/// A server's counters.
#[derive(Debug, Default)]
pub struct Traffic {
    protocols: [ProtocolMeter; 4],
    jobs: Mutex<HashMap<String, Arc<JobMeter>>>,
    other: Arc<JobMeter>,
}

impl Traffic {
    /// Jobs with a meter of their own.
    pub const MAX_JOBS: usize = 256;

    pub fn new() -> Arc<Traffic> {
        Arc::default()
    }

    fn meter(&self, protocol: Protocol) -> &ProtocolMeter {
        &self.protocols[protocol.index()]
    }

    /// The meter of job `name` (the shared one once [`Traffic::MAX_JOBS`] are taken).
    pub fn job(&self, name: &str) -> Arc<JobMeter> {
        let mut jobs = lock(&self.jobs);
        if let Some(meter) = jobs.get(name) {
            return Arc::clone(meter);
        }
        if jobs.len() >= Self::MAX_JOBS {
            return Arc::clone(&self.other);
        }
        let meter = Arc::new(JobMeter::default());
        jobs.insert(name.to_owned(), Arc::clone(&meter));
        meter
    }

    /// Forgets the meters of jobs no connection counts into and `keep` rejects (jobs
    /// the coordinator no longer holds), so that the cap counts jobs that exist.
    pub fn prune_jobs(&self, keep: impl Fn(&str) -> bool) {
        lock(&self.jobs).retain(|name, meter| Arc::strong_count(meter) > 1 || keep(name));
    }

    pub fn snapshot(&self) -> TrafficSnapshot {
        let protocols = Protocol::ALL
            .iter()
            .map(|&protocol| {
                let m = self.meter(protocol);
                ProtocolCounts {
                    protocol,
                    open: m.open.load(Ordering::Relaxed),
                    opened: m.opened.load(Ordering::Relaxed),
                    received: m.received.load(Ordering::Relaxed),
                    sent: m.sent.load(Ordering::Relaxed),
                }
            })
            .collect();
        let mut jobs: Vec<(String, u64, u64)> = lock(&self.jobs)
            .iter()
            .map(|(name, meter)| {
                let (received, sent) = meter.bytes();
                (name.clone(), received, sent)
            })
            .collect();
        let (received, sent) = self.other.bytes();
        if received > 0 || sent > 0 {
            jobs.push((OTHER_JOBS.to_owned(), received, sent));
        }
        jobs.sort();
        TrafficSnapshot { protocols, jobs }
    }
}

/// A connection's place in its server's [`Traffic`], once classified: counted open
/// until dropped. Moves with the connection when another part of the server takes
/// its socket over ([`Counted::into_parts`]).
#[derive(Debug)]
pub struct Account {
    traffic: Arc<Traffic>,
    protocol: Option<Protocol>,
    job: Option<Arc<JobMeter>>,
    /// Bytes (received, sent) before the protocol was known.
    pending: (u64, u64),
}

impl Account {
    fn add(&mut self, received: u64, sent: u64) {
        match self.protocol {
            Some(protocol) => {
                let meter = self.traffic.meter(protocol);
                if received > 0 {
                    meter.received.fetch_add(received, Ordering::Relaxed);
                }
                if sent > 0 {
                    meter.sent.fetch_add(sent, Ordering::Relaxed);
                }
            }
            None => {
                self.pending.0 += received;
                self.pending.1 += sent;
            }
        }
        if let Some(job) = &self.job {
            if received > 0 {
                job.received.fetch_add(received, Ordering::Relaxed);
            }
            if sent > 0 {
                job.sent.fetch_add(sent, Ordering::Relaxed);
            }
        }
    }

    fn classify(&mut self, protocol: Protocol) {
        if self.protocol.is_some() {
            return;
        }
        let meter = self.traffic.meter(protocol);
        meter.open.fetch_add(1, Ordering::Relaxed);
        meter.opened.fetch_add(1, Ordering::Relaxed);
        self.protocol = Some(protocol);
        let (received, sent) = std::mem::take(&mut self.pending);
        self.add(received, sent);
    }
}

impl Drop for Account {
    fn drop(&mut self) {
        match self.protocol {
            Some(protocol) => {
                self.traffic.meter(protocol).open.fetch_sub(1, Ordering::Relaxed);
            }
            None => {
                self.classify(Protocol::Unrecognised);
                self.traffic.meter(Protocol::Unrecognised).open.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

/// A stream whose bytes are counted into a [`Traffic`] (see the module docs).
#[derive(Debug)]
pub struct Counted<S> {
    inner: S,
    account: Account,
}

impl<S> Counted<S> {
    /// A connection not yet told apart.
    pub fn new(inner: S, traffic: Arc<Traffic>) -> Self {
        Counted { inner, account: Account { traffic, protocol: None, job: None, pending: (0, 0) } }
    }

    /// The connection is of `protocol`: counted open under it from now on, with the
    /// bytes it moved so far. Only the first call counts.
    pub fn classify(&mut self, protocol: Protocol) {
        self.account.classify(protocol);
    }

    /// Its bytes count for job `meter` too from now on.
    pub fn set_job(&mut self, meter: Arc<JobMeter>) {
        self.account.job = Some(meter);
    }

    /// Counts `n` bytes received that were read from the socket beside this wrapper
    /// (a read straight from its descriptor).
    pub fn received(&mut self, n: usize) {
        self.account.add(n as u64, 0);
    }

    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The stream and its account, to count another stream of the same socket.
    pub fn into_parts(self) -> (S, Account) {
        (self.inner, self.account)
    }

    pub fn from_parts(inner: S, account: Account) -> Self {
        Counted { inner, account }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Counted<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        let read = buf.filled().len().saturating_sub(before);
        if read > 0 {
            this.account.add(read as u64, 0);
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Counted<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = polled {
            this.account.add(0, n as u64);
        }
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = polled {
            this.account.add(0, n as u64);
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Blocking-style reads and writes, for sockets served by a `mio` loop.
impl<S: io::Read> io::Read for Counted<S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.account.add(n as u64, 0);
        Ok(n)
    }
}

impl<S: io::Write> io::Write for Counted<S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.account.add(0, n as u64);
        Ok(n)
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        let n = self.inner.write_vectored(bufs)?;
        self.account.add(0, n as u64);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};

    use super::*;

    fn counts(traffic: &Traffic, protocol: Protocol) -> ProtocolCounts {
        traffic.snapshot().protocols.into_iter().find(|c| c.protocol == protocol).expect("every protocol")
    }

    #[test]
    fn bytes_before_the_protocol_is_known_count_for_it_and_an_account_moves_with_its_socket() {
        let traffic = Traffic::new();
        let mut conn = Counted::new(io::Cursor::new(b"hello world".to_vec()), Arc::clone(&traffic));
        let mut buf = [0u8; 5];
        conn.read_exact(&mut buf).expect("read");
        assert_eq!(counts(&traffic, Protocol::TcpStore).received, 0, "not yet told apart");
        conn.classify(Protocol::TcpStore);
        conn.set_job(traffic.job("j"));
        conn.write_all(b"abc").expect("write");
        let (cursor, account) = conn.into_parts();
        let mut conn = Counted::from_parts(cursor, account);
        // The write moved the cursor past 3 bytes: 3 are left.
        conn.read_exact(&mut buf[..3]).expect("read");
        let c = counts(&traffic, Protocol::TcpStore);
        assert_eq!((c.open, c.opened, c.received, c.sent), (1, 1, 8, 3));
        assert_eq!(traffic.snapshot().jobs, [("j".to_owned(), 3, 3)], "counted for the job once it was known");
        drop(conn);
        assert_eq!(counts(&traffic, Protocol::TcpStore).open, 0);
        // Unused meters of jobs that are gone are forgotten.
        traffic.prune_jobs(|_| false);
        assert!(traffic.snapshot().jobs.is_empty());
    }

    #[test]
    fn a_connection_closed_before_it_was_told_apart_is_unrecognised_and_jobs_past_the_cap_share_a_meter() {
        let traffic = Traffic::new();
        let mut conn = Counted::new(io::Cursor::new(b"GET /".to_vec()), Arc::clone(&traffic));
        let mut buf = Vec::new();
        conn.read_to_end(&mut buf).expect("read");
        drop(conn);
        let c = counts(&traffic, Protocol::Unrecognised);
        assert_eq!((c.open, c.opened, c.received), (0, 1, 5));
        let meters: Vec<Arc<JobMeter>> = (0..=Traffic::MAX_JOBS).map(|i| traffic.job(&format!("job{i}"))).collect();
        assert!(Arc::ptr_eq(&meters[Traffic::MAX_JOBS], &traffic.other));
    }
}
