//! The agent's one connection to the coordinator: connecting and introducing
//! itself, writing what the local ranks sent, and fanning the coordinator's replies
//! out to them.

use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use bytes::BytesMut;
use rallypoint_core::{OpError, Reply};
use rallypoint_net::conn::AuthFailure;
use rallypoint_net::conn::{greet, read_some, Buffering, Credentials, End, GreetError};
use rallypoint_net::shm::through_slab;
use rallypoint_net::sync::{lock, Backoff};
use rallypoint_net::warn_limit::{admit_shared, WarnLimit};
use rallypoint_net::{ReadHalf, Stream, WriteHalf};
use rallypoint_proto::native::{
    decode_root_frame, encode_agent_frame, encode_reply, encode_server_frame, reply_payload_len, AgentFrame,
    FrameLimits, ProtoError, RootFrame, ServerFrame,
};
use tokio::io::AsyncWriteExt;
use tracing::{debug, trace, warn};

use crate::channels::Channel;
use crate::hub::Hub;
use crate::slabs::Placed;
use crate::{AgentConfig, AgentError, HANDSHAKE_TIMEOUT};

/// Connects to the coordinator and exchanges the agent hello and welcome, retrying
/// with backoff while nothing answers (agents often start before the coordinator).
pub(crate) async fn connect(config: &AgentConfig) -> Result<(Stream, BytesMut, u64), AgentError> {
    let addr = &config.upstream;
    let started = Instant::now();
    let mut backoff = Backoff::new();
    loop {
        let error = match tokio::time::timeout(HANDSHAKE_TIMEOUT, hello(config)).await {
            Ok(Ok(Ok(connected))) => return Ok(connected),
            Ok(Ok(Err(refused))) => return Err(refused),
            Ok(Err(error)) => error,
            Err(_) => io::Error::new(io::ErrorKind::TimedOut, "no welcome from the coordinator"),
        };
        if started.elapsed() >= config.connect_timeout {
            return Err(AgentError::Connect { addr: addr.clone(), waited: started.elapsed(), source: error });
        }
        debug!(%addr, %error, "cannot reach the coordinator yet; retrying");
        tokio::time::sleep(backoff.next_pause()).await;
    }
}

/// `Err`: worth retrying; `Ok(Err)`: the coordinator's answer, final.
async fn hello(config: &AgentConfig) -> io::Result<Result<(Stream, BytesMut, u64), AgentError>> {
    let addr = &config.upstream;
    let mut hello = BytesMut::new();
    encode_agent_frame(&AgentFrame::Hello { host: config.host.clone(), pid: std::process::id() }, &mut hello);
    let protocol = |message: String| AgentError::Protocol { addr: addr.clone(), message };
    let credentials = Credentials { token: config.token.clone(), tls: config.upstream_tls.clone() };
    let greeting = greet(addr, &credentials, &hello, |buf| match decode_root_frame(buf, &FrameLimits::unbounded()) {
        Ok(None) => None,
        Ok(Some(RootFrame::Welcome { lease_ms })) => Some(Ok(lease_ms)),
        Ok(Some(RootFrame::Refused(OpError::Unauthorized(why)))) => {
            Some(Err(AgentError::Auth { addr: addr.clone(), failure: AuthFailure::Refused(why) }))
        }
        Ok(Some(RootFrame::Refused(error))) => Some(Err(AgentError::Refused { addr: addr.clone(), error })),
        Ok(Some(other)) => Some(Err(protocol(format!("sent {other:?} before its welcome")))),
        Err(error) => Some(Err(protocol(error.to_string()))),
    });
    let (stream, answer, rest) = match greeting.await {
        Ok(greeted) => greeted,
        Err(GreetError::Io(error)) => return Err(error),
        Err(GreetError::Auth(failure)) => return Ok(Err(AgentError::Auth { addr: addr.clone(), failure })),
        Err(GreetError::NotCoordinator(message)) => return Ok(Err(protocol(message))),
    };
    Ok(answer.map(|lease_ms| (stream, rest, lease_ms)))
}

/// Reads the coordinator's frames and fans them out to the local connections;
/// returns how the connection ended.
pub(crate) async fn read(mut reader: ReadHalf, mut buf: BytesMut, hub: &Hub) -> End {
    let limits = FrameLimits::unbounded();
    loop {
        loop {
            match decode_root_frame(&mut buf, &limits) {
                Ok(None) => break,
                Ok(Some(frame)) => {
                    if let Err(end) = take(hub, frame) {
                        return end;
                    }
                }
                Err(error) if error.is_fatal() => return End::malformed(error),
                Err(error) => answer_bad_frame(hub, error),
            }
        }
        Buffering::NODE_LINK.release_idle(&mut buf);
        match std::future::poll_fn(|cx| read_some(&mut reader, &mut buf, Buffering::NODE_LINK, cx)).await {
            Ok(0) if buf.is_empty() => return End::Closed,
            Ok(0) => return End::ClosedMidFrame { buffered: buf.len() },
            Ok(_) => {}
            Err(error) => return End::Io(error),
        }
    }
}

/// One frame of the coordinator, to the local rank(s) it is for.
fn take(hub: &Hub, frame: RootFrame) -> Result<(), End> {
    match frame {
        RootFrame::SubReply { sub, id, reply } => fan_out(hub, &[(sub, id)], &reply),
        RootFrame::SubReplies { calls, reply } => fan_out(hub, &calls, &reply),
        RootFrame::SubWelcome { sub, welcome } => {
            if let Some(local) = hub.route(sub) {
                local.send(|out| encode_server_frame(&ServerFrame::Welcome(welcome), out));
            }
        }
        RootFrame::SubRefused { sub, error } => {
            let local = lock(&hub.routes).remove(&sub);
            if let Some(local) = local {
                debug!(sub, %error, "the coordinator refused a local rank");
                local.send(|out| encode_server_frame(&ServerFrame::Refused(error), out));
                local.end();
            }
        }
        RootFrame::Welcome { .. } | RootFrame::Refused(_) => return Err(End::SecondHello),
    }
    Ok(())
}

/// Warnings about malformed frames from the coordinator.
static BAD_FRAME_WARNINGS: std::sync::Mutex<WarnLimit> = std::sync::Mutex::new(WarnLimit::new());

/// A reply that did not decode: the calls it names get an `Invalid` error, so that
/// they do not wait forever for a reply that will not come.
fn answer_bad_frame(hub: &Hub, error: ProtoError) {
    if let Some(held_back) = admit_shared(&BAD_FRAME_WARNINGS) {
        warn!(%error, held_back, "malformed frame from the coordinator");
    }
    let (calls, message) = match error {
        ProtoError::BadSubFrame { sub: Some(sub), id: Some(id), message } => (vec![(sub, id)], message),
        ProtoError::BadSubCalls { calls, message } => (calls, message),
        _ => return,
    };
    let error = Err(OpError::Invalid(format!("malformed reply from the coordinator: {message}")));
    for (sub, id) in calls {
        if let Some(local) = hub.route(sub) {
            if let Some(channel) = hub.channels.finish(sub, id, false) {
                channel.release();
            }
            local.reply(id, |out| encode_reply(id, &error, out));
        }
    }
}

/// Hands one reply from the coordinator to each of the calls `(sub, id)`. A large
/// one (an all-gather result) is written once into a shared-memory slab for the
/// ranks that take shared replies (docs/PROTOCOL.md, section 13), and goes to the
/// others as bytes on their socket.
fn fan_out(hub: &Hub, calls: &[(u64, u64)], reply: &Reply) {
    let large = through_slab(reply_payload_len(reply), calls.len());
    let mut placed: Option<Option<Placed>> = None;
    // Barrier channels with a slot finished here: woken once each, at the end.
    let mut finished: Vec<Arc<Channel>> = Vec::new();
    // Looked up for all the calls at once: a release's reply names every rank of the node.
    let locals = hub.routes(calls);
    let forwarded = hub.channels.take_forwarded(calls);
    for ((&(sub, id), local), forwarded) in calls.iter().zip(locals).zip(forwarded) {
        let Some(local) = local else { continue };
        // A call taken from a barrier channel (docs/PROTOCOL.md, section 15): its
        // slot says how it ended; an error goes on the socket too, after the slot
        // is marked, as the reply to the call's id.
        if let Some(channel) = forwarded.map(|f| f.finish(sub, reply.is_ok())) {
            match reply {
                Ok(_) => local.answered(id),
                Err(_) => local.reply(id, |out| encode_reply(id, reply, out)),
            }
            if !finished.iter().any(|c| Arc::ptr_eq(c, &channel)) {
                finished.push(channel);
            }
            continue;
        }
        if large && local.takes_shared.load(Ordering::Relaxed) {
            if let Some(placed) = placed.get_or_insert_with(|| hub.slabs.place(reply)) {
                hub.slabs.hold(placed.slab, sub);
                local.reply_shared(id, placed);
                continue;
            }
        }
        local.reply(id, |out| encode_reply(id, reply, out));
    }
    for channel in finished {
        channel.release();
    }
}

/// Writes what the local ranks sent, everything gathered since the last write in
/// one write; returns how it stopped.
pub(crate) async fn write(mut writer: WriteHalf, hub: &Hub) -> End {
    let mut batch = BytesMut::new();
    loop {
        hub.up_ready.notified().await;
        loop {
            let (calls, merged) = {
                let mut up = lock(&hub.up);
                let calls: usize = up.merged.iter().map(|m| m.calls.len()).sum();
                let merged = up.merged.len();
                up.seal();
                std::mem::swap(&mut up.buf, &mut batch);
                (calls, merged)
            };
            if batch.is_empty() {
                break;
            }
            trace!(bytes = batch.len(), barrier_calls = calls, barrier_frames = merged, "writing to the coordinator");
            // Flushed: TLS holds what it encrypted until then.
            if let Err(error) = async {
                writer.write_all(&batch).await?;
                writer.flush().await
            }
            .await
            {
                return End::Io(error);
            }
            batch.clear();
            Buffering::NODE_LINK.release_idle(&mut batch);
        }
    }
}
