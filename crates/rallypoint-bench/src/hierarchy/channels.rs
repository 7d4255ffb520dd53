//! `bench hierarchy --channels`: a load generator whose ranks arrive through the
//! agents' barrier channels (docs/PROTOCOL.md, section 15), as the client library
//! does on a Unix socket, instead of one request and one reply per rank and round.
//!
//! Each rank's first call is an AttachBarrier on its own connection. The agent
//! answers BarrierChannel (a slot of a channel; the channel's memory file,
//! doorbell and release bell come with the first BarrierChannel naming that channel
//! *on the connection*, and every rank here has a connection of its own, so every answer
//! carries them) or NoBarrierChannel (TCP, an agent out of channels), and then the
//! call's reply. A rank without a channel makes its later calls as requests, as the
//! client does. The files of a channel this process has mapped already are closed
//! at once: a generator holds up to 16,000 connections under a 20,000-file limit,
//! so it maps each distinct channel once, whatever number of its ranks sit in it.
//!
//! Later rounds go through shared memory: one thread (the *driver*) arrives every
//! seated rank of the process through [`RankChannel::arrive`] (count, slot, and the
//! doorbell when the arrival must ring it), then sleeps on each channel's release
//! word until the agent has finished every one of this process's slots in it, and
//! checks each slot's outcome. One thread for all the process's ranks: a thread
//! per simulated rank would measure the scheduler.
//!
//! Failure is read, never assumed away: a seated rank's socket carries nothing
//! while its rounds succeed, so a task per connection waits on it, and any frame
//! (the coordinator's error, the reply to a failed slot's call) or the
//! connection's end fails the run with what it said. A slot marked failed fails
//! the run too, with the error that comes on that rank's socket.

use std::collections::{HashMap, VecDeque};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bytes::BytesMut;
use rallypoint_core::{Request, Response};
use rallypoint_net::shm_barrier::{Outcome, RankChannel};
use rallypoint_net::sync::lock;
use rallypoint_proto::native::{decode_server_frame, encode_client_frame, ClientFrame, FrameLimits, ServerFrame};
use tokio::task::JoinSet;

use super::{ready_and_go, report, Conn, RankSetup};

/// How long the driver waits on a channel's release word at a time before it looks
/// whether a rank's task failed meanwhile (a lost connection rings no futex here).
const LOOK_FOR_FAILURE: Duration = Duration::from_millis(20);
/// Past the barrier's own timeout, how long a round may take before the driver
/// gives up on the agent (the coordinator fails the round at its timeout, and the
/// agent marks the slots: waiting longer means the agent stopped answering).
const AGENT_SLACK: Duration = Duration::from_secs(10);
/// How long the generator waits, after a slot was marked failed, for the error
/// that the protocol sends on the rank's socket.
const ERROR_FOLLOWS: Duration = Duration::from_secs(5);

/// The barrier channels this process mapped, by (agent, channel id): channel ids
/// are the agent's, never reused for another file.
#[derive(Default)]
struct Mapped(Mutex<HashMap<(usize, u64), Arc<RankChannel>>>);

impl Mapped {
    /// The channel `channel` of agent `agent`, mapped from `file` and `doorbell`
    /// unless this process has it already (the duplicates are then closed here).
    fn channel(
        &self,
        agent: usize,
        channel: u64,
        file: OwnedFd,
        doorbell: OwnedFd,
    ) -> anyhow::Result<Arc<RankChannel>> {
        let mut mapped = lock(&self.0);
        if let Some(known) = mapped.get(&(agent, channel)) {
            return Ok(Arc::clone(known));
        }
        let rank_channel = RankChannel::map(file, doorbell, None)
            .with_context(|| format!("mapping barrier channel {channel} of agent {agent}"))?;
        let rank_channel = Arc::new(rank_channel);
        mapped.insert((agent, channel), Arc::clone(&rank_channel));
        Ok(rank_channel)
    }
}

/// A rank of this process seated in a channel.
struct Seat {
    rank: u32,
    channel: Arc<RankChannel>,
    slot: u32,
}

/// How a rank's first call went.
enum Attached {
    Seat(Seat),
    /// No channel: its later calls go as requests.
    Messages,
}

/// The state the rank tasks and the driver share.
struct Shared {
    setup: RankSetup,
    mapped: Mapped,
    /// The round the driver is in (for the failure reports of the socket watchers).
    round: AtomicU32,
}

/// Runs ranks `first..first + count` through barrier channels (see the module's
/// header); ranks given no channel through messages.
pub(super) async fn generator(
    setup: RankSetup,
    go: tokio::sync::watch::Sender<u8>,
    addrs: Vec<String>,
    first: u32,
    count: u32,
) -> anyhow::Result<()> {
    let total = setup.total;
    let shared = Arc::new(Shared { setup, mapped: Mapped::default(), round: AtomicU32::new(0) });
    let (attached_tx, mut attached_rx) = tokio::sync::mpsc::unbounded_channel::<Option<Seat>>();
    let mut ranks = JoinSet::new();
    for rank in first..first + count {
        let agent = rank as usize % addrs.len();
        let addr = addrs[agent].clone();
        let (shared, attached_tx) = (Arc::clone(&shared), attached_tx.clone());
        ranks.spawn(async move {
            let (mut conn, mut buf) = shared.setup.connected(rank, &addr).await?;
            let mut files = VecDeque::new();
            let attached = attach(&shared, rank, agent, &mut conn, &mut buf, &mut files).await?;
            shared.setup.released(0, 1);
            match attached {
                Attached::Seat(seat) => {
                    let _ = attached_tx.send(Some(seat));
                    drop(attached_tx);
                    // Nothing comes on the socket while the rounds succeed.
                    let said = conn.frame_with_files(&mut buf, &mut files).await;
                    let round = shared.round.load(Ordering::Acquire);
                    match said {
                        Ok(frame) => bail!("rank {rank}: barrier round {round} failed: the agent sent {frame:?}"),
                        Err(error) => Err(error.context(format!("rank {rank}: during barrier round {round}"))),
                    }
                }
                Attached::Messages => {
                    let _ = attached_tx.send(None);
                    drop(attached_tx);
                    for k in 1..total {
                        shared.setup.before_round(k).await?;
                        call(
                            &mut conn,
                            &mut buf,
                            rank,
                            k,
                            ClientFrame::Request { id: k as u64 + 1, request: request() },
                        )
                        .await?;
                        shared.setup.released(k, 1);
                    }
                    Ok(conn)
                }
            }
        });
    }
    drop(attached_tx);
    let mut started = ready_and_go(&shared.setup, &mut ranks, go).await?;
    let setup = &shared.setup;
    // The driver waits on this before the first measured round.
    let (resume_tx, resume_rx) = std::sync::mpsc::channel::<()>();

    // Round 0 (the attach calls, through the sockets) ends once every rank is seated
    // or refused a channel.
    let mut seats = Vec::new();
    let mut heard = 0;
    let mut conns = Vec::new();
    while heard < count {
        tokio::select! {
            attached = attached_rx.recv() => match attached {
                Some(seat) => {
                    heard += 1;
                    seats.extend(seat);
                }
                None => bail!("a rank ended before its first barrier call was answered"),
            },
            Some(done) = ranks.join_next() => conns.push(done??),
        }
    }
    let through_channels = seats.len() as u32;
    let by_messages = count - through_channels;

    let abort = Arc::new(AtomicBool::new(false));
    let (done_tx, mut done_rx) = tokio::sync::oneshot::channel();
    {
        let (shared, abort) = (Arc::clone(&shared), Arc::clone(&abort));
        std::thread::Builder::new()
            .name("channel-driver".to_owned())
            .spawn(move || {
                let _ = done_tx.send(drive(&shared, seats, &resume_rx, &abort));
            })
            .context("starting the barrier channels' driver thread")?;
    }
    // The driver stops at its next look if this returns early.
    let _stop = StopOnDrop(&abort);
    let mut driven = false;
    while !driven || conns.len() < by_messages as usize {
        let round_done = setup.round_done.notified();
        tokio::pin!(round_done);
        round_done.as_mut().enable();
        if started.measure_when_warm(setup).await? {
            // Ranks through messages were let go by `measure_when_warm`.
            let _ = resume_tx.send(());
            continue;
        }
        tokio::select! {
            () = round_done => {}
            done = &mut done_rx, if !driven => {
                match done.context("the driver thread ended without a word")? {
                    Ok(()) => driven = true,
                    Err(failed) => return Err(failed_with_its_error(failed, &mut ranks).await),
                }
            }
            Some(done) = ranks.join_next() => conns.push(done??),
        }
    }
    report(setup, started, through_channels).await?;
    drop(conns);
    Ok(())
}

/// Sets the driver's stop flag when the generator ends (early: a rank failed).
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// The driver stopped at `failed`: the error, with what came on a rank's socket
/// (the coordinator's error, the reply to a failed slot's call) if it comes soon.
async fn failed_with_its_error(failed: Failed, ranks: &mut JoinSet<anyhow::Result<Conn>>) -> anyhow::Error {
    let until = tokio::time::Instant::now() + ERROR_FOLLOWS;
    while let Ok(Some(done)) = tokio::time::timeout_at(until, ranks.join_next()).await {
        match done {
            // A rank through messages that finished its rounds.
            Ok(Ok(_)) => {}
            Ok(Err(error)) => return error.context(failed.to_string()),
            Err(error) => return anyhow::Error::from(error).context(failed.to_string()),
        }
    }
    anyhow::anyhow!("{failed} (and nothing came on the rank's socket within {ERROR_FOLLOWS:?})")
}

/// The barrier request every round makes.
fn request() -> Request {
    super::bench_barrier()
}

/// Makes the first call as an AttachBarrier and reads the channel answer (with its
/// files) and the call's reply.
async fn attach(
    shared: &Shared,
    rank: u32,
    agent: usize,
    conn: &mut Conn,
    buf: &mut BytesMut,
    files: &mut VecDeque<OwnedFd>,
) -> anyhow::Result<Attached> {
    let mut frame = BytesMut::new();
    encode_client_frame(&ClientFrame::AttachBarrier { id: 1, request: request() }, &mut frame);
    conn.write_all(&frame).await?;
    let attached = match conn.frame_with_files(buf, files).await? {
        ServerFrame::BarrierChannel { id: 1, channel, slot } => {
            // The first BarrierChannel naming a channel on a connection carries its
            // memory file, doorbell and release bell; this connection has no other.
            // Its ranks wait on the futex: the bell is closed here.
            let (Some(file), Some(doorbell), Some(_bell)) = (files.pop_front(), files.pop_front(), files.pop_front())
            else {
                bail!("rank {rank}: barrier channel {channel} came without its files");
            };
            let channel_map = shared.mapped.channel(agent, channel, file, doorbell)?;
            if slot >= channel_map.slots() {
                bail!("rank {rank}: slot {slot} of barrier channel {channel}, which has {}", channel_map.slots());
            }
            Attached::Seat(Seat { rank, channel: channel_map, slot })
        }
        ServerFrame::NoBarrierChannel { id: 1, reason } => {
            tracing::debug!(rank, %reason, "no barrier channel; the rank's barriers go through messages");
            Attached::Messages
        }
        other => bail!("rank {rank}: expected a barrier channel answer, got {other:?}"),
    };
    if !files.is_empty() {
        bail!("rank {rank}: {} unexpected files came with the channel answer", files.len());
    }
    expect_done(conn.frame_with_files(buf, files).await?, rank, 0)?;
    Ok(attached)
}

/// Sends `frame` (round `k` of `rank`) and reads its reply.
async fn call(conn: &mut Conn, buf: &mut BytesMut, rank: u32, k: usize, frame: ClientFrame) -> anyhow::Result<()> {
    let mut out = BytesMut::new();
    encode_client_frame(&frame, &mut out);
    conn.write_all(&out).await?;
    expect_done(conn.frame(buf).await?, rank, k)
}

fn expect_done(frame: ServerFrame, rank: u32, k: usize) -> anyhow::Result<()> {
    match frame {
        ServerFrame::Reply { reply: Ok(Response::Done), .. } => Ok(()),
        other => bail!("rank {rank}: barrier round {k} failed: {other:?}"),
    }
}

/// Why the driver stopped before the last round.
#[derive(Debug)]
enum Failed {
    /// The agent marked a slot failed: the error is on the rank's socket.
    Slot { rank: u32, round: usize },
    /// The agent did not finish a slot in time.
    TimedOut { rank: u32, round: usize, waited: Duration },
    /// The generator is ending (a rank failed: it reports why).
    Aborted,
}

impl std::fmt::Display for Failed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failed::Slot { rank, round } => {
                write!(f, "barrier round {round} failed (rank {rank}'s channel slot says so)")
            }
            Failed::TimedOut { rank, round, waited } => {
                write!(f, "rank {rank}: barrier round {round} not finished by the agent within {waited:?}")
            }
            Failed::Aborted => write!(f, "stopped: the generator is ending"),
        }
    }
}

/// A channel and this process's slots in it.
struct Group {
    channel: Arc<RankChannel>,
    /// (rank, slot)
    slots: Vec<(u32, u32)>,
}

/// Rounds 1.. of every seated rank: arrive all, then wait for each channel's
/// release of this process's slots and check their outcomes.
fn drive(
    shared: &Shared,
    seats: Vec<Seat>,
    resume: &std::sync::mpsc::Receiver<()>,
    abort: &AtomicBool,
) -> Result<(), Failed> {
    let seated = seats.len() as u32;
    let mut groups: Vec<Group> = Vec::new();
    for Seat { rank, channel, slot } in seats {
        match groups.iter_mut().find(|g| Arc::ptr_eq(&g.channel, &channel)) {
            Some(group) => group.slots.push((rank, slot)),
            None => groups.push(Group { channel, slots: vec![(rank, slot)] }),
        }
    }
    let limit = Duration::from_millis(super::BARRIER_TIMEOUT_MS) + AGENT_SLACK;
    for k in 1..shared.setup.total {
        if k == shared.setup.warmup && resume.recv().is_err() {
            // The generator ended during the pause after the warm-up.
            return Err(Failed::Aborted);
        }
        shared.round.store(k as u32, Ordering::Release);
        // A slot's rounds count from 1 after the attach call; each call has a fresh id.
        let (round, id) = (k as u32, k as u64 + 1);
        for group in &groups {
            for &(_, slot) in &group.slots {
                group.channel.arrive(slot, round, id);
            }
        }
        let deadline = Instant::now() + limit;
        for group in &groups {
            let mut next = 0;
            loop {
                // Read before looking at the slots: a release in between ends the wait at once.
                let seen = group.channel.release_word();
                while let Some(&(rank, slot)) = group.slots.get(next) {
                    match group.channel.outcome(slot, round) {
                        Some(Outcome::Released) => next += 1,
                        Some(Outcome::Failed) => return Err(Failed::Slot { rank, round: k }),
                        None => break,
                    }
                }
                let Some(&(rank, _)) = group.slots.get(next) else { break };
                if abort.load(Ordering::Acquire) {
                    return Err(Failed::Aborted);
                }
                let now = Instant::now();
                if now >= deadline {
                    return Err(Failed::TimedOut { rank, round: k, waited: limit });
                }
                group.channel.wait_release(seen, (deadline - now).min(LOOK_FOR_FAILURE));
            }
        }
        shared.setup.released(k, seated);
    }
    Ok(())
}

impl Conn {
    /// The next frame from the agent, with the files that come with it (Unix sockets).
    pub(super) async fn frame_with_files(
        &mut self,
        buf: &mut BytesMut,
        files: &mut VecDeque<OwnedFd>,
    ) -> anyhow::Result<ServerFrame> {
        let Conn::Unix(stream) = self else { return self.frame(buf).await };
        loop {
            if let Some(frame) = decode_server_frame(buf, &FrameLimits::unbounded())? {
                return Ok(frame);
            }
            if std::future::poll_fn(|cx| stream.reader().poll_recv_with_files(cx, buf, 1024, files)).await? == 0 {
                bail!("the agent closed the connection");
            }
        }
    }
}
