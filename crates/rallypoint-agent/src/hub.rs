//! What the local connections and the upstream tasks share: the frames waiting to
//! go up, the route from a sub-session to its rank's connection, and the slabs.

use std::collections::HashMap;

/// The agent's maps, looked up for every call of every local rank: keyed by its
/// own numbers (sub-session and request ids), so a fast hash will do.
pub(crate) type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::BytesMut;
use rallypoint_core::Request;
use rallypoint_net::auth::Token;
use rallypoint_net::budget::PendingBudget;
use rallypoint_net::sync::lock;
use rallypoint_net::tls::TlsServer;
use rallypoint_proto::native::{encode_agent_frame, AgentFrame, FrameLimits};
use tokio::sync::Notify;

use crate::batch::Up;
use crate::channels::Channels;
use crate::local::Local;
use crate::slabs::Slabs;

/// What the local connections and the upstream tasks share.
pub(crate) struct Hub {
    /// The coordinator's address, for messages.
    pub(crate) addr: String,
    pub(crate) limits: FrameLimits,
    pub(crate) read_timeout: Duration,
    /// Bytes of unfinished requests the local connections hold together.
    pub(crate) budget: Arc<PendingBudget>,
    pub(crate) up: Mutex<Up>,
    /// Wakes the upstream writer: `up.buf` has bytes.
    pub(crate) up_ready: Notify,
    /// Local connections by sub-session id.
    pub(crate) routes: Mutex<FastMap<u64, Arc<Local>>>,
    pub(crate) next_sub: AtomicU64,
    /// Shared-memory slabs (docs/PROTOCOL.md, section 13); a slab's id is its index.
    pub(crate) slabs: Slabs,
    /// Barrier channels (docs/PROTOCOL.md, section 15).
    pub(crate) channels: Channels,
    /// Required of every local rank.
    pub(crate) token: Option<Arc<Token>>,
    /// Local ranks over TCP come over TLS.
    pub(crate) tls: Option<TlsServer>,
}

impl Hub {
    /// Appends a frame of sub-session `sub` for the coordinator; false if it is
    /// already gone.
    pub(crate) fn send_up(&self, sub: u64, encode: impl FnOnce(&mut BytesMut)) -> bool {
        let mut up = lock(&self.up);
        if up.lost.is_some() {
            return false;
        }
        let was_idle = up.is_idle();
        up.order_before(sub);
        encode(&mut up.buf);
        drop(up);
        if was_idle {
            self.up_ready.notify_one();
        }
        true
    }

    /// Queues a rank's requests for the coordinator, merging its barrier calls with
    /// identical ones of other local ranks; false if the coordinator is already gone.
    pub(crate) fn send_requests(&self, sub: u64, requests: impl IntoIterator<Item = (u64, Request)>) -> bool {
        let mut up = lock(&self.up);
        if up.lost.is_some() {
            return false;
        }
        let was_idle = up.is_idle();
        for (id, request) in requests {
            // Only barriers: every rank's call is the same bytes (the rank is its
            // session's), while all-gather and broadcast calls carry values of their own.
            if matches!(request, Request::Barrier { .. }) {
                up.merge(sub, id, request);
            } else {
                up.order_before(sub);
                encode_agent_frame(&AgentFrame::SubRequest { sub, id, request }, &mut up.buf);
            }
        }
        drop(up);
        if was_idle {
            self.up_ready.notify_one();
        }
        true
    }

    /// Queues barrier calls taken from shared memory, all of `request` (a channel's
    /// barrier call), `(sub, request id)` each, merged as [`Hub::send_requests`]
    /// merges them; false if the coordinator is already gone.
    pub(crate) fn send_calls(&self, calls: &[(u64, u64)], request: &Request) -> bool {
        let mut up = lock(&self.up);
        if up.lost.is_some() {
            return false;
        }
        let was_idle = up.is_idle();
        up.merge_all(calls, request);
        drop(up);
        if was_idle {
            self.up_ready.notify_one();
        }
        true
    }

    pub(crate) fn lost_reason(&self) -> Option<String> {
        lock(&self.up).lost.clone()
    }

    /// The agent stops serving (`message` says why): every waiting call of every
    /// local rank gets a `Closed(message)` error, every local connection closes, and
    /// later ones are refused. Returns how many local ranks were connected.
    pub(crate) fn lose(&self, message: String) -> usize {
        {
            let mut up = lock(&self.up);
            up.lost = Some(message.clone());
            // Their calls are pending on their connections, and fail below.
            up.merged.clear();
            up.in_merged.clear();
        }
        // Slots first: a rank woken by its slot's failure finds the error on its socket.
        self.channels.fail_all();
        let locals: Vec<Arc<Local>> = lock(&self.routes).drain().map(|(_, local)| local).collect();
        for local in &locals {
            local.fail_pending(&message);
        }
        locals.len()
    }

    pub(crate) fn route(&self, sub: u64) -> Option<Arc<Local>> {
        lock(&self.routes).get(&sub).cloned()
    }

    /// The local connection of each of `calls`' sub-sessions, under one lock.
    pub(crate) fn routes(&self, calls: &[(u64, u64)]) -> Vec<Option<Arc<Local>>> {
        let routes = lock(&self.routes);
        calls.iter().map(|(sub, _)| routes.get(sub).cloned()).collect()
    }
}
