//! The client side of PyTorch's TCPStore protocol, for `--protocol tcpstore`: one
//! connection, requests encoded with `rallypoint_proto::tcpstore`, replies read the
//! way torch 2.15's client reads them. The same load then runs against torch's own
//! server and against rallypoint, so the two are compared without Python or torch's
//! client library in the way.

use std::net::{IpAddr, SocketAddr};
use std::ops::Range;
use std::time::Duration;

use anyhow::{bail, ensure, Context};
use bytes::{Bytes, BytesMut};
use rallypoint_proto::tcpstore::{encode_command, Command, VALIDATE_MAGIC};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use crate::Sources;

/// Longest value the client accepts in a reply: torch's server limit (8 MiB), so
/// a corrupt length fails instead of allocating.
const MAX_VALUE_LEN: u64 = 8 << 20;

/// One TCPStore connection that has done torch's handshake.
pub struct StoreConn {
    stream: BufReader<TcpStream>,
    out: BytesMut,
    nonce: u32,
}

fn key(k: &str) -> Bytes {
    Bytes::copy_from_slice(k.as_bytes())
}

impl StoreConn {
    /// Connects (from `source`, if given) and sends what torch 2.15's client sends
    /// first, in one segment: VALIDATE with the magic (no reply), then PING with the
    /// pid as nonce, whose echo is checked.
    pub async fn connect(addr: SocketAddr, source: Option<IpAddr>) -> anyhow::Result<StoreConn> {
        let stream = crate::connect_tcp(addr, source).await?;
        let mut conn = StoreConn { stream: BufReader::new(stream), out: BytesMut::new(), nonce: std::process::id() };
        encode_command(&Command::Validate { magic: VALIDATE_MAGIC }, &mut conn.out);
        conn.ping().await?;
        Ok(conn)
    }

    /// The connection, for holding it open without using it.
    pub fn into_stream(self) -> TcpStream {
        self.stream.into_inner()
    }

    /// Appends a request to the send buffer; [`StoreConn::flush`] sends it.
    fn push(&mut self, command: &Command) {
        encode_command(command, &mut self.out);
    }

    async fn flush(&mut self) -> std::io::Result<()> {
        self.stream.get_mut().write_all(&self.out).await?;
        self.out.clear();
        Ok(())
    }

    async fn read_u8(&mut self) -> anyhow::Result<u8> {
        Ok(self.stream.read_u8().await?)
    }

    async fn read_i64(&mut self) -> anyhow::Result<i64> {
        Ok(self.stream.read_i64_le().await?)
    }

    async fn read_blob(&mut self) -> anyhow::Result<Vec<u8>> {
        let len = self.stream.read_u64_le().await?;
        ensure!(len <= MAX_VALUE_LEN, "the server sent a value of {len} bytes");
        let mut value = vec![0; len as usize];
        self.stream.read_exact(&mut value).await?;
        Ok(value)
    }

    /// WAIT's and BARRIER's answer: `00`, STOP_WAITING.
    async fn read_stop_waiting(&mut self, what: &str) -> anyhow::Result<()> {
        match self.read_u8().await? {
            0 => Ok(()),
            other => bail!("{what} answered {other} instead of STOP_WAITING"),
        }
    }

    /// One PING round trip (the nonce echoed).
    pub async fn ping(&mut self) -> anyhow::Result<()> {
        self.push(&Command::Ping { nonce: self.nonce });
        self.flush().await?;
        let echo = self.stream.read_u32_le().await?;
        ensure!(echo == self.nonce, "PING echoed {echo}, not {}", self.nonce);
        Ok(())
    }

    /// SET: no reply on the wire.
    pub async fn set(&mut self, k: &str, value: &[u8]) -> anyhow::Result<()> {
        self.push(&Command::Set { key: key(k), value: Bytes::copy_from_slice(value) });
        Ok(self.flush().await?)
    }

    /// What torch's `get` does: WAIT for the key, then GET it (two round trips).
    pub async fn get(&mut self, k: &str) -> anyhow::Result<Vec<u8>> {
        self.push(&Command::Wait { keys: vec![key(k)] });
        self.flush().await?;
        self.read_stop_waiting("WAIT").await?;
        self.push(&Command::Get { key: key(k) });
        self.flush().await?;
        self.read_blob().await
    }

    pub async fn add(&mut self, k: &str, delta: i64) -> anyhow::Result<i64> {
        self.add_pipelined(k, delta, 1).await
    }

    /// `depth` ADDs sent back to back, then their `depth` replies read (torch's
    /// server answers in order); returns the last counter value.
    pub async fn add_pipelined(&mut self, k: &str, delta: i64, depth: u32) -> anyhow::Result<i64> {
        let command = Command::Add { key: key(k), delta };
        for _ in 0..depth {
            self.push(&command);
        }
        self.flush().await?;
        let mut last = 0;
        for _ in 0..depth {
            last = self.read_i64().await?;
        }
        Ok(last)
    }

    /// CHECK: true when every key exists.
    pub async fn check(&mut self, keys: &[&str]) -> anyhow::Result<bool> {
        self.push(&Command::Check { keys: keys.iter().map(|k| key(k)).collect() });
        self.flush().await?;
        match self.read_u8().await? {
            0 => Ok(true),
            1 => Ok(false),
            other => bail!("CHECK answered {other}"),
        }
    }

    pub async fn compare_set(&mut self, k: &str, expected: &[u8], desired: &[u8]) -> anyhow::Result<Vec<u8>> {
        self.push(&Command::CompareSet {
            key: key(k),
            expected: Bytes::copy_from_slice(expected),
            desired: Bytes::copy_from_slice(desired),
        });
        self.flush().await?;
        self.read_blob().await
    }

    /// What torch's `multi_get` does: WAIT for all keys, then MULTI_GET.
    pub async fn multi_get(&mut self, keys: &[String]) -> anyhow::Result<Vec<Vec<u8>>> {
        let mut values = Vec::with_capacity(keys.len());
        self.multi_get_each(keys, |_, value| values.push(value)).await?;
        Ok(values)
    }

    /// [`StoreConn::multi_get`], handing each value to `each` (with its index) as it
    /// is read instead of keeping them all.
    pub async fn multi_get_each(
        &mut self,
        keys: &[String],
        mut each: impl FnMut(usize, Vec<u8>),
    ) -> anyhow::Result<()> {
        let keys: Vec<Bytes> = keys.iter().map(|k| key(k)).collect();
        self.wait(&keys).await?;
        let n = keys.len();
        self.push(&Command::MultiGet { keys });
        self.flush().await?;
        for i in 0..n {
            each(i, self.read_blob().await?);
        }
        Ok(())
    }

    /// WAIT: returns once every key exists.
    pub async fn wait(&mut self, keys: &[Bytes]) -> anyhow::Result<()> {
        self.push(&Command::Wait { keys: keys.to_vec() });
        self.flush().await?;
        self.read_stop_waiting("WAIT").await
    }

    /// The server-side BARRIER request (type 18): returns once `world_size` arrivals
    /// have been counted at `k`. The counter never resets, so each round needs its own key.
    pub async fn barrier(&mut self, k: &str, world_size: u32) -> anyhow::Result<()> {
        self.push(&Command::Barrier { key: key(k), world_size: i64::from(world_size) });
        self.flush().await?;
        self.read_stop_waiting("BARRIER").await
    }
}

/// Resolves `--addr` (or the child coordinator's address) to one socket address.
pub fn resolve(addr: &str) -> anyhow::Result<SocketAddr> {
    use std::net::ToSocketAddrs;
    addr.to_socket_addrs()
        .with_context(|| format!("resolving {addr}"))?
        .next()
        .with_context(|| format!("{addr} resolves to no address"))
}

/// Connects one client per index in `ids` (from its source address), a bounded
/// number at a time (see [`crate::connect_bounded`]); each within `timeout`.
pub async fn connect_many(
    addr: SocketAddr,
    ids: Range<u32>,
    sources: Sources,
    timeout: Duration,
) -> anyhow::Result<Vec<StoreConn>> {
    crate::connect_bounded(ids, |i| {
        let source = sources.of(i);
        let what = format!("connecting TCPStore client {i} from {source:?}");
        crate::connect_within(timeout, what, StoreConn::connect(addr, source))
    })
    .await
}
