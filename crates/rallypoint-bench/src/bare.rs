//! `bench barrier --bare`: rallypoint's native barrier spoken directly, without the
//! client library: one task per socket with its own buffers, one request in flight,
//! no reply slots, no connection task, no heartbeats, no resume. It is what the
//! benchmark's TCPStore load is to torch's protocol, so the two protocols are
//! compared on equal terms, and what the client library costs per call shows as
//! the difference between this load and `--protocol native`. It says the hello the
//! library says (host, pid, incarnation), so the coordinator keeps for its calls
//! what it keeps for the library's: only the client's side differs.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use anyhow::{bail, Context};
use bytes::BytesMut;
use rallypoint_client::{process_incarnation, Identity, Members};
use rallypoint_core::{Request, Response};
use rallypoint_proto::native::{
    decode_server_frame, encode_client_frame, encode_preamble, ClientFrame, FrameLimits, ServerFrame,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::connect_tcp;

/// One native connection that has been welcomed.
pub struct BareConn {
    stream: TcpStream,
    /// Bytes read and not decoded yet.
    read: BytesMut,
    /// The frame being written.
    out: BytesMut,
    next_id: u64,
}

impl BareConn {
    /// Connects (from `source`, if given) and says hello as `identity`, with this
    /// host, pid and process incarnation as the client library fills them in; returns
    /// once welcomed.
    pub async fn connect(addr: SocketAddr, source: Option<IpAddr>, identity: Identity) -> anyhow::Result<BareConn> {
        let identity = as_library_says(identity);
        let stream = connect_tcp(addr, source).await?;
        let mut conn = BareConn { stream, read: BytesMut::with_capacity(256), out: BytesMut::new(), next_id: 1 };
        encode_preamble(&mut conn.out);
        encode_client_frame(&ClientFrame::Hello(identity), &mut conn.out);
        conn.flush().await?;
        match conn.frame().await? {
            ServerFrame::Welcome(_) => Ok(conn),
            ServerFrame::Refused(error) => bail!("refused: {error}"),
            other => bail!("expected a welcome, got {}", describe(&other)),
        }
    }

    async fn flush(&mut self) -> anyhow::Result<()> {
        self.stream.write_all(&self.out).await?;
        self.out.clear();
        Ok(())
    }

    /// The next whole frame from the coordinator.
    async fn frame(&mut self) -> anyhow::Result<ServerFrame> {
        loop {
            if let Some(frame) = decode_server_frame(&mut self.read, &FrameLimits::unbounded())? {
                return Ok(frame);
            }
            if self.stream.read_buf(&mut self.read).await.context("reading from the coordinator")? == 0 {
                bail!("the coordinator closed the connection");
            }
        }
    }

    /// Sends `request` and waits for its reply, which must be `Done`.
    async fn call(&mut self, request: Request) -> anyhow::Result<()> {
        let (id, what) = (self.next_id, request.name());
        self.next_id += 1;
        encode_client_frame(&ClientFrame::Request { id, request }, &mut self.out);
        self.flush().await?;
        match self.frame().await? {
            ServerFrame::Reply { id: replied, reply } if replied == id => match reply? {
                Response::Done => Ok(()),
                other => bail!("unexpected reply to {what}: {other:?}"),
            },
            other => bail!("expected the reply to request {id}, got {}", describe(&other)),
        }
    }

    /// One barrier `name` of the whole job; the coordinator gives up on it after `timeout`.
    pub async fn barrier(&mut self, name: &str, timeout: Duration) -> anyhow::Result<()> {
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        self.call(Request::Barrier { name: name.into(), members: Members::World, timeout_ms: Some(timeout_ms) }).await
    }

    /// Leaves as a closed client does, so that the coordinator does not count the
    /// rank as lost (and does that work while the next benchmark runs).
    pub async fn leave(mut self) -> anyhow::Result<()> {
        self.call(Request::Leave).await
    }
}

/// `identity` with this host, pid and process incarnation, as the client library
/// fills them in.
pub(crate) fn as_library_says(mut identity: Identity) -> Identity {
    identity.host = rallypoint_net::hostname();
    identity.pid = std::process::id();
    identity.incarnation = Some(process_incarnation());
    identity
}

fn describe(frame: &ServerFrame) -> String {
    match frame {
        ServerFrame::Reply { id, .. } => format!("the reply to request {id}"),
        ServerFrame::Welcome(_) => "a welcome".to_owned(),
        ServerFrame::Refused(error) => format!("a refusal ({error})"),
        _ => "a frame this client never asked for".to_owned(),
    }
}
