//! Byte streams the client and the node agent speak over: TCP, TLS over TCP
//! ([`crate::tls`]), or a Unix domain socket for ranks talking to the agent of
//! their own node (`unix:/path`), which costs the kernel far less per message than
//! loopback TCP.

use std::collections::VecDeque;
use std::future::Future;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::{tcp, TcpListener, TcpStream, UnixStream};

use crate::tls::TlsClient;
use crate::unix_conn::{self, UnixAcceptor, UnixConn, UnixReadHalf};

type TlsStream = tokio_rustls::TlsStream<TcpStream>;

/// Prefix of an address naming a Unix domain socket: `unix:/run/rallypoint.sock`.
pub const UNIX_PREFIX: &str = "unix:";

/// TCP keepalive of every accepted connection: a peer whose host vanished (powered
/// off, cut from the network) sends no FIN or RST, and without probes its connection
/// would stay open for good. Probes start after this much silence...
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);
/// ...and the connection is dropped after this many unanswered ones, this far apart.
pub const KEEPALIVE_PROBES: u32 = 3;
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);

/// Turns TCP keepalive on for `socket` (see [`KEEPALIVE_IDLE`]).
pub fn set_keepalive(socket: &impl AsFd) -> io::Result<()> {
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(KEEPALIVE_PROBES);
    socket2::SockRef::from(socket).set_tcp_keepalive(&keepalive)
}

/// The socket path of a `unix:PATH` address, `None` for `host:port`.
pub fn unix_path(addr: &str) -> Option<&Path> {
    addr.strip_prefix(UNIX_PREFIX).map(Path::new)
}

/// Whether `addr` has the form of a coordinator's address: HOST:PORT (`[v6]:PORT`
/// for IPv6) or `unix:PATH`; else what is wrong with it. Checked before connecting:
/// a connect retries until its timeout, which a typo would then cost in full (a
/// host that does not resolve yet is retried, as it may come up).
pub fn check_addr(addr: &str) -> Result<(), String> {
    if let Some(path) = unix_path(addr) {
        return match path.as_os_str().is_empty() {
            true => Err(format!("'{addr}' names no socket: give unix:PATH, e.g. unix:/run/rallypoint/agent.sock")),
            false => Ok(()),
        };
    }
    let example = |host: &str| format!("give HOST:PORT, e.g. {host}:29500");
    if let Some((scheme, _)) = addr.split_once("://") {
        return Err(format!("'{addr}' is a URL: give HOST:PORT, without '{scheme}://'"));
    }
    if addr.chars().any(char::is_whitespace) {
        return Err(format!("'{addr}' holds a space: {}", example("127.0.0.1")));
    }
    let Some((host, port)) = addr.rsplit_once(':') else {
        let host = if addr.is_empty() { "127.0.0.1" } else { addr };
        return Err(format!("'{addr}' has no port: {}", example(host)));
    };
    if host.is_empty() {
        return Err(format!("'{addr}' has no host: {}", example("localhost")));
    }
    if host.contains(':') && !(host.starts_with('[') && host.ends_with(']')) {
        return Err(format!("'{addr}': an IPv6 address goes in brackets, e.g. [::1]:29500"));
    }
    match port.parse::<u16>() {
        Ok(1..) => Ok(()),
        _ => Err(format!("'{port}' in '{addr}' is not a port (1 to 65535): {}", example(host))),
    }
}

pub enum Stream {
    Tcp(TcpStream),
    /// Registered for read readiness only (see [`crate::unix_conn`]).
    Unix(UnixConn),
    /// Either side of a TLS connection (boxed: its state is large).
    Tls(Box<TlsStream>),
}

impl Stream {
    /// Connects to `host:port` (with `TCP_NODELAY`) or `unix:PATH`.
    pub async fn connect(addr: &str) -> io::Result<Stream> {
        Stream::connect_with(addr, None).await
    }

    /// Connects like [`Stream::connect`], over TLS if `tls` is given (TCP only: a
    /// Unix socket is this machine's, and its directory's permissions guard it).
    pub async fn connect_with(addr: &str, tls: Option<&TlsClient>) -> io::Result<Stream> {
        match unix_path(addr) {
            Some(path) => Ok(Stream::Unix(UnixConn::connect(path)?)),
            None => {
                let stream = TcpStream::connect(addr).await?;
                stream.set_nodelay(true)?;
                match tls {
                    Some(tls) => Ok(Stream::Tls(Box::new(tls.connect(addr, stream).await?.into()))),
                    None => Ok(Stream::Tcp(stream)),
                }
            }
        }
    }

    /// A connected Unix stream socket, taken over from tokio's reactor ([`UnixConn`]).
    pub fn unix(stream: UnixStream) -> io::Result<Stream> {
        Ok(Stream::Unix(UnixConn::new(stream)?))
    }

    pub fn into_split(self) -> (ReadHalf, WriteHalf) {
        match self {
            Stream::Tcp(s) => {
                let (r, w) = s.into_split();
                (ReadHalf::Tcp(r), WriteHalf::Tcp(w))
            }
            Stream::Unix(s) => {
                let (r, w) = s.split();
                (ReadHalf::Unix(r), WriteHalf::Unix(w))
            }
            Stream::Tls(s) => {
                let (r, w) = tokio::io::split(*s);
                (ReadHalf::Tls(r), WriteHalf::Tls(Box::new(tokio::sync::Mutex::new(w))))
            }
        }
    }
}

pub enum ReadHalf {
    Tcp(tcp::OwnedReadHalf),
    Unix(UnixReadHalf),
    Tls(tokio::io::ReadHalf<TlsStream>),
}

pub enum WriteHalf {
    Tcp(tcp::OwnedWriteHalf),
    /// Shuts writing down when dropped, as tokio's owned write halves do.
    Unix(UnixConn),
    /// Behind a lock of its own: TLS cannot write without waiting ([`WriteHalf::try_write`]
    /// never writes), so a writer holding only `&self` writes with [`WriteHalf::write_locked`].
    Tls(Box<tokio::sync::Mutex<tokio::io::WriteHalf<TlsStream>>>),
}

impl ReadHalf {
    /// Reads into `buf` like `read_buf` (making room for `room` bytes); on a Unix
    /// socket, files passed with the bytes are appended to `files` (section 13 of
    /// docs/PROTOCOL.md).
    pub async fn read_with_files(
        &mut self,
        buf: &mut BytesMut,
        room: usize,
        files: &mut VecDeque<OwnedFd>,
    ) -> io::Result<usize> {
        match self {
            ReadHalf::Tcp(r) => {
                buf.reserve(room);
                r.read_buf(buf).await
            }
            ReadHalf::Tls(r) => {
                buf.reserve(room);
                r.read_buf(buf).await
            }
            ReadHalf::Unix(r) => std::future::poll_fn(|cx| r.poll_recv_with_files(cx, buf, room, files)).await,
        }
    }

    /// [`ReadHalf::read_with_files`] as a poll, for a reader shared by several
    /// tasks: as with tokio's `poll_read`, only the waker of the latest `cx` given is
    /// woken when bytes come. `Pending` only once the socket had nothing more.
    pub fn poll_read_with_files(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut BytesMut,
        room: usize,
        files: &mut VecDeque<OwnedFd>,
    ) -> Poll<io::Result<usize>> {
        buf.reserve(room);
        match self {
            // The future holds nothing but its borrows: polling it once is `poll_read`.
            ReadHalf::Tcp(r) => std::pin::pin!(r.read_buf(buf)).poll(cx),
            ReadHalf::Tls(r) => std::pin::pin!(r.read_buf(buf)).poll(cx),
            ReadHalf::Unix(r) => r.poll_recv_with_files(cx, buf, room, files),
        }
    }
}

impl WriteHalf {
    pub fn is_unix(&self) -> bool {
        matches!(self, WriteHalf::Unix(_))
    }

    pub fn is_tls(&self) -> bool {
        matches!(self, WriteHalf::Tls(_))
    }

    /// Writes what the socket takes now without waiting (`WouldBlock` if nothing).
    /// Over TLS always `WouldBlock`: encrypting and sending are one step there,
    /// done by [`WriteHalf::write_locked`].
    pub fn try_write(&self, buf: &[u8]) -> io::Result<usize> {
        match self {
            WriteHalf::Tcp(w) => w.try_write(buf),
            WriteHalf::Unix(w) => w.try_write(buf),
            WriteHalf::Tls(_) => Err(io::ErrorKind::WouldBlock.into()),
        }
    }

    /// Writes all of `buf` and flushes it, waiting as needed, through `&self`: for a
    /// writer shared with others that may only append (TLS; any stream works).
    pub async fn write_locked(&self, buf: &[u8]) -> io::Result<()> {
        use tokio::io::AsyncWriteExt;
        match self {
            WriteHalf::Tls(w) => {
                let mut w = w.lock().await;
                w.write_all(buf).await?;
                w.flush().await
            }
            WriteHalf::Tcp(w) => write_all_ref(w.as_ref(), buf).await,
            WriteHalf::Unix(w) => {
                let mut rest = buf;
                while !rest.is_empty() {
                    match w.try_write(rest) {
                        Ok(n) => rest = &rest[n..],
                        Err(error) if error.kind() == io::ErrorKind::WouldBlock => w.writable().await?,
                        Err(error) => return Err(error),
                    }
                }
                Ok(())
            }
        }
    }

    /// Like [`WriteHalf::try_write`], passing `files` with the first byte written
    /// (Unix sockets only; at most [`shm::MAX_FDS_PER_WRITE`]).
    pub fn try_write_with_files(&self, buf: &[u8], files: &[BorrowedFd<'_>]) -> io::Result<usize> {
        match self {
            _ if files.is_empty() => self.try_write(buf),
            WriteHalf::Tcp(_) | WriteHalf::Tls(_) => {
                Err(io::Error::new(io::ErrorKind::Unsupported, "files can only pass over Unix sockets"))
            }
            WriteHalf::Unix(w) => w.try_write_with_files(buf, files),
        }
    }

    /// Waits until the socket takes bytes. Over TLS this says nothing (write with
    /// [`WriteHalf::write_locked`] instead) and returns at once.
    pub async fn writable(&self) -> io::Result<()> {
        match self {
            WriteHalf::Tcp(w) => w.writable().await,
            WriteHalf::Unix(w) => w.writable().await,
            WriteHalf::Tls(_) => Ok(()),
        }
    }
}

/// A shared write half with its socket's descriptor kept beside it, for writers
/// that send without waiting ([`WriteHalf::try_write`]'s part). A process that
/// writes to thousands of connections in turn (a load of many ranks) finds each
/// half's own memory cold at its turn: this reaches the socket without reading it.
pub struct Sender {
    fd: RawFd,
    /// Held, not read: it keeps `fd` open.
    _half: Arc<WriteHalf>,
}

impl Sender {
    /// `None` over TLS, which cannot write without waiting.
    pub fn new(half: &Arc<WriteHalf>) -> Option<Sender> {
        let fd = match &**half {
            WriteHalf::Tcp(w) => w.as_ref().as_raw_fd(),
            WriteHalf::Unix(w) => w.fd().as_raw_fd(),
            WriteHalf::Tls(_) => return None,
        };
        Some(Sender { fd, _half: Arc::clone(half) })
    }

    /// Writes what the socket takes now without waiting (`WouldBlock` if nothing),
    /// as [`WriteHalf::try_write`] does.
    pub fn try_send(&self, buf: &[u8]) -> io::Result<usize> {
        // SAFETY: `_half` owns the socket, open at least as long as `self` holds it.
        let fd = unsafe { BorrowedFd::borrow_raw(self.fd) };
        unix_conn::send(fd, buf)
    }
}

async fn write_all_ref(stream: &TcpStream, mut rest: &[u8]) -> io::Result<()> {
    while !rest.is_empty() {
        stream.writable().await?;
        match stream.try_write(rest) {
            Ok(n) => rest = &rest[n..],
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
            Err(error) => return Err(error),
        }
    }
    Ok(())
}

macro_rules! delegate {
    ($self:ident, $inner:ident => $call:expr) => {
        match $self.get_mut() {
            Self::Tcp($inner) => $call,
            Self::Unix($inner) => $call,
            Self::Tls($inner) => $call,
        }
    };
}

impl AsyncRead for Stream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        delegate!(self, s => Pin::new(s).poll_read(cx, buf))
    }
}

impl AsyncWrite for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        delegate!(self, s => Pin::new(s).poll_write(cx, buf))
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        delegate!(self, s => Pin::new(s).poll_write_vectored(cx, bufs))
    }
    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Tcp(s) => s.is_write_vectored(),
            Stream::Unix(s) => s.is_write_vectored(),
            Stream::Tls(s) => s.is_write_vectored(),
        }
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        delegate!(self, s => Pin::new(s).poll_flush(cx))
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        delegate!(self, s => Pin::new(s).poll_shutdown(cx))
    }
}

impl AsyncRead for ReadHalf {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        delegate!(self, s => Pin::new(s).poll_read(cx, buf))
    }
}

/// The TLS half through its lock, which only [`WriteHalf::write_locked`] contends for.
macro_rules! delegate_write {
    ($self:ident, $inner:ident => $call:expr) => {
        match $self.get_mut() {
            WriteHalf::Tcp($inner) => $call,
            WriteHalf::Unix($inner) => $call,
            WriteHalf::Tls(lock) => {
                let $inner = lock.get_mut();
                $call
            }
        }
    };
}

impl AsyncWrite for WriteHalf {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        delegate_write!(self, s => Pin::new(s).poll_write(cx, buf))
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        delegate_write!(self, s => Pin::new(s).poll_flush(cx))
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        delegate_write!(self, s => Pin::new(s).poll_shutdown(cx))
    }
}

/// A listening socket: TCP, or Unix (whose path is removed when it is dropped, if it
/// is still this listener's socket).
pub enum Listener {
    Tcp(TcpListener),
    Unix(UnixAcceptor, BoundPath),
}

/// The path of a bound Unix socket and the file it was bound as, so that dropping
/// the listener removes that socket and never another one since bound there.
pub struct BoundPath {
    path: PathBuf,
    dev: u64,
    ino: u64,
}

impl Listener {
    /// Binds `host:port` or `unix:PATH`. At PATH, only a stale socket of this user
    /// (one nothing listens on, left by an agent that was killed) is replaced: a
    /// file that is not a socket, another user's socket, or a socket something still
    /// listens on is refused with an error saying which.
    pub async fn bind(addr: &str) -> io::Result<Listener> {
        match unix_path(addr) {
            Some(path) => {
                clear_stale_socket(path)?;
                let listener = UnixAcceptor::bind(path)?;
                let meta = std::fs::symlink_metadata(path)?;
                let bound = BoundPath { path: path.to_owned(), dev: meta.dev(), ino: meta.ino() };
                Ok(Listener::Unix(listener, bound))
            }
            None => Ok(Listener::Tcp(TcpListener::bind(addr).await?)),
        }
    }

    /// The address to give clients, in the form [`Stream::connect`] takes.
    pub fn local_addr(&self) -> io::Result<String> {
        match self {
            Listener::Tcp(l) => Ok(l.local_addr()?.to_string()),
            Listener::Unix(_, bound) => Ok(format!("{UNIX_PREFIX}{}", bound.path.display())),
        }
    }

    pub async fn accept(&self) -> io::Result<Stream> {
        match self {
            Listener::Tcp(l) => {
                let (stream, _) = l.accept().await?;
                // Replies are small and latency-bound.
                stream.set_nodelay(true)?;
                set_keepalive(&stream)?;
                Ok(Stream::Tcp(stream))
            }
            Listener::Unix(l, _) => Ok(Stream::Unix(l.accept().await?)),
        }
    }
}

/// Makes way at `path` for a new socket: nothing there, or a stale socket of this
/// user, which is removed. Anything else is an error naming what is there.
fn clear_stale_socket(path: &Path) -> io::Result<()> {
    let refuse =
        |what: String| Err(io::Error::new(io::ErrorKind::AlreadyExists, format!("{}: {what}", path.display())));
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(error) => return Err(error),
    };
    if !meta.file_type().is_socket() {
        return refuse("exists and is not a socket; refusing to replace it".to_owned());
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    if meta.uid() != uid {
        return refuse(format!("is a socket of another user (uid {}); refusing to replace it", meta.uid()));
    }
    match std::os::unix::net::UnixStream::connect(path) {
        Ok(_) => refuse("another process is listening on this socket".to_owned()),
        Err(error) if error.kind() == io::ErrorKind::ConnectionRefused => std::fs::remove_file(path),
        Err(error) => refuse(format!("cannot tell whether this socket is in use ({error}); refusing to replace it")),
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix(_, bound) = self {
            // Only our own socket: another agent may have bound this path since.
            let ours =
                std::fs::symlink_metadata(&bound.path).is_ok_and(|m| m.dev() == bound.dev && m.ino() == bound.ino);
            if ours {
                let _ = std::fs::remove_file(&bound.path);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coordinator_addresses() {
        for good in ["localhost:29500", "10.0.0.1:1", "[::1]:29500", "unix:/tmp/agent.sock", "node-7.cluster:65535"] {
            assert_eq!(check_addr(good), Ok(()));
        }
        assert_eq!(
            check_addr("localhost").unwrap_err(),
            "'localhost' has no port: give HOST:PORT, e.g. localhost:29500"
        );
        assert!(check_addr(":29500").unwrap_err().contains("no host"));
        assert!(check_addr("h:0").unwrap_err().contains("not a port"));
        assert!(check_addr("127.0.0.1:abc").unwrap_err().contains("'abc'"));
        assert!(check_addr("::1:29500").unwrap_err().contains("brackets"));
        assert_eq!(
            check_addr("http://127.0.0.1:29600").unwrap_err(),
            "'http://127.0.0.1:29600' is a URL: give HOST:PORT, without 'http://'"
        );
        assert_eq!(check_addr("").unwrap_err(), "'' has no port: give HOST:PORT, e.g. 127.0.0.1:29500");
        assert!(check_addr(" 127.0.0.1:29600").unwrap_err().contains("holds a space"));
        assert!(check_addr("unix:").unwrap_err().contains("names no socket"));
    }

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("rallypoint-net-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("test directory");
        dir
    }

    #[tokio::test]
    async fn a_file_that_is_not_a_socket_is_never_replaced() {
        let dir = temp_dir("file");
        let path = dir.join("notes.txt");
        std::fs::write(&path, "keep me").expect("write");
        let error = Listener::bind(&format!("unix:{}", path.display())).await.err().expect("refused");
        assert!(error.to_string().contains("not a socket"), "{error}");
        assert_eq!(std::fs::read_to_string(&path).expect("still there"), "keep me");
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[tokio::test]
    async fn a_live_socket_is_refused_and_a_stale_one_replaced() {
        let dir = temp_dir("live");
        let addr = format!("unix:{}", dir.join("agent.sock").display());
        let first = Listener::bind(&addr).await.expect("first bind");
        let error = Listener::bind(&addr).await.err().expect("second bind refused");
        assert!(error.to_string().contains("another process is listening"), "{error}");
        // The first still serves.
        let client = tokio::spawn({
            let addr = addr.clone();
            async move { Stream::connect(&addr).await }
        });
        first.accept().await.expect("accepts");
        client.await.expect("joined").expect("connects");

        // A socket left behind by a listener that died (std's does not unlink) is replaced.
        drop(first);
        let stale = std::os::unix::net::UnixListener::bind(dir.join("agent.sock")).expect("stale bind");
        drop(stale);
        let replaced = Listener::bind(&addr).await.expect("stale socket replaced");
        drop(replaced);
        assert!(!dir.join("agent.sock").exists(), "removed when dropped");
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[tokio::test]
    async fn another_users_socket_is_never_replaced() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: making a socket of another user needs root (CI runs as root)");
            return;
        }
        let dir = temp_dir("other");
        let path = dir.join("agent.sock");
        drop(std::os::unix::net::UnixListener::bind(&path).expect("bind"));
        std::os::unix::fs::lchown(&path, Some(65534), Some(65534)).expect("chown to nobody");
        let error = Listener::bind(&format!("unix:{}", path.display())).await.err().expect("refused");
        assert!(error.to_string().contains("another user (uid 65534)"), "{error}");
        assert!(path.exists());
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[tokio::test]
    async fn dropping_a_listener_leaves_a_socket_bound_there_since() {
        let dir = temp_dir("since");
        let path = dir.join("agent.sock");
        let addr = format!("unix:{}", path.display());
        let old = Listener::bind(&addr).await.expect("bind");
        // Someone removed our socket and bound a new one at the same path.
        std::fs::remove_file(&path).expect("remove");
        let new = Listener::bind(&addr).await.expect("bind again");
        drop(old);
        assert!(path.exists(), "the old listener removed the new one's socket");
        drop(new);
        assert!(!path.exists());
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    /// A sender alone keeps its socket open: what it sends arrives, a full socket
    /// is `WouldBlock` (the caller hands the rest to a writer that waits), and once
    /// it is dropped, the peer reads the end of the stream. Over TCP and Unix sockets.
    #[tokio::test]
    async fn a_sender_sends_on_the_socket_its_half_keeps_open() {
        let dir = temp_dir("sender");
        for addr in ["127.0.0.1:0".to_owned(), format!("unix:{}", dir.join("s.sock").display())] {
            let listener = Listener::bind(&addr).await.expect("bind");
            let addr = listener.local_addr().expect("address");
            let (connected, accepted) = tokio::join!(Stream::connect(&addr), listener.accept());
            let (_reader, writer) = connected.expect("connects").into_split();
            let sender = Sender::new(&Arc::new(writer)).expect("not TLS");
            let mut peer = accepted.expect("accepts");

            assert_eq!(sender.try_send(b"hello").expect("sends"), 5, "{addr}");
            let mut got = [0u8; 5];
            peer.read_exact(&mut got).await.expect("reads");
            assert_eq!(&got, b"hello", "{addr}");

            // Fill the socket (the peer does not read): bounded by the kernel's buffers.
            let chunk = vec![7u8; 1 << 16];
            let mut sent = 0usize;
            let full = (0..10_000).find_map(|_| match sender.try_send(&chunk) {
                Ok(n) => {
                    sent += n;
                    None
                }
                Err(error) => Some(error),
            });
            let full = full.expect("the socket filled within 10,000 sends");
            assert_eq!(full.kind(), io::ErrorKind::WouldBlock, "{addr}: {full}");

            drop(sender);
            let mut rest = Vec::new();
            peer.read_to_end(&mut rest).await.expect("reads to the end");
            assert_eq!(rest.len(), sent, "{addr}: every byte sent, then the end");
        }
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
