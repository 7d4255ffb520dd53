//! `bench hierarchy --start --floor`: what a job's start costs the kernel and the
//! load generators alone, measured the same way as the start it bounds.
//!
//! The same generators start the same ranks, but each connects to a *floor
//! agent* instead of a `rallypoint agent`, and there is no coordinator. A floor
//! agent is one thread over epoll (level-triggered, one read per ready
//! connection) that accepts on a Unix socket with the same backlog, answers each
//! hello with a welcome, and answers the barrier and then the all-gather calls of
//! its ranks once all of them have called, with the frames a real agent sends (a
//! `SharedReply` naming a slab, though without passing the slab's file). It keeps
//! nothing per rank but its socket, its read buffer and its call ids, registers
//! nobody upstream and consults no one: the messages a node's ranks exchange with
//! their agent during a start, and nothing a start could do without.

use std::io::{self, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use anyhow::{bail, ensure, Context};
use bytes::BytesMut;
use rallypoint_core::{Request, Response, SessionId, Welcome};
use rallypoint_proto::native::{
    decode_client_frame, decode_preamble, encode_reply, encode_server_frame, ClientFrame, FrameLimits, ServerFrame,
};
use rustix::event::epoll;

use super::start::address;

/// The backlog `rallypoint agent`'s Unix listener has (tokio's).
const BACKLOG: i32 = 1024;

/// A floor agent's rank connection.
struct Rank {
    conn: UnixStream,
    buf: BytesMut,
    /// The preamble was read.
    greeted: bool,
    /// The ids of its barrier and all-gather calls, once made.
    barrier: Option<u64>,
    gather: Option<u64>,
}

/// Serves the `ranks` ranks that connect to `path` until every one of them has
/// its all-gather's answer, then until the parent kills it. Prints the address
/// first.
pub(super) fn serve(path: &str, ranks: u32, world: u32, timeout: Duration) -> anyhow::Result<()> {
    let listener = socket2::Socket::new(socket2::Domain::UNIX, socket2::Type::STREAM, None)?;
    listener.bind(&socket2::SockAddr::unix(path)?).with_context(|| format!("binding {path}"))?;
    listener.listen(BACKLOG)?;
    listener.set_nonblocking(true)?;
    let listener: std::os::unix::net::UnixListener = OwnedFd::from(listener).into();
    println!("unix:{path}");
    io::stdout().flush()?;

    let poll = epoll::create(epoll::CreateFlags::CLOEXEC)?;
    // The listener is entry `u64::MAX`; ranks are their index in `conns`.
    epoll::add(&poll, &listener, epoll::EventData::new_u64(u64::MAX), epoll::EventFlags::IN)?;
    let mut conns: Vec<Rank> = Vec::with_capacity(ranks as usize);
    let (mut barriers, mut gathers) = (0u32, 0u32);
    let mut events = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    let mut out = BytesMut::new();
    let limit = rustix::time::Timespec { tv_sec: timeout.as_secs() as i64, tv_nsec: 0 };
    let gathered_len = u64::from(world) * address(0).len() as u64;
    while gathers < ranks {
        events.clear();
        epoll::wait(&poll, rustix::buffer::spare_capacity(&mut events), Some(&limit))?;
        ensure!(!events.is_empty(), "nothing happened for {timeout:?}");
        for event in &events {
            let at = event.data.u64();
            if at == u64::MAX {
                loop {
                    match listener.accept() {
                        Ok((conn, _)) => {
                            conn.set_nonblocking(true)?;
                            let index = conns.len() as u64;
                            epoll::add(&poll, &conn, epoll::EventData::new_u64(index), epoll::EventFlags::IN)?;
                            conns.push(Rank {
                                conn,
                                buf: BytesMut::new(),
                                greeted: false,
                                barrier: None,
                                gather: None,
                            });
                        }
                        Err(error) if error.kind() == io::ErrorKind::WouldBlock => break,
                        Err(error) => return Err(error.into()),
                    }
                }
                continue;
            }
            let rank = &mut conns[at as usize];
            let got = match rank.conn.read(&mut chunk) {
                Ok(0) => bail!("a rank closed its connection during the start"),
                Ok(got) => got,
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => continue,
                Err(error) => return Err(error.into()),
            };
            rank.buf.extend_from_slice(&chunk[..got]);
            if !rank.greeted {
                match decode_preamble(&mut rank.buf)? {
                    Some(_) => rank.greeted = true,
                    None => continue,
                }
            }
            while let Some(frame) = decode_client_frame(&mut rank.buf, &FrameLimits::unbounded())? {
                match frame {
                    ClientFrame::Hello(_) => {
                        out.clear();
                        let session = SessionId(at + 1);
                        let welcome = Welcome { session, lease_ms: 0, job_incarnation: None };
                        encode_server_frame(&ServerFrame::Welcome(welcome), &mut out);
                        write_whole(&mut rank.conn, &out)?;
                    }
                    ClientFrame::TakeSharedReplies => {}
                    ClientFrame::Request { id, request: Request::Barrier { .. } } => {
                        rank.barrier = Some(id);
                        barriers += 1;
                    }
                    ClientFrame::Request { id, request: Request::AllGather { .. } } => {
                        rank.gather = Some(id);
                        gathers += 1;
                    }
                    other => bail!("a floor agent does not serve {other:?}"),
                }
            }
            if barriers == ranks {
                barriers = 0;
                for rank in &mut conns {
                    let Some(id) = rank.barrier.take() else { bail!("a rank missed the barrier") };
                    out.clear();
                    encode_reply(id, &Ok(Response::Done), &mut out);
                    write_whole(&mut rank.conn, &out)?;
                }
            }
        }
    }
    for rank in &mut conns {
        let Some(id) = rank.gather else { bail!("a rank missed the all-gather") };
        out.clear();
        encode_server_frame(&ServerFrame::SharedReply { id, slab: 1, len: gathered_len }, &mut out);
        write_whole(&mut rank.conn, &out)?;
    }
    // Held open until the parent has read the generators' reports and kills it.
    std::thread::sleep(timeout);
    Ok(())
}

/// Writes a small frame into a socket whose peer has read everything before it.
fn write_whole(conn: &mut UnixStream, frame: &[u8]) -> anyhow::Result<()> {
    let written = conn.write(frame)?;
    ensure!(written == frame.len(), "a frame did not fit into its socket");
    Ok(())
}
