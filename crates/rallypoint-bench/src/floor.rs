//! `rallypoint bench barrier --op floor`: what the kernel alone costs for a barrier
//! round with one TCP connection per rank, measured in the same run as the barriers
//! it bounds. No coordinator, no runtime, no client library, no protocol: a client
//! thread per core (as the load generators have a worker per core) holds its share
//! of N connections and writes a 16-byte arrival on each; a server thread (in a child
//! process, so that each side has its own file-descriptor limit, as a coordinator and
//! its load generator do) reads them all through epoll, one read per ready
//! connection, and once all N arrived writes a 16-byte release on each; each client
//! thread reads its releases through epoll, as they come, and writes a connection's
//! next arrival as soon as its release is read, as a rank that goes on to its next
//! barrier does. A barrier that keeps one connection per rank sends these 2N
//! messages, and nothing it does can take less.
//!
//! Two earlier clients bounded nothing, as they ran slower than torch's server: one
//! thread reading the releases in order with blocking reads slept on every release
//! not yet written; and threads that wrote a round's arrivals only once all their
//! releases were in left the server idle while they caught up, where a barrier's
//! ranks arrive again while the server is still releasing the others.

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::OwnedFd;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, ensure, Context};
use rustix::event::epoll;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::{mono_ns, round_stats, thread_cpu_ns, TcpCounts, Times};

/// The arrival and the release: the size of a small frame.
const MESSAGE: usize = 16;
/// Queued connections the listener takes: the client connects all N at once.
const BACKLOG: i32 = 4096;

/// What one floor measurement (this one, or `wake_floor`'s) is run with.
pub(crate) struct Plan {
    /// Ranks: connections here, processes for `wake_floor`.
    pub(crate) ranks: u32,
    pub(crate) rounds: u32,
    pub(crate) warmup: u32,
    pub(crate) timeout: Duration,
}

impl Plan {
    pub(crate) fn total(&self) -> usize {
        (self.warmup + self.rounds) as usize
    }
}

/// The floor's figures, as the barrier report carries them.
pub(crate) struct Measured {
    pub(crate) round: Times,
    pub(crate) connecting: Duration,
    /// CPU of the serving thread, and of the client threads, over all rounds (ns).
    pub(crate) server_cpu_ns: u64,
    pub(crate) client_cpu_ns: u64,
    /// ... and over the measured rounds alone: for the server from the end of the
    /// warm-up to the end of the last round, for the clients as `CpuWindow`'s.
    pub(crate) server_measured_cpu_ns: u64,
    pub(crate) client_measured_cpu_ns: u64,
    /// TCP segments sent over the measured rounds (as the server's CPU), where known.
    pub(crate) measured_tcp: Option<TcpCounts>,
}

/// What the serving child reports once all rounds are done.
#[derive(Debug, Serialize, Deserialize)]
struct ServerReport {
    /// CPU its serving thread spent from the first round to the last ...
    cpu_ns: u64,
    /// ... and from the end of the warm-up to the last.
    measured_cpu_ns: u64,
    /// TCP segments sent over the same rounds.
    measured_tcp: Option<TcpCounts>,
}

/// Runs the floor: a serving child process, and the clients on a thread of this one.
pub(crate) async fn measure(plan: &Plan) -> anyhow::Result<Measured> {
    let (n, total) = (plan.ranks, plan.total());
    let mut command = crate::bench_child(&["barrier", "--op", "floor", "--serve-floor", "--json"])?;
    command
        .args(["--clients", &n.to_string(), "--rounds", &plan.rounds.to_string()])
        .args(["--warmup", &plan.warmup.to_string(), "--timeout", &plan.timeout.as_secs_f64().to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .kill_on_drop(true);
    let mut child = command.spawn().context("starting the floor's serving process")?;
    let mut stdout = BufReader::new(child.stdout.take().context("child stdout")?);
    let mut line = String::new();
    tokio::time::timeout(plan.timeout, stdout.read_line(&mut line))
        .await
        .context("the floor's serving process did not start in time")??;
    let port: u16 = line.trim().parse().with_context(|| format!("the floor's serving process said {line:?}"))?;
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let timeout = plan.timeout;
    let warmup = plan.warmup as usize;
    let clients = tokio::task::spawn_blocking(move || {
        let started = std::time::Instant::now();
        let conns = (0..n).map(|_| connect(addr, timeout)).collect::<io::Result<Vec<_>>>()?;
        let connecting = started.elapsed();
        let wires = |share| Plain { partial: vec![0; share] };
        run_clients(conns, wires, (warmup, total), timeout, None).map(|times| (times, connecting))
    })
    .await??;
    let (clients, connecting) = clients;
    line.clear();
    tokio::time::timeout(plan.timeout, stdout.read_line(&mut line))
        .await
        .context("the floor's serving process did not finish in time")??;
    let server: ServerReport =
        serde_json::from_str(line.trim()).context("the floor's serving process failed (its error is above)")?;
    child.wait().await?;
    let stats = round_stats(clients.start_ns, &clients.round_end_ns, plan.warmup as usize).context("no rounds")?;
    Ok(Measured {
        round: stats.times,
        connecting,
        server_cpu_ns: server.cpu_ns,
        client_cpu_ns: clients.cpu_ns,
        server_measured_cpu_ns: server.measured_cpu_ns,
        client_measured_cpu_ns: clients.measured_cpu_ns,
        measured_tcp: server.measured_tcp,
    })
}

/// One blocking connection to `addr`, without Nagle's delay.
fn connect(addr: SocketAddr, timeout: Duration) -> io::Result<TcpStream> {
    let conn = TcpStream::connect_timeout(&addr, timeout)?;
    conn.set_nodelay(true)?;
    Ok(conn)
}

/// What goes over a connection of the floor's client threads: the floor's plain
/// messages ([`Plain`]), or a protocol's barrier (module `raw`).
pub(crate) trait Wire: Send + 'static {
    /// Writes the next arrival of connection `i` (of this thread's share).
    fn arrive(&mut self, i: usize, conn: &TcpStream) -> anyhow::Result<()>;
    /// Takes `bytes` read from connection `i`; whether its release is whole now.
    fn take(&mut self, i: usize, bytes: &[u8]) -> anyhow::Result<bool>;
    /// After the last round, with the connections blocking again: what a client
    /// says before it goes.
    fn finish(&mut self, _conns: &[TcpStream]) -> anyhow::Result<()> {
        Ok(())
    }
}

/// The floor's messages: [`MESSAGE`] bytes each way, no protocol.
struct Plain {
    /// Bytes of each connection's release read so far.
    partial: Vec<usize>,
}

impl Wire for Plain {
    fn arrive(&mut self, _: usize, mut conn: &TcpStream) -> anyhow::Result<()> {
        write_message(&mut conn, 1)
    }

    fn take(&mut self, i: usize, bytes: &[u8]) -> anyhow::Result<bool> {
        self.partial[i] += bytes.len();
        if self.partial[i] < MESSAGE {
            return Ok(false);
        }
        ensure!(self.partial[i] == MESSAGE, "the server sent more than one release");
        self.partial[i] = 0;
        Ok(true)
    }
}

/// Sampled by the first client thread where its measured rounds start, where they
/// end, and after the last round: a server's CPU (ns) and the TCP counters, for a
/// server of another process.
pub(crate) type Sample = Box<dyn FnMut() -> (Option<u64>, Option<TcpCounts>) + Send>;

/// What the client threads measured, together.
pub(crate) struct ClientTimes {
    pub(crate) start_ns: u64,
    pub(crate) round_end_ns: Vec<u64>,
    pub(crate) cpu_ns: u64,
    /// Over the rounds after the warm-up.
    pub(crate) measured_cpu_ns: u64,
    /// The [`Sample`]s at the measured rounds' start and end and after the last
    /// round, if one was given.
    pub(crate) sampled: Option<[(Option<u64>, Option<TcpCounts>); 3]>,
}

/// The client side: `conns` shared out over a thread per core, each speaking
/// through the [`Wire`] `wire` makes for its share (of that many connections), then
/// `total` rounds (`warmup` of them first) of an arrival written and a release read
/// through epoll on every connection. A round ends when its last release is read,
/// on whichever thread.
pub(crate) fn run_clients<W: Wire>(
    mut conns: Vec<TcpStream>,
    mut wire: impl FnMut(usize) -> W,
    (warmup, total): (usize, usize),
    timeout: Duration,
    mut sample: Option<Sample>,
) -> anyhow::Result<ClientTimes> {
    for conn in &conns {
        conn.set_nonblocking(true)?;
    }
    let threads = std::thread::available_parallelism().map_or(1, usize::from).min(conns.len().max(1));
    let start_ns = mono_ns();
    let mut running = Vec::with_capacity(threads);
    while !conns.is_empty() {
        let share = conns.split_off(conns.len() - conns.len().div_ceil(threads - running.len()));
        let wire = wire(share.len());
        let sample = sample.take();
        running.push(std::thread::spawn(move || client_thread(share, wire, (warmup, total), timeout, sample)));
    }
    let (mut round_end_ns, mut cpu_ns, mut measured_cpu_ns, mut sampled) = (vec![0u64; total], 0, 0, None);
    for thread in running {
        let (ends, cpu) = thread.join().map_err(|_| anyhow::anyhow!("a floor client thread panicked"))??;
        for (end, at) in round_end_ns.iter_mut().zip(ends) {
            *end = (*end).max(at);
        }
        cpu_ns += cpu.all;
        measured_cpu_ns += cpu.measured;
        sampled = sampled.or(cpu.sampled);
    }
    Ok(ClientTimes { start_ns, round_end_ns, cpu_ns, measured_cpu_ns, sampled })
}

/// CPU a thread spent over all rounds, and over the measured ones (ns); its samples.
struct ThreadCpu {
    all: u64,
    measured: u64,
    sampled: Option<[(Option<u64>, Option<TcpCounts>); 3]>,
}

/// One client thread's rounds over its connections: when each round's last release
/// came, and the CPU the thread spent. A connection's release of round r is read
/// before its arrival of round r + 1 goes, and the server releases round r + 1 only
/// once every arrival of it is in: so the releases come a round at a time, and
/// counting them tells the rounds apart.
fn client_thread(
    conns: Vec<TcpStream>,
    mut wire: impl Wire,
    (warmup, total): (usize, usize),
    timeout: Duration,
    mut sample: Option<Sample>,
) -> anyhow::Result<(Vec<u64>, ThreadCpu)> {
    let poll = epoll::create(epoll::CreateFlags::CLOEXEC)?;
    for (i, conn) in conns.iter().enumerate() {
        epoll::add(&poll, conn, epoll::EventData::new_u64(i as u64), epoll::EventFlags::IN)?;
    }
    let mut round_end_ns = Vec::with_capacity(total);
    let cpu_start = thread_cpu_ns();
    // From the first release of the last warm-up round to the first of the last
    // round, each read before that connection's next arrival goes (see `CpuWindow`).
    let (mut measured_from, mut measured_to) = (cpu_start, None);
    let mut samples = [None, None];
    if total > 0 {
        for (i, conn) in conns.iter().enumerate() {
            wire.arrive(i, conn)?;
        }
    }
    // Whole releases this round.
    let mut released = 0;
    // A stuck round fails the benchmark instead of hanging it.
    read_ready(&poll, &conns, timeout, total == 0, |i, conn, bytes| {
        ensure!(!bytes.is_empty(), "the peer closed a connection");
        if !wire.take(i, bytes)? {
            return Ok(false);
        }
        released += 1;
        if released == 1 && round_end_ns.len() + 1 == warmup {
            measured_from = thread_cpu_ns();
            samples[0] = sample.as_mut().map(|sample| sample());
        }
        if released == 1 && round_end_ns.len() + 1 == total {
            measured_to = Some(thread_cpu_ns());
            samples[1] = sample.as_mut().map(|sample| sample());
        }
        if round_end_ns.len() + 1 < total {
            wire.arrive(i, conn)?;
        }
        if released == conns.len() {
            round_end_ns.push(mono_ns());
            released = 0;
        }
        Ok(round_end_ns.len() == total)
    })
    .with_context(|| format!("the releases of round {}", round_end_ns.len()))?;
    let end = thread_cpu_ns();
    let measured = measured_to.unwrap_or(end).saturating_sub(measured_from);
    let sampled = match (samples, sample.as_mut()) {
        ([Some(from), Some(to)], Some(sample)) => Some([from, to, sample()]),
        _ => None,
    };
    for conn in &conns {
        conn.set_nonblocking(false)?;
    }
    wire.finish(&conns)?;
    Ok((round_end_ns, ThreadCpu { all: end.saturating_sub(cpu_start), measured, sampled }))
}

/// Writes one message of `byte`s on each connection.
fn write_each(conns: &[TcpStream], byte: u8) -> anyhow::Result<()> {
    conns.iter().try_for_each(|mut conn| write_message(&mut conn, byte))
}

/// Writes one message of `byte`s on `conn`.
fn write_message(conn: &mut &TcpStream, byte: u8) -> anyhow::Result<()> {
    write_whole(conn, &[byte; MESSAGE])
}

/// Writes `bytes`, a small message, on `conn` with one write: into a socket whose
/// peer read everything before, always whole.
pub(crate) fn write_whole(mut conn: &TcpStream, bytes: &[u8]) -> anyhow::Result<()> {
    ensure!(conn.write(bytes)? == bytes.len(), "a message did not fit into its socket");
    Ok(())
}

/// The serving child: prints its port, takes N connections, serves `total` rounds,
/// then prints a [`ServerReport`].
pub(crate) fn serve(plan: &Plan) -> anyhow::Result<()> {
    let (n, total) = (plan.ranks as usize, plan.total());
    let listener = listen()?;
    println!("{}", listener.local_addr()?.port());
    io::stdout().flush()?;
    let poll = epoll::create(epoll::CreateFlags::CLOEXEC)?;
    let mut conns = Vec::with_capacity(n);
    for i in 0..n {
        let (conn, _) = listener.accept()?;
        conn.set_nodelay(true)?;
        conn.set_nonblocking(true)?;
        // Level-triggered: one read per ready connection, as a server reading one
        // small request at a time does; no second read to learn that it is drained.
        epoll::add(&poll, &conn, epoll::EventData::new_u64(i as u64), epoll::EventFlags::IN)?;
        conns.push(conn);
    }
    drop(listener);
    let cpu_start = thread_cpu_ns();
    let (mut measured_from, mut tcp_from) = (cpu_start, TcpCounts::read());
    for round in 0..total {
        read_arrivals(&poll, &conns, plan.timeout).with_context(|| format!("round {round}"))?;
        write_each(&conns, 2)?;
        if round + 1 == plan.warmup as usize {
            (measured_from, tcp_from) = (thread_cpu_ns(), TcpCounts::read());
        }
    }
    let end = thread_cpu_ns();
    let (cpu_ns, measured_cpu_ns) = (end.saturating_sub(cpu_start), end.saturating_sub(measured_from));
    let measured_tcp = TcpCounts::read().zip(tcp_from).map(|(to, from)| to.since(from));
    wait_closed(&poll, &conns, plan.timeout)?;
    println!("{}", serde_json::to_string(&ServerReport { cpu_ns, measured_cpu_ns, measured_tcp })?);
    Ok(())
}

/// Waits until the client closed every connection. Closing them first would end a
/// connection whose release was read while the client still waits on another's, and
/// the client would take that end for a failure.
fn wait_closed(poll: &OwnedFd, conns: &[TcpStream], timeout: Duration) -> anyhow::Result<()> {
    let mut open = conns.len();
    let waited = read_ready(poll, conns, timeout, open == 0, |_, conn, bytes| {
        ensure!(bytes.is_empty(), "a client sent more than its arrivals");
        // Level-triggered: a closed connection would be reported again.
        epoll::delete(poll, conn)?;
        open -= 1;
        Ok(open == 0)
    });
    waited.with_context(|| format!("{open} clients did not close their connections"))
}

/// Reads until every connection's message (an arrival, or on the client's side a
/// release) is in.
fn read_arrivals(poll: &OwnedFd, conns: &[TcpStream], timeout: Duration) -> anyhow::Result<()> {
    let mut missing = conns.len() * MESSAGE;
    read_ready(poll, conns, timeout, missing == 0, |_, _, bytes| {
        ensure!(!bytes.is_empty(), "the peer closed a connection");
        missing = missing.saturating_sub(bytes.len());
        Ok(missing == 0)
    })
}

/// Reads once from each connection epoll reports ready (level-triggered: one read
/// per ready connection, no second read to learn that it is drained), handing
/// `read` the connection's index, the connection and the bytes that came (none: it was closed),
/// until `read` says that all is in; `done` already: nothing to wait for.
fn read_ready(
    poll: &OwnedFd,
    conns: &[TcpStream],
    timeout: Duration,
    done: bool,
    mut read: impl FnMut(usize, &TcpStream, &[u8]) -> anyhow::Result<bool>,
) -> anyhow::Result<()> {
    if done {
        return Ok(());
    }
    let mut events = Vec::with_capacity(1024);
    let mut buf = [0u8; 64];
    let limit = rustix::time::Timespec { tv_sec: timeout.as_secs() as i64, tv_nsec: 0 };
    loop {
        events.clear();
        epoll::wait(poll, rustix::buffer::spare_capacity(&mut events), Some(&limit))?;
        if events.is_empty() {
            bail!("nothing came for {timeout:?}");
        }
        for event in &events {
            let i = event.data.u64() as usize;
            let mut conn = &conns[i];
            let got = match conn.read(&mut buf) {
                Ok(got) => got,
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => continue,
                Err(error) => return Err(error.into()),
            };
            if read(i, conn, &buf[..got])? {
                return Ok(());
            }
        }
    }
}

/// A listener on an ephemeral loopback port with a backlog for N connects at once
/// (the standard library's is 128, and a full backlog costs a connect a second).
fn listen() -> io::Result<TcpListener> {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    socket.bind(&SocketAddr::from((Ipv4Addr::LOCALHOST, 0)).into())?;
    socket.listen(BACKLOG)?;
    Ok(socket.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_round_is_every_arrival_in_and_every_release_out() {
        // The serving side in a thread of the test, the clients on another.
        let listener = listen().expect("listen");
        let addr = listener.local_addr().expect("addr");
        let n = 8;
        let server = std::thread::spawn(move || {
            let poll = epoll::create(epoll::CreateFlags::CLOEXEC).expect("epoll");
            let mut conns = Vec::new();
            for i in 0..n {
                let (conn, _) = listener.accept().expect("accept");
                conn.set_nonblocking(true).expect("nonblocking");
                epoll::add(&poll, &conn, epoll::EventData::new_u64(i as u64), epoll::EventFlags::IN).expect("add");
                conns.push(conn);
            }
            for _ in 0..3 {
                read_arrivals(&poll, &conns, Duration::from_secs(30)).expect("arrivals");
                write_each(&conns, 2).expect("releases");
            }
            wait_closed(&poll, &conns, Duration::from_secs(30)).expect("closed");
        });
        let conns = (0..n).map(|_| connect(addr, Duration::from_secs(30)).expect("connect")).collect();
        let wires = |share| Plain { partial: vec![0; share] };
        let times = run_clients(conns, wires, (1, 3), Duration::from_secs(30), None).expect("clients");
        server.join().expect("server");
        assert_eq!(times.round_end_ns.len(), 3);
        assert!(times.round_end_ns.windows(2).all(|w| w[0] <= w[1]));
        // The measured rounds are some of all rounds.
        assert!(times.measured_cpu_ns <= times.cpu_ns, "{} > {}", times.measured_cpu_ns, times.cpu_ns);
    }
}
