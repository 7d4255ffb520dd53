//! `bench hierarchy --start`: a job's start at scale, what every job does first.
//!
//! Every rank connects to its node agent and registers (Hello, Welcome), passes
//! one barrier of the whole world, then all-gathers an address (one short value per
//! rank: how ranks learn each other's endpoints). The figure is the time from the
//! moment the parent starts the load generators until the last rank of all of them
//! holds the all-gather's result, with the moment each phase ended for the last
//! rank: all ranks registered, all released from the barrier, all gathered.
//!
//! Nothing holds the ranks at a start line: each goes on as soon as it is
//! welcomed, as the processes of a job do. A generator's ranks connect with a
//! bounded number of attempts in flight (the listen backlogs are finite), which is
//! what a node's ranks starting together look like to their agent.
//!
//! Over Unix sockets the ranks take the all-gather's result as shared memory
//! (docs/PROTOCOL.md, section 13), as the client library does; a rank is given
//! the result, and this generator does not read its N values. In a job, each rank
//! reads them on its own CPU; here every simulated rank shares two cores, where N
//! ranks each decoding N values would measure N² bytes of decoding, not the start.
//! The descriptor of the slab is not taken (the kernel closes descriptors that a
//! reader does not receive): a generator holds up to 16,000 connections under a
//! 20,000-file limit.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context};
use bytes::{Bytes, BytesMut};
use rallypoint_client::Members;
use rallypoint_core::{Request, Response};
use rallypoint_proto::native::{encode_client_frame, ClientFrame, ServerFrame};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::task::JoinSet;

use super::{connect_rank, Conn, BARRIER_TIMEOUT_MS, CONNECTING};
use crate::mono_ns;

/// What a generator reports: when its last rank ended each phase (registered,
/// barrier, all-gather; CLOCK_MONOTONIC ns).
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Stamps {
    pub(super) phase_end_ns: [u64; 3],
    /// Its ranks that took the all-gather's result as shared memory.
    pub(super) shared: u32,
}

/// The address rank `rank` contributes: the same length for every rank below a
/// million, so that the result's size is known.
pub(crate) fn address(rank: u32) -> Bytes {
    Bytes::from(format!("node-{:06}.bench:29500", rank % 1_000_000))
}

/// Counts, per phase, the ranks of this process through it, and stamps when the
/// last one was.
pub(crate) struct Phases {
    count: u32,
    passed: [AtomicU32; 3],
    end_ns: [AtomicU64; 3],
    /// Ranks that took the all-gather's result as shared memory.
    shared: AtomicU32,
}

impl Phases {
    pub(crate) fn new(count: u32) -> Phases {
        Phases { count, passed: Default::default(), end_ns: Default::default(), shared: AtomicU32::new(0) }
    }

    /// One more rank ended `phase`.
    pub(crate) fn passed(&self, phase: usize) {
        if self.passed[phase].fetch_add(1, Ordering::AcqRel) + 1 == self.count {
            self.end_ns[phase].store(mono_ns(), Ordering::Release);
        }
    }

    /// When the last rank ended each phase (0: not all did).
    pub(crate) fn end_ns(&self) -> [u64; 3] {
        std::array::from_fn(|p| self.end_ns[p].load(Ordering::Acquire))
    }
}

/// Runs ranks `first..first + count` of `ranks` through the agents at `addrs`,
/// prints its [`Stamps`] and stays, holding the connections, until the parent
/// has read this process's CPU time (and kills it, or closes stdin).
pub(super) async fn generator(
    ranks: u32,
    first: u32,
    count: u32,
    addrs: Vec<String>,
    incarnation: bool,
) -> anyhow::Result<()> {
    let phases = Arc::new(Phases::new(count));
    let connecting = Arc::new(tokio::sync::Semaphore::new(CONNECTING));
    let mut tasks = JoinSet::new();
    for rank in first..first + count {
        let addr = addrs[rank as usize % addrs.len()].clone();
        let (phases, connecting) = (Arc::clone(&phases), Arc::clone(&connecting));
        tasks.spawn(async move { start_rank(rank, ranks, incarnation, &addr, &phases, &connecting).await });
    }
    let mut conns = Vec::with_capacity(count as usize);
    while let Some(done) = tasks.join_next().await {
        conns.push(done??);
    }
    let stamps = Stamps { phase_end_ns: phases.end_ns(), shared: phases.shared.load(Ordering::Acquire) };
    println!("{}", serde_json::to_string(&stamps)?);
    let _ = BufReader::new(tokio::io::stdin()).lines().next_line().await;
    drop(conns);
    Ok(())
}

/// One rank's start: connect and register, the barrier, the all-gather.
async fn start_rank(
    rank: u32,
    ranks: u32,
    incarnation: bool,
    addr: &str,
    phases: &Phases,
    connecting: &tokio::sync::Semaphore,
) -> anyhow::Result<Conn> {
    let identity = super::rank_identity(rank, ranks, incarnation);
    let mut buf = BytesMut::new();
    let mut conn = {
        let _slot = connecting.acquire().await?;
        // Over a Unix socket, as the client library does.
        let mut conn = connect_rank(addr, &identity, rallypoint_net::unix_path(addr).is_some()).await?;
        match conn.frame(&mut buf).await? {
            ServerFrame::Welcome(_) => {}
            other => bail!("rank {rank}: expected a welcome, got {other:?}"),
        }
        conn
    };
    phases.passed(0);

    let barrier =
        Request::Barrier { name: "start".into(), members: Members::World, timeout_ms: Some(BARRIER_TIMEOUT_MS) };
    call(&mut conn, &mut buf, 1, barrier).await.and_then(|frame| match frame {
        ServerFrame::Reply { reply: Ok(Response::Done), .. } => Ok(()),
        other => bail!("rank {rank}: the start barrier failed: {other:?}"),
    })?;
    phases.passed(1);

    let value = address(rank);
    let size = value.len() as u64;
    let gather = Request::AllGather {
        name: "addresses".into(),
        members: Members::World,
        value,
        timeout_ms: Some(BARRIER_TIMEOUT_MS),
    };
    match call(&mut conn, &mut buf, 2, gather).await? {
        ServerFrame::Reply { reply: Ok(Response::Gathered(gathered)), .. } => {
            if gathered.len() != ranks as usize || gathered.get(rank as usize) != Some(&address(rank)[..]) {
                bail!("rank {rank}: the all-gather gave {} values, not {ranks} with this rank's own", gathered.len());
            }
        }
        // The body is N values of `size` bytes, each with its length.
        ServerFrame::SharedReply { len, .. } if len >= u64::from(ranks) * size => {
            phases.shared.fetch_add(1, Ordering::Relaxed);
        }
        other => bail!("rank {rank}: the all-gather failed: {other:?}"),
    }
    phases.passed(2);
    Ok(conn)
}

/// Sends `request` as call `id` and reads the frame that answers it.
async fn call(conn: &mut Conn, buf: &mut BytesMut, id: u64, request: Request) -> anyhow::Result<ServerFrame> {
    let mut frame = BytesMut::new();
    encode_client_frame(&ClientFrame::Request { id, request }, &mut frame);
    conn.write_all(&frame).await?;
    conn.frame(buf).await.with_context(|| format!("waiting for the reply to call {id}"))
}
