//! `bench barrier --raw`: rallypoint's native barrier from clients that cost what
//! the floor's do (module `floor`): a thread per core, each with epoll over its share
//! of blocking-connected sockets, an arrival written and a release read per socket
//! and round, no runtime, no client library, no heartbeats. Only the bytes differ
//! from the floor's: a barrier request's frame each way in, a reply's frame out.
//! The round against the floor's then tells what the coordinator costs over a
//! server that reads 16 bytes and writes 16, with the load generator's own cost
//! (tokio tasks, the library) taken out.

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

use crate::floor::Wire;

/// Connects to the coordinator at `addr` (from `source`, if given) and says hello as
/// `identity` (with this host, pid and incarnation, as the bare client says it);
/// returns once welcomed.
pub(crate) fn connect(
    addr: SocketAddr,
    source: Option<IpAddr>,
    identity: Identity,
    timeout: Duration,
) -> anyhow::Result<TcpStream> {
    let socket = socket2::Socket::new(socket2::Domain::for_address(addr), socket2::Type::STREAM, None)?;
    if let Some(ip) = source {
        socket.bind(&SocketAddr::new(ip, 0).into())?;
    }
    socket.connect_timeout(&addr.into(), timeout)?;
    let mut conn = TcpStream::from(socket);
    conn.set_nodelay(true)?;
    conn.set_read_timeout(Some(timeout))?;
    let mut out = BytesMut::new();
    encode_preamble(&mut out);
    encode_client_frame(&ClientFrame::Hello(crate::bare::as_library_says(identity)), &mut out);
    conn.write_all(&out)?;
    match read_frame(&mut conn, &mut BytesMut::new())? {
        ServerFrame::Welcome(_) => Ok(conn),
        ServerFrame::Refused(error) => bail!("refused: {error}"),
        _ => bail!("expected a welcome"),
    }
}

/// The next whole frame from a blocking connection.
fn read_frame(conn: &mut TcpStream, buf: &mut BytesMut) -> anyhow::Result<ServerFrame> {
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
    fn send(&mut self, i: usize, mut conn: &TcpStream, request: &Request) -> anyhow::Result<()> {
        self.ids[i] += 1;
        self.out.clear();
        encode_request_frame(self.ids[i], request, &mut self.out);
        // A small frame into a socket whose peer read everything before: always whole.
        ensure!(conn.write(&self.out)? == self.out.len(), "a request did not fit into its socket");
        Ok(())
    }

    /// Connection `i`'s reply, if whole in what was read: it must answer its last
    /// request with `Done`.
    fn reply(&mut self, i: usize) -> anyhow::Result<Option<()>> {
        match decode_server_frame(&mut self.read[i], &FrameLimits::unbounded())? {
            None => Ok(None),
            Some(ServerFrame::Reply { id, reply: Ok(Response::Done) }) if id == self.ids[i] => Ok(Some(())),
            Some(ServerFrame::Reply { id, reply }) => bail!("request {id} of connection {i} answered {reply:?}"),
            Some(_) => bail!("connection {i} got a frame other than a reply"),
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
        Ok(self.reply(i)?.is_some())
    }

    /// Leaves, as a closed client does, so that the coordinator does not count the
    /// ranks as lost (and does that work while the next benchmark runs).
    fn finish(&mut self, conns: &[TcpStream]) -> anyhow::Result<()> {
        for (i, mut conn) in conns.iter().enumerate() {
            self.send(i, conn, &Request::Leave)?;
            let mut chunk = [0u8; 256];
            while self.reply(i)?.is_none() {
                let got = conn.read(&mut chunk).context("reading the answer to a leave")?;
                ensure!(got > 0, "the coordinator closed a connection before answering its leave");
                self.read[i].extend_from_slice(&chunk[..got]);
            }
        }
        Ok(())
    }
}
