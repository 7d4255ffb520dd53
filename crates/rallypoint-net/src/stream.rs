//! Byte streams the client and the node agent speak over: TCP, or a Unix domain
//! socket for ranks talking to the agent of their own node (`unix:/path`), which
//! costs the kernel far less per message than loopback TCP.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, Interest, ReadBuf};
use tokio::net::{tcp, unix, TcpListener, TcpStream, UnixListener, UnixStream};

use crate::shm;

/// Prefix of an address naming a Unix domain socket: `unix:/run/rallypoint.sock`.
pub const UNIX_PREFIX: &str = "unix:";

/// The socket path of a `unix:PATH` address, `None` for `host:port`.
pub fn unix_path(addr: &str) -> Option<&Path> {
    addr.strip_prefix(UNIX_PREFIX).map(Path::new)
}

pub enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    /// Connects to `host:port` (with `TCP_NODELAY`) or `unix:PATH`.
    pub async fn connect(addr: &str) -> io::Result<Stream> {
        match unix_path(addr) {
            Some(path) => Ok(Stream::Unix(UnixStream::connect(path).await?)),
            None => {
                let stream = TcpStream::connect(addr).await?;
                stream.set_nodelay(true)?;
                Ok(Stream::Tcp(stream))
            }
        }
    }

    pub fn into_split(self) -> (ReadHalf, WriteHalf) {
        match self {
            Stream::Tcp(s) => {
                let (r, w) = s.into_split();
                (ReadHalf::Tcp(r), WriteHalf::Tcp(w))
            }
            Stream::Unix(s) => {
                let (r, w) = s.into_split();
                (ReadHalf::Unix(r), WriteHalf::Unix(w))
            }
        }
    }
}

pub enum ReadHalf {
    Tcp(tcp::OwnedReadHalf),
    Unix(unix::OwnedReadHalf),
}

pub enum WriteHalf {
    Tcp(tcp::OwnedWriteHalf),
    Unix(unix::OwnedWriteHalf),
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
            ReadHalf::Unix(r) => loop {
                r.readable().await?;
                let stream: &UnixStream = r.as_ref();
                match stream.try_io(Interest::READABLE, || shm::recv_with_files(stream.as_fd(), buf, room, files)) {
                    Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
                    read => return read,
                }
            },
        }
    }
}

impl WriteHalf {
    pub fn is_unix(&self) -> bool {
        matches!(self, WriteHalf::Unix(_))
    }

    /// Writes what the socket takes now without waiting (`WouldBlock` if nothing).
    pub fn try_write(&self, buf: &[u8]) -> io::Result<usize> {
        match self {
            WriteHalf::Tcp(w) => w.try_write(buf),
            WriteHalf::Unix(w) => w.try_write(buf),
        }
    }

    /// Like [`WriteHalf::try_write`], passing `files` with the first byte written
    /// (Unix sockets only; at most [`shm::MAX_FDS_PER_WRITE`]).
    pub fn try_write_with_files(&self, buf: &[u8], files: &[BorrowedFd<'_>]) -> io::Result<usize> {
        match self {
            _ if files.is_empty() => self.try_write(buf),
            WriteHalf::Tcp(_) => {
                Err(io::Error::new(io::ErrorKind::Unsupported, "files can only pass over Unix sockets"))
            }
            WriteHalf::Unix(w) => {
                let stream: &UnixStream = w.as_ref();
                stream.try_io(Interest::WRITABLE, || shm::send_with_files(stream.as_fd(), buf, files))
            }
        }
    }

    pub async fn writable(&self) -> io::Result<()> {
        match self {
            WriteHalf::Tcp(w) => w.writable().await,
            WriteHalf::Unix(w) => w.writable().await,
        }
    }
}

macro_rules! delegate {
    ($self:ident, $inner:ident => $call:expr) => {
        match $self.get_mut() {
            Self::Tcp($inner) => $call,
            Self::Unix($inner) => $call,
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

impl AsyncWrite for WriteHalf {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        delegate!(self, s => Pin::new(s).poll_write(cx, buf))
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        delegate!(self, s => Pin::new(s).poll_flush(cx))
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        delegate!(self, s => Pin::new(s).poll_shutdown(cx))
    }
}

/// A listening socket: TCP, or Unix (whose path is removed when it is dropped).
pub enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener, PathBuf),
}

impl Listener {
    /// Binds `host:port` or `unix:PATH`. A stale socket file at PATH (left by an
    /// agent that was killed) is replaced.
    pub async fn bind(addr: &str) -> io::Result<Listener> {
        match unix_path(addr) {
            Some(path) => {
                match std::fs::remove_file(path) {
                    Ok(()) => {}
                    Err(error) if error.kind() == io::ErrorKind::NotFound => {}
                    Err(error) => return Err(error),
                }
                Ok(Listener::Unix(UnixListener::bind(path)?, path.to_owned()))
            }
            None => Ok(Listener::Tcp(TcpListener::bind(addr).await?)),
        }
    }

    /// The address to give clients, in the form [`Stream::connect`] takes.
    pub fn local_addr(&self) -> io::Result<String> {
        match self {
            Listener::Tcp(l) => Ok(l.local_addr()?.to_string()),
            Listener::Unix(_, path) => Ok(format!("{UNIX_PREFIX}{}", path.display())),
        }
    }

    pub async fn accept(&self) -> io::Result<Stream> {
        match self {
            Listener::Tcp(l) => {
                let (stream, _) = l.accept().await?;
                // Replies are small and latency-bound.
                stream.set_nodelay(true)?;
                Ok(Stream::Tcp(stream))
            }
            Listener::Unix(l, _) => Ok(Stream::Unix(l.accept().await?.0)),
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix(_, path) = self {
            // Best effort: a leftover file is replaced by the next bind anyway.
            let _ = std::fs::remove_file(path);
        }
    }
}
