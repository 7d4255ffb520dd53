//! `bench barrier --raw`: a barrier from clients that cost what the floor's do
//! (module `floor`): a thread per core, each with epoll over its share of
//! blocking-connected sockets, an arrival written and a release read per socket and
//! round, no runtime, no client library, no heartbeats. Only the bytes differ from
//! the floor's: rallypoint's native barrier request and reply frames, or torch's
//! BARRIER request and its one-byte answer. The round against the floor's then
//! tells what the server costs over one that reads 16 bytes and writes 16, with the
//! load generator's own cost (tokio tasks, the library) taken out, for our
//! coordinator and torch's server alike.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::Duration;

use anyhow::{bail, ensure, Context};
use bytes::BytesMut;
use rallypoint_client::{Identity, Members};
use rallypoint_core::{Request, Response};
use rallypoint_proto::native::{
    decode_server_frame, encode_client_frame, encode_preamble, encode_request_frame, ClientFrame, FrameLimits,
    ServerFrame,
};
use rallypoint_proto::tcpstore::{encode_command, Command, VALIDATE_MAGIC};

use crate::floor::{write_whole, Wire};

/// A blocking connection to `addr` from `source` (if given), without Nagle's delay,
/// whose reads give up after `timeout`.
fn dial(addr: SocketAddr, source: Option<IpAddr>, timeout: Duration) -> anyhow::Result<TcpStream> {
    let socket = socket2::Socket::new(socket2::Domain::for_address(addr), socket2::Type::STREAM, None)?;
    if let Some(ip) = source {
        socket.bind(&SocketAddr::new(ip, 0).into())?;
    }
    socket.connect_timeout(&addr.into(), timeout)?;
    let conn = TcpStream::from(socket);
    conn.set_nodelay(true)?;
    conn.set_read_timeout(Some(timeout))?;
    Ok(conn)
}

/// Connects to the coordinator at `addr` (from `source`, if given) and says hello as
/// `identity` (with this host, pid and incarnation, as the bare client says it);
/// returns once welcomed.
pub(crate) fn connect(
    addr: SocketAddr,
    source: Option<IpAddr>,
    identity: Identity,
    timeout: Duration,
) -> anyhow::Result<TcpStream> {
    let mut conn = dial(addr, source, timeout)?;
    let mut out = BytesMut::new();
    encode_preamble(&mut out);
    encode_client_frame(&ClientFrame::Hello(crate::bare::as_library_says(identity)), &mut out);
    conn.write_all(&out)?;
    match read_frame(&conn, &mut BytesMut::new())? {
        ServerFrame::Welcome(_) => Ok(conn),
        ServerFrame::Refused(error) => bail!("refused: {error}"),
        _ => bail!("expected a welcome"),
    }
}

/// The next whole frame from a blocking connection (`buf` holds what came of it).
fn read_frame(mut conn: &TcpStream, buf: &mut BytesMut) -> anyhow::Result<ServerFrame> {
    let mut chunk = [0u8; 256];
    loop {
        if let Some(frame) = decode_server_frame(buf, &FrameLimits::unbounded())? {
            return Ok(frame);
        }
        let got = conn.read(&mut chunk).context("reading from the coordinator")?;
        ensure!(got > 0, "the coordinator closed the connection");
        buf.extend_from_slice(&chunk[..got]);
    }
}

/// A thread's share of native connections: each round, barrier `name` of the
/// whole job, under the next request id of its connection.
pub(crate) struct Native {
    request: Request,
    /// Each connection's last request id (ids start at 1).
    ids: Vec<u64>,
    /// What came of each connection's release so far.
    read: Vec<BytesMut>,
    out: BytesMut,
}

impl Native {
    pub(crate) fn new(share: usize, name: &str, timeout: Duration) -> Native {
        let timeout_ms = Some(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX));
        Native {
            request: Request::Barrier { name: name.into(), members: Members::World, timeout_ms },
            ids: vec![0; share],
            read: (0..share).map(|_| BytesMut::new()).collect(),
            out: BytesMut::new(),
        }
    }

    /// Writes `request` as connection `i`'s next call.
    fn send(&mut self, i: usize, conn: &TcpStream, request: &Request) -> anyhow::Result<()> {
        self.ids[i] += 1;
        self.out.clear();
        encode_request_frame(self.ids[i], request, &mut self.out);
        write_whole(conn, &self.out)
    }

    /// Checks `frame`, read on connection `i`: it must answer its last request with `Done`.
    fn answered(&self, i: usize, frame: ServerFrame) -> anyhow::Result<()> {
        match frame {
            ServerFrame::Reply { id, reply: Ok(Response::Done) } if id == self.ids[i] => Ok(()),
            ServerFrame::Reply { id, reply } => bail!("request {id} of connection {i} answered {reply:?}"),
            _ => bail!("connection {i} got a frame other than a reply"),
        }
    }
}

impl Wire for Native {
    fn arrive(&mut self, i: usize, conn: &TcpStream) -> anyhow::Result<()> {
        let request = self.request.clone();
        self.send(i, conn, &request)
    }

    fn take(&mut self, i: usize, bytes: &[u8]) -> anyhow::Result<bool> {
        self.read[i].extend_from_slice(bytes);
        let frame = decode_server_frame(&mut self.read[i], &FrameLimits::unbounded())?;
        frame.map(|frame| self.answered(i, frame)).transpose().map(|answered| answered.is_some())
    }

    /// Leaves, as a closed client does, so that the coordinator does not count the
    /// ranks as lost (and does that work while the next benchmark runs).
    fn finish(&mut self, conns: &[TcpStream]) -> anyhow::Result<()> {
        for (i, conn) in conns.iter().enumerate() {
            self.send(i, conn, &Request::Leave)?;
            let frame = read_frame(conn, &mut self.read[i]).context("reading the answer to a leave")?;
            self.answered(i, frame)?;
        }
        Ok(())
    }
}

/// Connects to a TCPStore server at `addr` (from `source`, if given) as torch 2.15's
/// client does: VALIDATE with the magic, then PING with the pid, whose echo is checked.
pub(crate) fn connect_store(addr: SocketAddr, source: Option<IpAddr>, timeout: Duration) -> anyhow::Result<TcpStream> {
    let mut conn = dial(addr, source, timeout)?;
    let nonce = std::process::id();
    let mut out = BytesMut::new();
    encode_command(&Command::Validate { magic: VALIDATE_MAGIC }, &mut out);
    encode_command(&Command::Ping { nonce }, &mut out);
    conn.write_all(&out)?;
    let mut echo = [0u8; 4];
    conn.read_exact(&mut echo).context("reading the answer to PING")?;
    ensure!(u32::from_le_bytes(echo) == nonce, "PING echoed {}, not {nonce}", u32::from_le_bytes(echo));
    Ok(conn)
}

/// A thread's share of TCPStore connections: each round, a BARRIER request (type
/// 18) of `world_size` on a key of its own (the counter never resets), answered by
/// one byte, STOP_WAITING.
pub(crate) struct Store {
    prefix: String,
    world_size: i64,
    /// Each connection's rounds so far.
    rounds: Vec<u64>,
    out: BytesMut,
}

impl Store {
    pub(crate) fn new(share: usize, prefix: &str, world_size: u32) -> Store {
        Store {
            prefix: prefix.to_owned(),
            world_size: i64::from(world_size),
            rounds: vec![0; share],
            out: BytesMut::new(),
        }
    }
}

impl Wire for Store {
    fn arrive(&mut self, i: usize, conn: &TcpStream) -> anyhow::Result<()> {
        let key = format!("{}{}", self.prefix, self.rounds[i]);
        self.rounds[i] += 1;
        self.out.clear();
        encode_command(&Command::Barrier { key: key.into(), world_size: self.world_size }, &mut self.out);
        write_whole(conn, &self.out)
    }

    fn take(&mut self, i: usize, bytes: &[u8]) -> anyhow::Result<bool> {
        // One request in flight: its answer is one byte, and nothing else comes.
        ensure!(bytes == [0], "BARRIER on connection {i} answered {bytes:?} instead of STOP_WAITING");
        Ok(true)
    }
}
