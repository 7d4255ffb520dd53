//! A connected Unix stream socket registered with the reactor for read readiness
//! only.
//!
//! A Unix stream socket reports write space (`EPOLLOUT`) every time its peer reads
//! from it, as the bytes it had sent are freed. Registered for both directions, as
//! tokio's `UnixStream` is, a rank that sent its request and sleeps until the reply
//! is woken when the agent reads that request, only to find nothing and sleep
//! again; the agent likewise, once per rank, when the ranks read their replies.
//! With many rank processes on few cores every such wake-up is a pair of context
//! switches. Writes here are plain non-blocking sends; only a write that finds the
//! socket full waits for room, through a duplicate of the descriptor registered
//! for writability for that wait alone.
//!
//! Connections are made straight into that registration ([`UnixConn::connect`],
//! [`UnixAcceptor::accept`]): taking a tokio stream over would register it twice.
//!
//! Reads clear the read readiness after a short read, as tokio's streams do, so
//! that the next read waits for the socket's wake-up instead of asking the kernel
//! once more to learn that nothing came; except after a read that received files,
//! at which the kernel stops even if more bytes wait.

use std::collections::VecDeque;
use std::io;
use std::net::Shutdown;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream as StdUnixStream;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::BytesMut;
use rustix::net::{AddressFamily, RecvFlags, SendFlags, SocketAddrUnix, SocketFlags, SocketType};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};

use crate::shm;

/// The socket and its registration, shared by the halves of a split connection.
type Registered = AsyncFd<StdUnixStream>;

/// One side of a Unix stream connection, or the write half of one ([`UnixConn::split`]).
pub struct UnixConn {
    /// The socket, whose reading side the read half shares once split.
    read: UnixReadHalf,
    /// The registration for writability of a write that found the socket full,
    /// kept until a write goes through ([`AsyncWrite::poll_write`]).
    room: Option<AsyncFd<OwnedFd>>,
    /// The write half of a split connection: dropping it shuts writing down, as
    /// dropping tokio's owned write half does (the peer reads the end of the stream).
    shutdown_on_drop: bool,
}

impl UnixConn {
    /// Connects to the socket at `path` without waiting: a Unix socket connects at
    /// once, or fails (`WouldBlock` while the listener's backlog is full, as tokio's
    /// connect does).
    pub fn connect(path: &Path) -> io::Result<UnixConn> {
        let socket = rustix::net::socket_with(AddressFamily::UNIX, SocketType::STREAM, SOCKET_FLAGS, None)?;
        rustix::net::connect(&socket, &SocketAddrUnix::new(path)?)?;
        UnixConn::register(socket.into())
    }

    /// Takes `stream` over from tokio's reactor (it stays non-blocking).
    pub fn new(stream: tokio::net::UnixStream) -> io::Result<UnixConn> {
        UnixConn::register(stream.into_std()?)
    }

    /// `stream` must be non-blocking.
    fn register(stream: StdUnixStream) -> io::Result<UnixConn> {
        // SAFETY: the stream is the AsyncFd's own, its descriptor open until it drops.
        let io = unsafe { AsyncFd::register_with_interest(stream, Interest::READABLE) }.map_err(io::Error::from)?;
        Ok(UnixConn { read: UnixReadHalf { io: Arc::new(io) }, room: None, shutdown_on_drop: false })
    }

    /// The read half and the write half, sharing one registration.
    pub fn split(mut self) -> (UnixReadHalf, UnixConn) {
        let read = UnixReadHalf { io: Arc::clone(&self.read.io) };
        self.shutdown_on_drop = true;
        (read, self)
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.read.io.get_ref().as_fd()
    }

    /// Its reading side, as the read half of a split connection has it.
    pub fn reader(&self) -> &UnixReadHalf {
        &self.read
    }

    /// Writes what the socket takes now without waiting (`WouldBlock` if nothing).
    pub fn try_write(&self, buf: &[u8]) -> io::Result<usize> {
        send(self.fd(), buf)
    }

    /// Like [`UnixConn::try_write`], passing `files` with the first byte written.
    pub fn try_write_with_files(&self, buf: &[u8], files: &[BorrowedFd<'_>]) -> io::Result<usize> {
        shm::send_with_files(self.fd(), buf, files)
    }

    /// Waits until the socket takes bytes (at once if it does now).
    pub async fn writable(&self) -> io::Result<()> {
        let waiting = self.wait_for_room()?;
        let _ready = waiting.writable().await?;
        Ok(())
    }

    /// A registration for writability of a duplicate descriptor: the kernel reports
    /// the socket ready at once if it has room now, so no wake-up is lost between
    /// the write that found it full and this.
    fn wait_for_room(&self) -> io::Result<AsyncFd<OwnedFd>> {
        let duplicate = self.fd().try_clone_to_owned()?;
        // SAFETY: the descriptor is the AsyncFd's own (a duplicate), open until it drops.
        unsafe { AsyncFd::register_with_interest(duplicate, Interest::WRITABLE) }.map_err(io::Error::from)
    }

    /// Shuts writing down: the peer reads the end of the stream.
    pub fn shutdown_write(&self) -> io::Result<()> {
        self.read.io.get_ref().shutdown(Shutdown::Write)
    }
}

/// Reads what the socket has into `buf`, as tokio's streams do.
fn poll_read(io: &Registered, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
    loop {
        let mut ready = ready!(io.poll_read_ready(cx))?;
        // SAFETY: the kernel only writes into these bytes; the ones it wrote are
        // marked initialized below, and nothing here de-initializes any.
        let unfilled = unsafe { buf.unfilled_mut() };
        let asked = unfilled.len();
        let read = ready.try_io(|io| {
            let ((read, _), _) = rustix::net::recv(io.get_ref(), unfilled, RecvFlags::DONTWAIT)?;
            Ok(read.len())
        });
        if let Ok(read) = read {
            let n = read?;
            // SAFETY: `recv` initialized the first `n` bytes of the unfilled part.
            unsafe { buf.assume_init(n) };
            buf.advance(n);
            if n > 0 && n < asked {
                ready.clear_ready();
            }
            return Poll::Ready(Ok(()));
        }
    }
}

/// The read half of a split [`UnixConn`].
pub struct UnixReadHalf {
    io: Arc<Registered>,
}

impl UnixReadHalf {
    /// Reads what the socket has into `buf` (making room for `room` bytes); files
    /// passed with the bytes are appended to `files`. `Pending` once it had nothing.
    pub fn poll_recv_with_files(
        &self,
        cx: &mut Context<'_>,
        buf: &mut BytesMut,
        room: usize,
        files: &mut VecDeque<OwnedFd>,
    ) -> Poll<io::Result<usize>> {
        loop {
            let mut ready = ready!(self.io.poll_read_ready(cx))?;
            let had_files = files.len();
            let asked = shm::read_size(room);
            // `WouldBlock` clears the readiness: the next poll registers `cx`.
            if let Ok(read) = ready.try_io(|io| shm::recv_with_files(io.get_ref().as_fd(), buf, room, files)) {
                if matches!(read, Ok(n) if n > 0 && n < asked) && files.len() == had_files {
                    ready.clear_ready();
                }
                return Poll::Ready(read);
            }
        }
    }
}

impl AsyncRead for UnixReadHalf {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        poll_read(&self.io, cx, buf)
    }
}

/// A listening Unix socket whose connections are [`UnixConn`]s, registered once
/// (tokio's listener would register each for both directions first).
pub struct UnixAcceptor {
    io: AsyncFd<OwnedFd>,
}

/// Connections the kernel queues for an acceptor before refusing more, as tokio's
/// listeners do.
const BACKLOG: i32 = 1024;

impl UnixAcceptor {
    /// Binds and listens at `path` (which must not exist).
    pub fn bind(path: &Path) -> io::Result<UnixAcceptor> {
        let socket = rustix::net::socket_with(AddressFamily::UNIX, SocketType::STREAM, SOCKET_FLAGS, None)?;
        rustix::net::bind(&socket, &SocketAddrUnix::new(path)?)?;
        rustix::net::listen(&socket, BACKLOG)?;
        // SAFETY: the descriptor is the AsyncFd's own, open until it drops.
        let io = unsafe { AsyncFd::register_with_interest(socket, Interest::READABLE) }.map_err(io::Error::from)?;
        Ok(UnixAcceptor { io })
    }

    pub async fn accept(&self) -> io::Result<UnixConn> {
        loop {
            let mut ready = self.io.readable().await?;
            if let Ok(accepted) = ready.try_io(|io| Ok(rustix::net::accept_with(io.get_ref(), SOCKET_FLAGS)?)) {
                return UnixConn::register(accepted?.into());
            }
        }
    }
}

/// Every socket here: non-blocking, and not inherited by the programs a launcher starts.
const SOCKET_FLAGS: SocketFlags = SocketFlags::NONBLOCK.union(SocketFlags::CLOEXEC);

/// A send that neither waits nor raises `SIGPIPE` (a closed peer is an error).
pub(crate) fn send(fd: BorrowedFd<'_>, buf: &[u8]) -> io::Result<usize> {
    Ok(rustix::net::send(fd, buf, SendFlags::DONTWAIT | SendFlags::NOSIGNAL)?)
}

impl Drop for UnixConn {
    fn drop(&mut self) {
        if self.shutdown_on_drop {
            // Already shut down, or the peer is gone: nothing left to tell it.
            let _ = self.shutdown_write();
        }
    }
}

impl AsyncRead for UnixConn {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        poll_read(&self.read.io, cx, buf)
    }
}

impl AsyncWrite for UnixConn {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.room.is_none() {
            match this.try_write(buf) {
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => this.room = Some(this.wait_for_room()?),
                written => return Poll::Ready(written),
            }
        }
        let written = {
            let (Some(room), fd) = (&this.room, this.fd()) else { unreachable!("registered above") };
            loop {
                let mut ready = ready!(room.poll_write_ready(cx))?;
                // `WouldBlock` clears the readiness seen before the write, and only it.
                if let Ok(written) = ready.try_io(|_| send(fd, buf)) {
                    break written;
                }
            }
        };
        this.room = None;
        Poll::Ready(written)
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(self.shutdown_write())
    }
}

#[cfg(test)]
mod tests;
