//! The client's connection: connecting (with retries), the handshake, and the
//! background task that serves the socket. Calls register a reply slot under a
//! fresh request id; replies are routed to the slots by id, so any number of calls
//! pipeline over one connection. (A barrier call through a shared-memory channel
//! registers one only if its round failed, and finds its reply kept if it came
//! first: see [`Link::claim`].)
//!
//! A call writes its request itself when the task is not writing (see [`Direct`]),
//! and reads the socket itself while it is the only call waiting (see
//! [`ReadSide`]): a rank that makes one call at a time (a barrier, a training
//! step's `add`) then costs no hand-over to the task, no wake-up and no turn of its
//! loop, only the `send` and the `recv`. Otherwise, and over TLS, the call hands its
//! request to the task, which gathers what is queued into as few writes as it can,
//! heartbeats included, and the task reads the replies. A separate task fails the
//! calls whose timeout passed, with one timer for all of them.
//!
//! A cut connection is not the end of the session (docs/PROTOCOL.md, section 14):
//! the task reconnects with [`Backoff`], says hello again with the session's id as a
//! resume token, and re-sends every request it wrote and has no reply for, with the
//! same ids; the coordinator runs none of them twice. If the coordinator no longer
//! has the session (its reconnect grace ran out, or it restarted), the task carries
//! on as a new session and those requests fail with [`Error::Disconnected`]: whether
//! they took effect is unknown, so they are not sent blindly again. Requests not yet
//! written go out on the new connection either way.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::io;
use std::num::NonZeroU64;
use std::ops::Range;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use bytes::BytesMut;
use rallypoint_core::{Identity, OpError, Request, Response, Welcome};
use rallypoint_proto::native::{
    decode_server_frame, decode_shared_reply, encode_client_frame, encode_request_frame, pending_frame_len,
    ClientFrame, FrameLimits, ProtoError, ServerFrame,
};
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, oneshot, Notify};
use tokio::time::{Instant, Interval, MissedTickBehavior};
use tracing::{debug, info};

use rallypoint_net::conn::{greet, not_a_coordinator, AuthFailure, Buffering, Credentials, GreetError};
use rallypoint_net::shm;
use rallypoint_net::sync::{lock, Backoff};
use rallypoint_net::{unix_path, ReadHalf, Sender, Stream, WriteHalf};

use crate::channel::Channels;
use crate::error::Error;

/// Most bytes reserved at once for the rest of a reply whose length prefix has
/// arrived. Beyond it the buffer grows as the bytes arrive: a corrupt prefix must
/// not make the client reserve gigabytes.
const MAX_RESERVE: usize = 256 << 20;
/// Stop gathering queued requests into one write past this size.
const MAX_WRITE_BATCH: usize = 1 << 20;
/// Heartbeat periods without a byte from the coordinator after which the connection
/// counts as cut: each heartbeat gets a reply, so that much silence (a third more
/// than a lease) means the path is gone even though no error says so.
const SILENT_BEATS: u32 = 4;
/// How long a cut connection is tried again when the coordinator has no lease (with
/// a lease, for a lease: a session is not kept longer than that).
const RESUME_WINDOW_WITHOUT_LEASE: Duration = Duration::from_secs(15);
/// The longest a call is waited for: a deadline further out is as good as none,
/// and must not overflow the clock.
const LONGEST_WAIT: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
/// Replies kept for barrier calls through a channel that had not looked for them
/// yet ([`ChannelCalls::stashed`]). More than a client has such calls in flight (one per
/// barrier it keeps a seat for); the bound only matters for replies that come
/// after their calls gave up, which nobody takes.
const MAX_STASHED: usize = 128;

/// Most bytes of a written request's frame kept as they are ([`Written::Frame`]):
/// a barrier's with a name of up to 34 bytes.
const KEPT_FRAME: usize = 62;

/// A call's request once written, kept to send again should the connection be cut
/// before its reply: as its frame when that is small (a barrier's, an `add`'s), so
/// that what a call keeps stays in the line it touches anyway; else the request.
#[derive(Clone)]
enum Written {
    Frame { len: u8, bytes: [u8; KEPT_FRAME] },
    Request(Box<Request>),
}

impl Written {
    /// Keeps `request`, written as `frame` (its plain request frame), in `kept`: as
    /// the frame if small, and the request is given back; else boxed.
    fn keep(kept: &mut Option<Written>, frame: &[u8], request: Request) -> Option<Request> {
        let len = u8::try_from(frame.len()).ok().filter(|_| frame.len() <= KEPT_FRAME);
        let Some(len) = len else {
            *kept = Some(Written::Request(Box::new(request)));
            return None;
        };
        // Built in place, not moved in: the frame's bytes are written once, where kept.
        if !matches!(kept, Some(Written::Frame { .. })) {
            *kept = Some(Written::Frame { len: 0, bytes: [0; KEPT_FRAME] });
        }
        if let Some(Written::Frame { len: kept_len, bytes }) = kept {
            bytes[..frame.len()].copy_from_slice(frame);
            *kept_len = len;
        }
        Some(request)
    }

    /// Appends the request's frame (call `id`'s) to `buf`.
    fn encode(&self, id: u64, buf: &mut BytesMut) {
        match self {
            Written::Frame { len, bytes } => buf.extend_from_slice(&bytes[..usize::from(*len)]),
            Written::Request(request) => encode_request_frame(id, request, buf),
        }
    }
}

/// Where a call's reply goes: filled by whoever reads it from the socket (the task,
/// or a call reading for everyone) or fails the call, taken by the call. Until then
/// it keeps the call's request once written ([`Written`]). A call made while no
/// other is in flight (a rank's barrier, a training step's `add`) uses the cell in
/// its link's own lines ([`Pending::own`]); the others each have one of their own.
struct ReplyCell(Mutex<Held>);

/// A cell's state, and the waker of the call that looked at it last: the link's own
/// cell keeps it from call to call, so that the same caller's next call (a rank's
/// loop) need not clone it again. Until then it holds on to that caller's task. (A
/// reply that comes before the next call first looks may wake the caller before
/// it: a spurious wake-up, which is allowed; the call finds its reply when it looks.)
struct Held {
    cell: Cell,
    waker: Option<Waker>,
}

enum Cell {
    Waiting {
        /// The request, once written to a connection.
        written: Option<Written>,
    },
    /// Errors boxed: rare, and large.
    Filled(Result<Response, Box<Error>>),
    /// The call was forgotten without a reply (the connection task is gone).
    Dropped,
    Taken,
}

impl Held {
    const fn waiting() -> Cell {
        Cell::Waiting { written: None }
    }

    /// Ends the wait with `end`: what the cell held, and the waker of the call that
    /// waited if it left one, both for after the lock.
    fn end(&mut self, end: Cell) -> (Cell, Option<Waker>) {
        let left = std::mem::replace(&mut self.cell, end);
        let waker = if matches!(left, Cell::Waiting { .. }) { self.waker.clone() } else { None };
        (left, waker)
    }

    /// Keeps the call's request, written to the connection as `frame` (unless the
    /// call has ended meanwhile). Gives the request back unless it is kept as it is.
    fn keep_written(&mut self, frame: &[u8], request: Request) -> Option<Request> {
        match &mut self.cell {
            Cell::Waiting { written } => Written::keep(written, frame, request),
            _ => Some(request),
        }
    }

    /// Keeps `request`, written, as it is (see [`Held::keep_written`]).
    fn keep_request(&mut self, request: Request, keep_first: bool) {
        if let Cell::Waiting { written } = &mut self.cell {
            if !(keep_first && written.is_some()) {
                *written = Some(Written::Request(Box::new(request)));
            }
        }
    }

    /// The call's request if it was written.
    fn written(&self) -> Option<Written> {
        match &self.cell {
            Cell::Waiting { written } => written.clone(),
            _ => None,
        }
    }

    fn was_written(&self) -> bool {
        matches!(&self.cell, Cell::Waiting { written: Some(_) })
    }

    /// Takes the call's request back: it was not written after all.
    fn unwritten(&mut self) -> Option<Written> {
        match &mut self.cell {
            Cell::Waiting { written } => written.take(),
            _ => None,
        }
    }

    /// The reply if it came (the cell is `Taken` after it), else keeps `waker` to be
    /// woken when it does.
    #[inline]
    fn poll_take(&mut self, waker: &Waker) -> Poll<Received> {
        if let Cell::Waiting { .. } = self.cell {
            keep_waker(&mut self.waker, waker);
            return Poll::Pending;
        }
        match std::mem::replace(&mut self.cell, Cell::Taken) {
            Cell::Filled(result) => Poll::Ready(Ok(result.map_err(|error| *error))),
            _ => Poll::Ready(Err(ReplyDropped)),
        }
    }
}

impl ReplyCell {
    fn new(cell: Cell) -> ReplyCell {
        ReplyCell(Mutex::new(Held { cell, waker: None }))
    }

    fn lock(&self) -> MutexGuard<'_, Held> {
        lock(&self.0)
    }

    /// Ends the wait with `end` and wakes the call that waited, if one left a waker.
    /// The wake-up and what the cell held (a written request) go after the lock.
    fn end_with(&self, end: Cell) {
        let (left, waker) = self.lock().end(end);
        drop(left);
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

/// The filling side of a call's [`ReplyCell`], kept with the call; dropped unfilled,
/// it tells the call so.
pub(crate) struct ReplySlot {
    cell: Arc<ReplyCell>,
    sent: bool,
}

impl ReplySlot {
    /// Fills the cell and wakes the call.
    fn send(mut self, result: Result<Response, Error>) {
        self.sent = true;
        self.cell.end_with(Cell::Filled(result.map_err(Box::new)));
    }

    /// Drops the slot without telling the call (which no longer waits).
    fn forget(mut self) {
        self.sent = true;
    }
}

impl Drop for ReplySlot {
    fn drop(&mut self) {
        if !self.sent {
            self.cell.end_with(Cell::Dropped);
        }
    }
}

/// Where a registered call's reply goes.
enum Slot {
    Cell(ReplySlot),
    /// The link's own cell ([`Pending::own`]).
    Own,
}

/// A reply in a cell of its own, as a future; [`Link::poll_reply`] reads it from
/// the socket too.
pub(crate) struct Reply(Arc<ReplyCell>);

/// The call was forgotten without a reply: the connection is gone.
#[derive(Debug)]
pub(crate) struct ReplyDropped;

/// What a [`Reply`] gives.
pub(crate) type Received = Result<Result<Response, Error>, ReplyDropped>;

impl Reply {
    #[inline]
    fn poll_cell(&self, waker: &Waker) -> Poll<Received> {
        self.0.lock().poll_take(waker)
    }

    /// A reply that came before its call looked for it.
    pub(crate) fn came(result: Result<Response, Error>) -> Reply {
        Reply(Arc::new(ReplyCell::new(Cell::Filled(result.map_err(Box::new)))))
    }
}

impl std::future::Future for Reply {
    type Output = Received;

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Received> {
        self.poll_cell(cx.waker())
    }
}

/// Where a call made through [`Link::open_call`] finds its reply.
pub(crate) enum CallReply {
    /// In the link's own cell.
    Own,
    Cell(Reply),
}

/// What a call sends to the connection task.
pub(crate) enum Command {
    Request {
        id: u64,
        request: Request,
    },
    /// The barrier call `request`, asking the node agent for a barrier channel for
    /// its later calls (module `channel`), on connection `epoch`.
    AttachBarrier {
        id: u64,
        request: Request,
        epoch: u64,
    },
    /// This client gives up slot `slot` of barrier channel `channel`, given on
    /// connection `epoch` (module `channel`).
    LeaveChannel {
        channel: u64,
        slot: u32,
        epoch: u64,
    },
    /// Nothing of this shared-memory slab's current contents is held any more; the
    /// slab belongs to connection `epoch` (a later connection knows it not).
    Release {
        slab: u64,
        epoch: u64,
    },
    /// Shut the socket down (after everything queued before it was written) and
    /// tell the sender when done.
    Shutdown(oneshot::Sender<()>),
    /// Give the session up as a crash would (Abandon), then as `Shutdown`.
    Abandon(oneshot::Sender<()>),
    /// A call wrote part of its frame itself: the rest waits in [`Direct`].
    Flush,
}

/// The cache lines of a [`Link`] that a lone call touches (its first ones).
const HOT_LINES: usize = 6;

// Up to the end of the read side's buffer, the last of what a lone call touches.
// A mutex's data starts at most its own state's size in: so this end is never
// placed too early.
#[cfg(target_os = "linux")]
const _: () = assert!(
    std::mem::offset_of!(Link, read) + size_of::<Mutex<ReadSide>>() - size_of::<ReadSide>()
        + std::mem::offset_of!(ReadSide, files)
        <= HOT_LINES * 64
);

/// State shared by every clone of a client and its connection task.
///
/// In declared order (`repr(C)`, here and in the parts a call uses), what every
/// call touches first, in as few cache lines as it fits ([`HOT_LINES`], from a
/// line's start): a rank whose work between two calls evicts the caches, or a
/// process with thousands of connections, finds its link cold at every call, and
/// pays a cache miss per line touched, not per field.
#[repr(C, align(64))]
pub(crate) struct Link {
    pending: Mutex<Pending>,
    next_id: AtomicU64,
    /// Reads from the coordinator so far: the writer checks between heartbeats that
    /// the coordinator still sends something.
    reads: AtomicU64,
    /// Whom the socket's read readiness wakes: the waker every read registers.
    read_wake: Arc<ReadWake>,
    read_waker: Waker,
    /// How calls write their requests themselves.
    direct: Mutex<Direct>,
    /// The read half and what reading it needs, for the task and calls alike.
    read: Mutex<ReadSide>,
    /// Replies handed to their calls since the writer last looked: each woke a
    /// caller that may be about to send its next request.
    delivered: AtomicUsize,
    /// A reply cell its call no longer holds, for the next call that needs one:
    /// calls that overlap (pipelined ones) then allocate none (see [`Link::recycle`]).
    /// Out of the lines a lone call touches, which needs none.
    spare: Mutex<Option<Arc<ReplyCell>>>,
    addr: String,
    /// The latest welcome: the session (the resume token) and the job's incarnation.
    welcome: Mutex<Welcome>,
    /// A call's deadline comes before the task's timer ([`Pending::armed`]).
    deadline_moved: Notify,
    /// Barrier channels given on this connection (module `channel`).
    pub(crate) channels: Channels,
    /// Replies stashed so far ([`ChannelCalls::stashed`]): a channel call waiting learns
    /// with one load whether its reply may have come.
    stashes: AtomicU64,
    /// Replies read by their own calls.
    #[cfg(test)]
    own_replies: AtomicUsize,
    /// Ends of connections found by calls reading.
    #[cfg(test)]
    ends_found_by_calls: AtomicUsize,
}

/// The connection's read half and its state, shared between the task and the calls:
/// a call that is the only one waiting reads the socket itself ([`Link::poll_reply`]),
/// so that its reply costs no wake-up of the task and no hand-over. Whoever holds
/// the lock reads; [`ReadWake`] sends the socket's wake-ups to whoever reads now.
#[repr(C)]
struct ReadSide {
    /// The call reading for everyone; `None`: the task. (Request ids start at 1.)
    call: Option<NonZeroU64>,
    /// [`ReadWake::wakes`] before the last read that found nothing.
    seen_wakes: u64,
    /// Calls may read themselves (not over TLS: decrypting takes the task).
    direct: bool,
    /// `None` between connections, and once a read found the connection ended.
    reader: Option<ReadHalf>,
    /// How the connection ended, found by a call: for the task to act on. Boxed:
    /// every call looks at it, and it is large.
    ended: Option<Box<Ended>>,
    /// What came after the welcome, and what is held of a frame read in part: other
    /// replies are read into their thread's buffer ([`Link::drive`]).
    buf: BytesMut,
    // What follows is for shared replies only: out of a lone call's lines
    // (`HOT_LINES`), so a plain reply reads none of it.
    /// Files of shared-memory slabs, received with (or before) the first frame
    /// naming each, in order; and the slabs mapped so far, kept for the connection's life.
    files: VecDeque<OwnedFd>,
    slabs: HashMap<u64, Arc<memmap2::Mmap>>,
    releases: mpsc::WeakUnboundedSender<Command>,
    epoch: u64,
}

/// The waker of every read of the socket: it passes the socket's wake-up on to the
/// call reading for everyone, else to the task. One waker whose target changes
/// under a lock, rather than each reader registering its own, so that a wake-up
/// is never lost between two readers, and the task is not woken for bytes a call reads.
#[derive(Default)]
struct ReadWake {
    targets: Mutex<WakeTargets>,
    /// The wake-ups so far ([`WAKE`] each), and [`CALLING`] while a call reads for
    /// everyone (the wake-ups go to [`WakeTargets::call`] then). One word, so that a
    /// wake-up counts itself and learns where it goes in one step, and a call giving
    /// reading back stops taking them and learns whether one came since its last
    /// read in one step too: none is lost between the two.
    state: AtomicU64,
}

/// [`ReadWake::state`]'s flag: a call reads.
const CALLING: u64 = 1;
/// [`ReadWake::state`]'s count of one wake-up.
const WAKE: u64 = 2;

#[derive(Default)]
struct WakeTargets {
    task: Option<Waker>,
    /// The waker of the call reading, or of the last call that read: kept, so that
    /// the same caller's next call (a rank's loop) need not clone it again. Until
    /// then it holds on to that caller's task, as the link's own cell does.
    call: Option<Waker>,
}

impl ReadWake {
    fn lock(&self) -> MutexGuard<'_, WakeTargets> {
        lock(&self.targets)
    }

    /// The wake-ups so far.
    fn wakes(&self) -> u64 {
        self.state.load(Ordering::Acquire) / WAKE
    }

    /// Wake-ups go to the call reading, whose waker is `waker`, from now on.
    fn to_call(&self, waker: &Waker) {
        let mut targets = self.lock();
        keep_waker(&mut targets.call, waker);
        self.state.fetch_or(CALLING, Ordering::AcqRel);
    }

    /// Wake-ups go to the task from now on; returns the wake-ups so far, each of
    /// which went to the call reading until now (the task gets any later one).
    fn to_task(&self) -> u64 {
        self.state.fetch_and(!CALLING, Ordering::AcqRel) / WAKE
    }
}

impl Wake for ReadWake {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let waker = {
            let targets = self.lock();
            let calling = self.state.fetch_add(WAKE, Ordering::AcqRel) & CALLING != 0;
            let call = targets.call.as_ref().filter(|_| calling);
            call.or(targets.task.as_ref()).cloned()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

/// Keeps `waker` in `slot`, cloning only if it is another one.
fn keep_waker(slot: &mut Option<Waker>, waker: &Waker) {
    if !slot.as_ref().is_some_and(|known| known.will_wake(waker)) {
        *slot = Some(waker.clone());
    }
}

#[repr(C)]
struct Pending {
    calls: Calls,
    /// The call whose reply goes to [`Pending::own`], if one does.
    own_call: Option<NonZeroU64>,
    /// The link's own reply cell, for a call made while it is free: a rank making
    /// one call at a time then touches no cell of its own, in lines of their own.
    own: Held,
    /// Set once the connection has ended for good: why, as reported to every later
    /// call. Boxed: every call looks at it, and it is large.
    closed: Option<Box<Closed>>,
    /// When the task looks next for calls past their deadline; `None`: no timer
    /// (nobody waited since it last looked). Never after the earliest deadline.
    armed: Option<Instant>,
    /// When the latest call the coordinator ran was made, as its reply tells: a sign
    /// of life of the rank, as a heartbeat is ([`write_loop`]). A call refused as
    /// invalid did not reach the lease, and one not answered yet may never.
    last_call: Option<Instant>,
    /// What only barrier calls through a channel use. Boxed, out of the lines
    /// every call touches.
    channel_calls: Box<ChannelCalls>,
}

#[derive(Default)]
struct ChannelCalls {
    /// Replies to barrier calls through a channel that came before their calls
    /// looked for them, oldest first. Such a call takes only a request id, no
    /// reply slot: a released round has no reply. Only a failed round has, and the
    /// agent may send it before the call wakes to see the failure ([`Link::claim`]).
    stashed: VecDeque<(u64, Result<Response, Error>)>,
    /// Barrier calls through a channel that were in flight when their connection was
    /// cut, registered then as written requests ([`Link::adopt_channel_calls`]), with
    /// the reply each is to take (it looks for it in [`Link::claim`]).
    adopted: Vec<(u64, Reply)>,
}

impl ChannelCalls {
    fn take_stashed(&mut self, id: u64) -> Option<Result<Response, Error>> {
        let at = self.stashed.iter().position(|(stashed, _)| *stashed == id)?;
        self.stashed.remove(at).map(|(_, result)| result)
    }

    fn take_adopted(&mut self, id: u64) -> Option<Reply> {
        let at = self.adopted.iter().position(|(adopted, _)| *adopted == id)?;
        Some(self.adopted.swap_remove(at).1)
    }
}

impl Pending {
    /// The connection's end, as every later call learns it, if it ended for good.
    fn still_open(&self) -> Result<(), Error> {
        self.closed.as_ref().map_or(Ok(()), |closed| Err(closed.error()))
    }

    /// Keeps call `id`'s request, written as `frame` (see [`Held::keep_written`]);
    /// gives the request back unless it is kept as it is.
    fn keep_written(&mut self, id: u64, frame: &[u8], request: Request) -> Option<Request> {
        match self.calls.get(&id).map(|call| &call.slot) {
            Some(Slot::Cell(slot)) => slot.cell.lock().keep_written(frame, request),
            Some(Slot::Own) => self.own.keep_written(frame, request),
            // A call that stopped waiting meanwhile needs nothing kept.
            None => Some(request),
        }
    }

    /// Keeps call `id`'s written request as it is; `keep_first`: a request kept
    /// already stays.
    fn keep_request(&mut self, id: u64, request: Request, keep_first: bool) {
        match self.calls.get(&id).map(|call| &call.slot) {
            Some(Slot::Cell(slot)) => slot.cell.lock().keep_request(request, keep_first),
            Some(Slot::Own) => self.own.keep_request(request, keep_first),
            None => {}
        }
    }

    fn written(&self, slot: &Slot) -> Option<Written> {
        match slot {
            Slot::Cell(slot) => slot.cell.lock().written(),
            Slot::Own => self.own.written(),
        }
    }

    fn was_written(&self, slot: &Slot) -> bool {
        match slot {
            Slot::Cell(slot) => slot.cell.lock().was_written(),
            Slot::Own => self.own.was_written(),
        }
    }

    /// Frees the link's own cell from call `id` (if it holds it), taking what it held.
    fn free_own(&mut self, id: u64) -> Option<Cell> {
        if self.own_call != NonZeroU64::new(id) {
            return None;
        }
        self.own_call = None;
        match &mut self.own.cell {
            // Nothing in it to drop (the usual end: a small request kept): emptied in place.
            Cell::Waiting { written } if !matches!(written, Some(Written::Request(_))) => {
                *written = None;
                None
            }
            cell => Some(std::mem::replace(cell, Held::waiting())),
        }
    }
}

/// A call waiting for its reply (its request, once written, is kept in its slot's
/// cell: sent again if that connection is cut before the reply).
struct Call {
    slot: Slot,
    /// When the caller stops waiting: the call then fails with `Error::Timeout(limit)`.
    deadline: Instant,
    limit: Duration,
}

/// What registering a call leaves to do once the calls' lock is released
/// ([`Link::after_registration`]).
#[must_use]
struct Registration {
    /// Its deadline comes before the task's timer: the task must be told.
    earlier: bool,
    /// Another call waits too: a call reading for everyone must give reading back.
    shared: bool,
}

/// The calls waiting for their replies, by request id. A rank mostly makes one call
/// at a time: that one is kept in place, so that registering and finding it touch
/// no table (at thousands of connections, each link's state is cold at every call).
#[derive(Default)]
#[repr(C)]
struct Calls {
    one: Option<(u64, Call)>,
    /// How many there are, `one` included: while it is one, `more` is not touched.
    count: usize,
    /// Keyed by our own request ids (no peer chooses them): a fast hash will do.
    /// Boxed, out of the lines a lone call touches.
    #[allow(clippy::box_collection, reason = "8 bytes among the lines every call touches, not 32")]
    more: Box<HashMap<u64, Call, foldhash::fast::RandomState>>,
}

impl Calls {
    fn insert(&mut self, id: u64, call: Call) {
        let replaced = match &mut self.one {
            Some((known, kept)) if *known == id => Some(std::mem::replace(kept, call)),
            None if !(self.count > 0 && self.more.contains_key(&id)) => {
                self.one = Some((id, call));
                None
            }
            _ => self.more.insert(id, call),
        };
        if replaced.is_none() {
            self.count += 1;
        }
    }

    fn remove(&mut self, id: &u64) -> Option<Call> {
        let removed = match &self.one {
            Some((known, _)) if known == id => self.one.take().map(|(_, call)| call),
            _ if self.count == usize::from(self.one.is_some()) => None,
            _ => self.more.remove(id),
        };
        if removed.is_some() {
            self.count -= 1;
        }
        removed
    }

    fn get(&self, id: &u64) -> Option<&Call> {
        match &self.one {
            Some((known, call)) if known == id => Some(call),
            _ => self.more.get(id),
        }
    }

    fn contains_key(&self, id: &u64) -> bool {
        self.get(id).is_some()
    }

    fn len(&self) -> usize {
        self.count
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn iter(&self) -> impl Iterator<Item = (&u64, &Call)> {
        self.one.iter().map(|(id, call)| (id, call)).chain(self.more.iter())
    }

    #[cfg(test)]
    fn keys(&self) -> impl Iterator<Item = &u64> {
        self.iter().map(|(id, _)| id)
    }

    fn values(&self) -> impl Iterator<Item = &Call> {
        self.iter().map(|(_, call)| call)
    }

    /// Takes every call out.
    fn take(&mut self) -> impl Iterator<Item = (u64, Call)> {
        self.count = 0;
        let one = self.one.take();
        one.into_iter().chain(std::mem::take(&mut *self.more))
    }
}

/// The connection's write half, shared between its task and the calls: a call
/// writes its frame itself when the task is not writing (nor has bytes to write
/// first), with a non-blocking `send` under this lock, so that frames never
/// interleave. TLS connections have no `writer` here: encrypting takes the task.
#[derive(Default)]
#[repr(C)]
struct Direct {
    /// With the socket's descriptor beside it: a call reaches the socket without
    /// reading the half, cold at its turn in a process with many connections.
    writer: Option<Sender>,
    /// The task is writing, or has `rest` to write first: calls hand their requests over.
    busy: bool,
    /// The end of a frame a call could write only in part; the task writes it next.
    /// Boxed, out of the lines a lone call touches: it is rarely needed.
    rest: Box<BytesMut>,
}

thread_local! {
    /// Where calls encode the frames they write themselves: one buffer per thread,
    /// warm in its cache, rather than one per connection, which a process with many
    /// connections finds cold at every call.
    static ENCODED: std::cell::RefCell<BytesMut> = std::cell::RefCell::new(BytesMut::new());
    /// Where a connection's replies are read while it holds no part of a frame: one
    /// buffer per thread, warm in its cache (the kernel's copy and the decoding
    /// then miss nothing), rather than the connection's own, cold at every reply
    /// in a process with many connections. Only what is left of a frame goes there.
    /// As large as a client keeps: a reply split off its front leaves the room for
    /// the next read, which then need not move anything back, for thousands of reads.
    static RECEIVED: std::cell::RefCell<BytesMut> =
        std::cell::RefCell::new(BytesMut::with_capacity(Buffering::CLIENT.keep));
}

/// Gives the buffer a call encoded its request in back to its thread, emptied.
fn return_encoded(mut buf: BytesMut) {
    buf.clear();
    Buffering::CLIENT.release_idle(&mut buf);
    // Gone only if the thread is exiting, and the buffer with it.
    let _ = ENCODED.try_with(|kept| *kept.borrow_mut() = buf);
}

/// What [`Link::call`] did with a request.
pub(crate) enum DirectWrite {
    /// Written (or its end left to the task, which has been told so).
    Written,
    /// Written in part: the task must be told to write the rest ([`Command::Flush`]).
    Partly,
    /// Not written: hand it to the task.
    Queue(Request),
}

/// Why the connection ended for good.
#[derive(Clone)]
enum Closed {
    Lost(String),
    /// A new session was refused after a cut (the rank was taken over meanwhile, the
    /// job was reset): the coordinator's typed answer.
    Refused(OpError),
}

impl Closed {
    fn error(&self) -> Error {
        match self {
            Closed::Lost(why) => Error::Disconnected(why.clone()),
            Closed::Refused(error) => Error::Op(error.clone()),
        }
    }
}

impl Link {
    fn new(addr: String, welcome: Welcome, releases: mpsc::WeakUnboundedSender<Command>) -> Self {
        let read_wake = Arc::new(ReadWake::default());
        let channels = Channels::new(releases.clone());
        let read = ReadSide {
            reader: None,
            direct: false,
            call: None,
            seen_wakes: 0,
            ended: None,
            buf: BytesMut::new(),
            files: VecDeque::new(),
            slabs: HashMap::new(),
            releases,
            epoch: 0,
        };
        Link {
            read: Mutex::new(read),
            read_waker: Waker::from(Arc::clone(&read_wake)),
            read_wake,
            #[cfg(test)]
            own_replies: AtomicUsize::new(0),
            #[cfg(test)]
            ends_found_by_calls: AtomicUsize::new(0),
            addr,
            next_id: AtomicU64::new(1),
            pending: Mutex::new(Pending {
                calls: Calls::default(),
                closed: None,
                armed: None,
                last_call: None,
                own_call: None,
                own: Held { cell: Held::waiting(), waker: None },
                channel_calls: Box::default(),
            }),
            spare: Mutex::new(None),
            delivered: AtomicUsize::new(0),
            reads: AtomicU64::new(0),
            welcome: Mutex::new(welcome),
            direct: Mutex::new(Direct::default()),
            deadline_moved: Notify::new(),
            channels,
            stashes: AtomicU64::new(0),
        }
    }

    fn lock_direct(&self) -> MutexGuard<'_, Direct> {
        lock(&self.direct)
    }

    fn lock(&self) -> MutexGuard<'_, Pending> {
        // Nothing panics while holding this lock; recover rather than cascade if it ever does.
        lock(&self.pending)
    }

    pub(crate) fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// The latest welcome (the session may have changed after a cut).
    pub(crate) fn welcome(&self) -> Welcome {
        lock(&self.welcome).clone()
    }

    fn set_welcome(&self, welcome: Welcome) {
        *lock(&self.welcome) = welcome;
    }

    /// Allocates a request id and a cell of its own its reply will arrive in; past
    /// `limit` the call fails with [`Error::Timeout`].
    pub(crate) fn register(&self, limit: Duration) -> Result<(u64, Reply), Error> {
        let (mut pending, id, deadline) = self.begin_call(limit)?;
        let (reply, registered) = self.insert_cell(&mut pending, id, deadline, limit);
        drop(pending);
        self.after_registration(registered);
        Ok((id, reply))
    }

    /// As [`Link::register`], for a call that waits through [`WaitReply`]: its reply
    /// goes to the link's own cell if no other call holds it.
    pub(crate) fn open_call(&self, limit: Duration) -> Result<(u64, CallReply), Error> {
        let (mut pending, id, deadline) = self.begin_call(limit)?;
        let (reply, registered) = self.open(&mut pending, id, deadline, limit);
        drop(pending);
        self.after_registration(registered);
        Ok((id, reply))
    }

    /// Registers call `id` in `pending` (the lock taken), its reply going to the
    /// link's own cell if no other call holds it, else to a cell of its own; what
    /// the registration leaves to do once the lock is released goes to [`Link::after_registration`].
    fn open(&self, pending: &mut Pending, id: u64, deadline: Instant, limit: Duration) -> (CallReply, Registration) {
        if pending.own_call.is_some() {
            let (reply, registered) = self.insert_cell(pending, id, deadline, limit);
            return (CallReply::Cell(reply), registered);
        }
        // Left waiting, with nothing written, by the call that held it last.
        pending.own_call = NonZeroU64::new(id);
        (CallReply::Own, Self::insert(pending, id, Slot::Own, deadline, limit))
    }

    /// A new call's id and deadline (past `limit`), with the calls' lock to register
    /// it under; the connection's end if it has ended for good.
    fn begin_call(&self, limit: Duration) -> Result<(MutexGuard<'_, Pending>, u64, Instant), Error> {
        let deadline = Instant::now() + limit.min(LONGEST_WAIT);
        let pending = self.lock();
        pending.still_open()?;
        Ok((pending, self.next_id(), deadline))
    }

    /// The reply to barrier call `id` through a channel, which took only its id
    /// ([`Link::next_id`]): the one stashed for it if it came already, else a slot
    /// it will arrive in, registered as any call's (past `deadline` the call fails
    /// with [`Error::Timeout`]`(limit)`). Looked for and registered under the lock
    /// a reply is stashed under, so that it is found whenever it comes.
    pub(crate) fn claim(&self, id: u64, deadline: std::time::Instant, limit: Duration) -> Result<Reply, Error> {
        let mut pending = self.lock();
        if let Some(result) = pending.channel_calls.take_stashed(id) {
            return Ok(Reply::came(result));
        }
        if let Some(reply) = pending.channel_calls.take_adopted(id) {
            return Ok(reply);
        }
        pending.still_open()?;
        let deadline = Instant::from_std(deadline).min(Instant::now() + LONGEST_WAIT);
        let (reply, registered) = self.insert_cell(&mut pending, id, deadline, limit);
        drop(pending);
        self.after_registration(registered);
        Ok(reply)
    }

    /// When the latest call the coordinator ran was made ([`Pending::last_call`]).
    fn last_call(&self) -> Option<Instant> {
        self.lock().last_call
    }

    /// Takes the reply stashed for barrier call `id` through a channel, if it came.
    pub(crate) fn take_stashed(&self, id: u64) -> Option<Result<Response, Error>> {
        self.lock().channel_calls.take_stashed(id)
    }

    /// Whether barrier call `id` through a channel was adopted when its connection
    /// was cut: its outcome is the reply to its request, sent again if the session
    /// resumes ([`Link::claim`] hands it over).
    pub(crate) fn adopted(&self, id: u64) -> bool {
        self.lock().channel_calls.adopted.iter().any(|(adopted, _)| *adopted == id)
    }

    /// The connection was cut: each barrier call in flight through one of its
    /// channels, whose arrival the coordinator may have counted and whose reply
    /// (none for a released round) will not come through the channel, becomes a
    /// written request, as any call's is. A resumed session is sent it again with the
    /// same id (the coordinator answers it once, counting it once); if the session is
    /// not resumed, it fails as the other written calls do, its outcome unknown.
    /// Called before the channels' waiters learn that the connection ended, so that
    /// each finds its call adopted.
    fn adopt_channel_calls(&self) {
        let in_flight = self.channels.in_flight();
        let mut pending = self.lock();
        // Calls that ended meanwhile without looking (their round was released).
        let Pending { channel_calls, calls, .. } = &mut *pending;
        channel_calls.adopted.retain(|(id, _)| calls.contains_key(id));
        for (id, request) in in_flight {
            // Looking for its reply already (its round failed): sent again too, as
            // the reply may have been lost with the connection.
            if pending.calls.contains_key(&id) {
                pending.keep_request(id, request, true);
                continue;
            }
            // Its reply came before the cut: the call finds it stashed.
            if pending.channel_calls.stashed.iter().any(|(stashed, _)| *stashed == id) {
                continue;
            }
            let written = Some(Written::Request(Box::new(request)));
            let cell = Arc::new(ReplyCell::new(Cell::Waiting { written }));
            let slot = ReplySlot { cell: Arc::clone(&cell), sent: false };
            // The call bounds its own wait (and forgets the call past it).
            let call = Call { slot: Slot::Cell(slot), deadline: Instant::now() + LONGEST_WAIT, limit: LONGEST_WAIT };
            pending.calls.insert(id, call);
            pending.channel_calls.adopted.push((id, Reply(cell)));
        }
    }

    /// Replies stashed so far: compare with [`Link::replied`]'s `seen`.
    pub(crate) fn stashes(&self) -> u64 {
        self.stashes.load(Ordering::Acquire)
    }

    /// A reply to barrier call `id` through a channel is stashed; `seen`: what
    /// [`Link::stashes`] said before the call's id went out, so that a wait checks
    /// with one load while none came.
    pub(crate) fn replied(&self, id: u64, seen: u64) -> bool {
        self.stashes() != seen && self.lock().channel_calls.stashed.iter().any(|(stashed, _)| *stashed == id)
    }

    /// Registers call `id` in `pending` (the lock taken) with a cell of its own; returns its reply.
    fn insert_cell(&self, pending: &mut Pending, id: u64, deadline: Instant, limit: Duration) -> (Reply, Registration) {
        // A spare was left waiting ([`Link::recycle`]).
        let cell = lock(&self.spare).take().unwrap_or_else(|| Arc::new(ReplyCell::new(Held::waiting())));
        let slot = ReplySlot { cell: Arc::clone(&cell), sent: false };
        (Reply(cell), Self::insert(pending, id, Slot::Cell(slot), deadline, limit))
    }

    /// Registers call `id` in `pending` (the lock taken), its reply going to `slot`.
    fn insert(pending: &mut Pending, id: u64, slot: Slot, deadline: Instant, limit: Duration) -> Registration {
        pending.calls.insert(id, Call { slot, deadline, limit });
        // Usually later than the timer (calls share one timeout): nothing to tell.
        let earlier = pending.armed.is_none_or(|armed| deadline < armed);
        if earlier {
            pending.armed = Some(deadline);
        }
        Registration { earlier, shared: pending.calls.len() > 1 }
    }

    /// What a call's registration left to do once the calls' lock is released.
    fn after_registration(&self, Registration { earlier, shared }: Registration) {
        if earlier {
            self.deadline_moved.notify_one();
        }
        if shared {
            self.share_reading();
        }
    }

    /// Registers a call of `request` (its reply going to the link's own cell if no
    /// other call holds it; past `limit` it fails with [`Error::Timeout`]) and writes
    /// the request now if the task is not writing; see [`DirectWrite`]. Registered
    /// and kept as written under one lock of the calls, taken under the write side's,
    /// so that the task, which takes the writer away under that lock at a cut, finds
    /// the call written.
    pub(crate) fn call(&self, request: Request, limit: Duration) -> Result<(u64, CallReply, DirectWrite), Error> {
        let deadline = Instant::now() + limit.min(LONGEST_WAIT);
        let mut direct = self.lock_direct();
        // Not reentrant: nothing below makes another call.
        let encoded = match &*direct {
            Direct { writer: Some(_), busy: false, .. } => {
                ENCODED.try_with(|buf| std::mem::take(&mut *buf.borrow_mut())).ok()
            }
            _ => None,
        };
        let Some(mut buf) = encoded else {
            drop(direct);
            let (id, reply) = self.open_call(limit)?;
            return Ok((id, reply, DirectWrite::Queue(request)));
        };
        let id = self.next_id();
        encode_request_frame(id, &request, &mut buf);
        let mut pending = self.lock();
        if let Err(error) = pending.still_open() {
            drop(pending);
            drop(direct);
            return_encoded(buf);
            return Err(error);
        }
        let (reply, registered) = self.open(&mut pending, id, deadline, limit);
        // Counted as written before its bytes go, so that a cut right after finds it.
        let given_back = match &reply {
            CallReply::Own => pending.own.keep_written(&buf, request),
            CallReply::Cell(reply) => reply.0.lock().keep_written(&buf, request),
        };
        drop(pending);
        let Direct { writer: Some(writer), rest, .. } = &mut *direct else { unreachable!("checked above") };
        let done = match writer.try_send(&buf) {
            Ok(all) if all == buf.len() => DirectWrite::Written,
            Ok(part) => {
                rest.extend_from_slice(&buf[part..]);
                direct.busy = true;
                DirectWrite::Partly
            }
            // Nothing went (the socket is full, or broke: the task learns that itself).
            // None: the call ended meanwhile, and nobody needs the request.
            Err(_) => match self.unwritten(id, &reply) {
                None => DirectWrite::Written,
                Some(Written::Request(request)) => DirectWrite::Queue(*request),
                Some(Written::Frame { .. }) => given_back.map_or(DirectWrite::Written, DirectWrite::Queue),
            },
        };
        drop(direct);
        return_encoded(buf);
        self.after_registration(registered);
        Ok((id, reply, done))
    }

    /// Takes call `id`'s written request back from its cell (`reply`'s): it was not
    /// written after all.
    fn unwritten(&self, id: u64, reply: &CallReply) -> Option<Written> {
        match reply {
            CallReply::Own => {
                let mut pending = self.lock();
                let own = pending.own_call == NonZeroU64::new(id);
                own.then(|| pending.own.unwritten()).flatten()
            }
            CallReply::Cell(reply) => reply.0.lock().unwritten(),
        }
    }

    /// Fails the calls whose deadline has passed, and sets the timer for the next.
    fn expire(&self, now: Instant) {
        let expired: Vec<(u64, Call)> = {
            let mut pending = self.lock();
            let ids: Vec<u64> = pending.calls.iter().filter(|(_, c)| c.deadline <= now).map(|(id, _)| *id).collect();
            let expired = ids.into_iter().filter_map(|id| Some((id, pending.calls.remove(&id)?))).collect();
            pending.armed = pending.calls.values().map(|call| call.deadline).min();
            expired
        };
        for (id, call) in expired {
            self.fill(id, call.slot, Err(Error::Timeout(call.limit)));
        }
    }

    /// Ends call `id`'s wait with `result` through `slot`, its slot, taken out of the
    /// calls (the lock not held), and wakes the call.
    fn fill(&self, id: u64, slot: Slot, result: Result<Response, Error>) {
        match slot {
            Slot::Cell(slot) => slot.send(result),
            Slot::Own => {
                let (left, waker) = {
                    let mut pending = self.lock();
                    if pending.own_call != NonZeroU64::new(id) {
                        return;
                    }
                    pending.own.end(Cell::Filled(result.map_err(Box::new)))
                };
                drop(left);
                if let Some(waker) = waker {
                    waker.wake();
                }
            }
        }
    }

    /// The calls registered and waiting for their replies.
    #[cfg(test)]
    pub(crate) fn registered(&self) -> Vec<u64> {
        self.lock().calls.keys().copied().collect()
    }

    pub(crate) fn addr(&self) -> &str {
        &self.addr
    }

    /// Keeps the cell of a reply its call is done with for the next call that needs
    /// one, if nothing else holds it (its slot was filled or forgotten).
    fn recycle(&self, reply: &Reply) {
        if Arc::strong_count(&reply.0) == 1 {
            // What the cell still holds goes now, outside the locks, not with a next
            // call that may never come: a reply its call never took, or the request of
            // a call that read its own reply. Left waiting, as the next call needs it:
            // it holds no slot, so nothing fills it.
            let left = {
                let mut held = reply.0.lock();
                match held.cell {
                    // Its reply taken (the usual end): nothing to drop.
                    Cell::Taken => {
                        held.cell = Held::waiting();
                        None
                    }
                    _ => Some(std::mem::replace(&mut held.cell, Held::waiting())),
                }
            };
            drop(left);
            lock(&self.spare).get_or_insert_with(|| Arc::clone(&reply.0));
        }
    }

    /// Forgets a call whose caller stopped waiting (timed out or was cancelled).
    pub(crate) fn unregister(&self, id: u64) {
        let (call, freed) = {
            let mut pending = self.lock();
            (pending.calls.remove(&id), pending.free_own(id))
        };
        drop(freed);
        // The caller is the one that stopped waiting: nobody to wake.
        if let Some(Call { slot: Slot::Cell(slot), .. }) = call {
            slot.forget();
        }
    }

    /// The error for a call that finds the connection gone.
    pub(crate) fn disconnected(&self) -> Error {
        match &self.lock().closed {
            Some(closed) => closed.error(),
            None => Error::Disconnected(format!("the connection to the coordinator at {} is closed", self.addr)),
        }
    }

    /// Keeps the requests just encoded into `buf` for a write (each with where its
    /// frame lies, `None` for one encoded as another kind of frame), so that they
    /// can be sent again should the connection be cut before their replies (whether
    /// the write gets through or not).
    fn written(&self, buf: &[u8], requests: Vec<(u64, Option<Range<usize>>, Request)>) {
        if requests.is_empty() {
            return;
        }
        let mut pending = self.lock();
        for (id, frame, request) in requests {
            match frame.and_then(|frame| buf.get(frame)) {
                Some(frame) => drop(pending.keep_written(id, frame, request)),
                None => pending.keep_request(id, request, false),
            }
        }
    }

    /// The requests written and not answered, to send again on a resumed session.
    fn unanswered(&self) -> Vec<(u64, Written)> {
        let pending = self.lock();
        let mut requests: Vec<(u64, Written)> =
            pending.calls.iter().filter_map(|(id, call)| Some((*id, pending.written(&call.slot)?))).collect();
        // In the order first sent, as far as ids tell.
        requests.sort_by_key(|(id, _)| *id);
        requests
    }

    /// Fails the calls whose requests were written: the session they went to is gone.
    fn fail_written(&self, why: &str) {
        let failed: Vec<(u64, Call)> = {
            let mut pending = self.lock();
            let ids: Vec<u64> =
                pending.calls.iter().filter(|(_, c)| pending.was_written(&c.slot)).map(|(id, _)| *id).collect();
            ids.into_iter().filter_map(|id| Some((id, pending.calls.remove(&id)?))).collect()
        };
        for (id, call) in failed {
            self.fill(id, call.slot, Err(Error::Disconnected(why.to_owned())));
        }
    }

    /// Hands call `id` its reply; `me`: the call reading, which takes its own reply
    /// as it is, with no wake-up and no lock of its cell.
    fn complete(&self, id: u64, result: Result<Response, Error>, me: Option<&mut Mine>) {
        let mine = me.as_ref().is_some_and(|mine| mine.id == id);
        let (mut call, freed) = {
            let mut pending = self.lock();
            let call = pending.calls.remove(&id);
            // Made at its deadline less its limit (earlier, for a limit beyond
            // `LONGEST_WAIT`), which is all a sign of life needs.
            let made = call.as_ref().and_then(|call| call.deadline.checked_sub(call.limit));
            if let Some(made) = made.filter(|_| !matches!(result, Err(Error::Op(OpError::Invalid(_))))) {
                pending.last_call = pending.last_call.max(Some(made));
            }
            // The call reading takes its reply as it is: the link's own cell, if it
            // waited there, is free from now on.
            let freed = match &call {
                Some(Call { slot: Slot::Own, .. }) if mine => pending.free_own(id),
                _ => None,
            };
            (call, freed)
        };
        drop(freed);
        if call.is_none() {
            // No call: a heartbeat, a call that timed out on this side, a reply sent
            // again for a request that was re-sent after a cut, or a barrier call
            // through a channel that has not looked for its reply yet (kept for it).
            self.channels.reply_came(id);
            if !self.channels.calling(id) {
                return;
            }
            let mut pending = self.lock();
            // It may have looked meanwhile.
            call = pending.calls.remove(&id);
            if call.is_none() {
                let stashed = &mut pending.channel_calls.stashed;
                if stashed.len() >= MAX_STASHED {
                    stashed.pop_front();
                }
                stashed.push_back((id, result));
                // Under the lock: whoever sees the count moved finds the reply.
                self.stashes.fetch_add(1, Ordering::AcqRel);
                drop(pending);
                // The async calls wait on their channels' wake-ups, not on the socket.
                self.channels.wake_async_waiters();
                return;
            }
        }
        let Some(call) = call else { return };
        match me {
            Some(mine) if mine.id == id => {
                #[cfg(test)]
                self.own_replies.fetch_add(1, Ordering::Relaxed);
                if let Slot::Cell(slot) = call.slot {
                    slot.forget();
                }
                mine.reply = Some(result);
            }
            _ => {
                self.delivered.fetch_add(1, Ordering::Relaxed);
                // The caller may have stopped waiting meanwhile; that is fine.
                self.fill(id, call.slot, result);
            }
        }
    }

    /// Fails every waiting call, and every later one, with `closed`.
    fn close(&self, closed: Closed) {
        let calls = {
            let mut pending = self.lock();
            pending.closed.get_or_insert_with(|| Box::new(closed.clone()));
            pending.calls.take().collect::<Vec<_>>()
        };
        for (id, call) in calls {
            self.fill(id, call.slot, Err(closed.error()));
        }
    }

    fn lost(&self, why: impl std::fmt::Display) -> String {
        format!("connection to the coordinator at {} lost: {why}", self.addr)
    }

    fn lock_read(&self) -> MutexGuard<'_, ReadSide> {
        lock(&self.read)
    }

    /// Waits for call `id`'s reply, reading it from the socket itself when no other
    /// call waits: the reply then costs no wake-up of the task and no hand-over.
    /// While it reads, the call routes every frame that comes, as the task would (a
    /// heartbeat's reply); the socket's wake-ups go to it. Reading goes back to the
    /// task when the call's reply comes, when it is dropped ([`WaitReply`]), when
    /// another call registers ([`Link::share_reading`]), or when the task runs
    /// ([`Link::poll_task_read`]).
    /// `reading`: the call may be reading (kept by the caller between polls).
    fn poll_reply(&self, id: u64, reply: &CallReply, reading: &mut bool, cx: &mut Context<'_>) -> Poll<Received> {
        if *reading {
            // Still the reader: nobody else has routed a reply since it last read,
            // so its cell can only have been filled by a failure (a timeout, the
            // connection's end), which it looks for after reading.
            let mut side = self.lock_read();
            if side.call == NonZeroU64::new(id) {
                return self.read_own(&mut side, id, reply, reading, cx);
            }
        }
        let cell = match reply {
            CallReply::Cell(cell) => Some(cell),
            CallReply::Own => None,
        };
        if let Some(Poll::Ready(received)) = cell.map(|cell| cell.poll_cell(cx.waker())) {
            if std::mem::take(reading) {
                self.stop_reading(id);
            }
            return Poll::Ready(received);
        }
        let mut side = self.lock_read();
        // The link's own cell is looked at under the read side's lock, with the count
        // of calls waiting that taking reading over needs: one lock of the calls for both.
        let mut lone = None;
        if cell.is_none() {
            let mut pending = self.lock();
            if let Poll::Ready(received) = Self::poll_own(&mut pending, id, cx.waker()) {
                drop(pending);
                if std::mem::take(reading) {
                    self.give_back(&mut side, id);
                }
                return Poll::Ready(received);
            }
            lone = Some(pending.calls.len() == 1);
        }
        if side.call != NonZeroU64::new(id) {
            // Counted under the read side's lock: a call registering after it takes
            // reading back ([`Link::share_reading`]) once this lock is released.
            let alone = side.call.is_none()
                && side.direct
                && side.reader.is_some()
                && side.ended.is_none()
                && lone.unwrap_or_else(|| self.lock().calls.len() == 1);
            if !alone {
                return Poll::Pending;
            }
            side.call = NonZeroU64::new(id);
            *reading = true;
            // The last read left the socket's wake-up registered: nothing to read
            // until it comes (to this call from now on). Had it come to the task
            // already, the task takes reading back when it runs, and reads.
            self.read_wake.to_call(cx.waker());
            return Poll::Pending;
        }
        self.read_own(&mut side, id, reply, reading, cx)
    }

    /// [`Link::poll_reply`] for call `id`, the one reading for everyone.
    fn read_own(
        &self,
        side: &mut ReadSide,
        id: u64,
        reply: &CallReply,
        reading: &mut bool,
        cx: &mut Context<'_>,
    ) -> Poll<Received> {
        let mut mine = Mine { id, reply: None };
        loop {
            let ended = self.drive(side, Some(&mut mine));
            self.settle(side, ended);
            if mine.reply.is_some() || side.call != NonZeroU64::new(id) {
                break;
            }
            // Nothing for it yet: the socket's next wake-up goes to this poll's waker
            // (the last went to the one it registered before), and what came since
            // the read is read now.
            keep_waker(&mut self.read_wake.lock().call, cx.waker());
            if self.read_wake.wakes() == side.seen_wakes {
                break;
            }
        }
        let received = match mine.reply {
            Some(result) => Ok(result),
            None => std::task::ready!(self.poll_cell(id, reply, cx.waker())),
        };
        self.give_back(side, id);
        *reading = false;
        Poll::Ready(received)
    }

    /// Call `id`'s reply if it came to its cell (the link's own cell is then free),
    /// else keeps `waker` to be woken when it does.
    #[inline]
    fn poll_cell(&self, id: u64, reply: &CallReply, waker: &Waker) -> Poll<Received> {
        match reply {
            CallReply::Own => Self::poll_own(&mut self.lock(), id, waker),
            CallReply::Cell(reply) => reply.poll_cell(waker),
        }
    }

    /// [`Link::poll_cell`] for call `id`, waiting in the link's own cell (`pending`'s).
    #[inline]
    fn poll_own(pending: &mut Pending, id: u64, waker: &Waker) -> Poll<Received> {
        // Not after its reply, as the cell may be another call's by then.
        if pending.own_call != NonZeroU64::new(id) {
            return Poll::Ready(Err(ReplyDropped));
        }
        let polled = pending.own.poll_take(waker);
        if let Cell::Taken = pending.own.cell {
            // Free, waiting with nothing written, as the next call needs it.
            pending.own.cell = Held::waiting();
            pending.own_call = None;
        }
        polled
    }

    /// Another call waits now: the task reads for all of them. A call reading for
    /// everyone may be held unpolled while the others wait (a future polled once,
    /// then kept while the same task makes another call): their replies must not
    /// wait for it.
    fn share_reading(&self) {
        let mut side = self.lock_read();
        if side.call.take().is_none() {
            return;
        }
        // A wake-up since the last read went to that call: read what came now.
        if self.read_wake.to_task() != side.seen_wakes {
            let ended = self.drive(&mut side, None);
            self.settle(&mut side, ended);
        }
    }

    /// Call `id` no longer waits: if it was reading, the task reads from now on.
    fn stop_reading(&self, id: u64) {
        let mut side = self.lock_read();
        self.give_back(&mut side, id);
    }

    fn give_back(&self, side: &mut ReadSide, id: u64) {
        if side.call != NonZeroU64::new(id) {
            return;
        }
        side.call = None;
        // A wake-up since the call last read went to it, not the task: read what
        // came now (the socket's next wake-up goes to the task).
        if self.read_wake.to_task() != side.seen_wakes {
            let ended = self.drive(side, None);
            self.settle(side, ended);
        }
    }

    /// The task's turn at reading: it reads whenever it runs (a heartbeat's tick,
    /// a request handed over, the socket's wake-up before a call took reading
    /// over), a call reading for everyone giving way to it. So a wake-up the task
    /// had is never lost to a call that took reading over meanwhile, and silence
    /// is told from a caller that is not polled. Ready once the connection has ended.
    fn poll_task_read(&self, cx: &mut Context<'_>) -> Poll<Ended> {
        let mut side = self.lock_read();
        {
            let mut targets = self.read_wake.lock();
            keep_waker(&mut targets.task, cx.waker());
            let _ = self.read_wake.to_task();
        }
        side.call = None;
        if let Some(ended) = side.ended.take() {
            return Poll::Ready(*ended);
        }
        match self.drive(&mut side, None) {
            Some(ended) => Poll::Ready(ended),
            None => Poll::Pending,
        }
    }

    /// A read outside the task's own found the connection ended: the task must act on it.
    fn settle(&self, side: &mut ReadSide, ended: Option<Ended>) {
        let Some(ended) = ended else { return };
        #[cfg(test)]
        self.ends_found_by_calls.fetch_add(1, Ordering::Relaxed);
        side.ended = Some(Box::new(ended));
        side.call = None;
        let task = {
            let targets = self.read_wake.lock();
            let _ = self.read_wake.to_task();
            targets.task.clone()
        };
        if let Some(task) = task {
            task.wake();
        }
    }

    /// Hands the read half of a new connection over (`buffered`: what came after its welcome).
    fn start_reading(&self, reader: ReadHalf, buffered: BytesMut, epoch: u64) {
        let mut side = self.lock_read();
        side.direct = !matches!(reader, ReadHalf::Tls(_));
        side.reader = Some(reader);
        side.buf = buffered;
        side.epoch = epoch;
    }

    /// Drops the read half of the connection that ended, and what came on it.
    fn end_reading(&self) {
        let mut side = self.lock_read();
        side.reader = None;
        side.direct = false;
        side.call = None;
        side.ended = None;
        side.buf = BytesMut::new();
        side.files.clear();
        side.slabs.clear();
        let _ = self.read_wake.to_task();
        self.read_wake.lock().call = None;
    }

    /// Routes what was read, and reads the socket until it has nothing more (its
    /// next wake-up then comes through [`ReadWake`]); `me`: the call reading.
    /// `Some` once the connection has ended (nothing reads it again).
    fn drive(&self, side: &mut ReadSide, mut me: Option<&mut Mine>) -> Option<Ended> {
        if !side.buf.is_empty() {
            return self.read_and_route(side, me);
        }
        // Not reentrant (routing makes no read); the connection's own buffer serves
        // if it were, and while the thread exits.
        let warm = RECEIVED.try_with(|kept| {
            let mut warm = kept.try_borrow_mut().ok()?;
            std::mem::swap(&mut side.buf, &mut warm);
            let ended = self.read_and_route(side, me.take());
            std::mem::swap(&mut side.buf, &mut warm);
            // (A large buffer goes before the thread's next read.)
            if !warm.is_empty() {
                side.buf.extend_from_slice(&warm);
                warm.clear();
            }
            Some(ended)
        });
        match warm {
            Ok(Some(ended)) => ended,
            _ => self.read_and_route(side, me),
        }
    }

    /// [`Link::drive`], reading into the read side's buffer, whichever it holds.
    fn read_and_route(&self, side: &mut ReadSide, mut me: Option<&mut Mine>) -> Option<Ended> {
        let mut cx = Context::from_waker(&self.read_waker);
        let ended = loop {
            if let Err(ended) = self.route(side, me.as_deref_mut()) {
                break ended;
            }
            let ReadSide { reader: Some(reader), buf, files, .. } = side else { return None };
            Buffering::CLIENT.release_idle(buf);
            let room = read_room(buf);
            let wakes = self.read_wake.wakes();
            match reader.poll_read_with_files(&mut cx, buf, room, files) {
                Poll::Pending => {
                    side.seen_wakes = wakes;
                    return None;
                }
                Poll::Ready(Ok(0)) => break Ended::Cut("the coordinator closed the connection".to_owned()),
                Poll::Ready(Ok(_)) => {
                    self.reads.fetch_add(1, Ordering::Relaxed);
                }
                Poll::Ready(Err(error)) => break Ended::Cut(error.to_string()),
            }
        };
        side.reader = None;
        Some(ended)
    }

    /// Routes the frames read so far to their calls.
    fn route(&self, side: &mut ReadSide, mut me: Option<&mut Mine>) -> Result<(), Ended> {
        let broken = |why: String| Ended::Done(self.lost(why), None);
        let limits = FrameLimits::unbounded();
        let ReadSide { buf, files, slabs, releases, epoch, .. } = side;
        if buf.is_empty() {
            return Ok(());
        }
        loop {
            match decode_server_frame(buf, &limits) {
                Ok(None) => return Ok(()),
                Ok(Some(ServerFrame::Reply { id, reply })) => {
                    self.complete(id, reply.map_err(Error::Op), me.as_deref_mut())
                }
                Ok(Some(ServerFrame::SharedReply { id, slab, len })) => {
                    let map = match slabs.entry(slab) {
                        Entry::Occupied(known) => Arc::clone(known.get()),
                        Entry::Vacant(new) => {
                            let Some(file) = files.pop_front() else {
                                return Err(broken(format!("shared-memory slab {slab} came without its file")));
                            };
                            match shm::map_slab(file) {
                                Ok(map) => Arc::clone(new.insert(map)),
                                // Later replies from it could not be read either.
                                Err(error) => {
                                    return Err(broken(format!("cannot map shared-memory slab {slab}: {error}")))
                                }
                            }
                        }
                    };
                    let (releases, epoch) = (releases.clone(), *epoch);
                    let release = move || {
                        if let Some(commands) = releases.upgrade() {
                            let _ = commands.send(Command::Release { slab, epoch });
                        }
                    };
                    let reply = match shm::held_body(map, len, release) {
                        Ok(body) => decode_shared_reply(id, body).map_err(|error| Error::Protocol(error.to_string())),
                        Err(error) => Err(Error::Protocol(error.to_string())),
                    };
                    self.complete(id, reply.and_then(|reply| reply.map_err(Error::Op)), me.as_deref_mut());
                }
                Ok(Some(ServerFrame::BarrierChannel { id, channel, slot })) => {
                    if let Err(why) = self.channels.answered(id, channel, slot, files) {
                        return Err(broken(why));
                    }
                }
                Ok(Some(ServerFrame::NoBarrierChannel { id, reason })) => {
                    debug!(addr = %self.addr, %reason, "no barrier channel; the barrier goes through messages");
                    self.channels.refused(id);
                }
                Ok(Some(
                    ServerFrame::Welcome(_)
                    | ServerFrame::Refused(_)
                    | ServerFrame::AuthChallenge { .. }
                    | ServerFrame::AuthAccepted { .. },
                )) => {
                    return Err(broken("the coordinator sent a second handshake frame".to_owned()));
                }
                Err(ProtoError::BadReply { id: Some(id), message }) => {
                    self.complete(id, Err(Error::Protocol(message)), me.as_deref_mut())
                }
                Err(error) if !error.is_fatal() => debug!(addr = %self.addr, %error, "skipped a malformed frame"),
                Err(error) => return Err(broken(format!("malformed data: {error}"))),
            }
        }
    }
}

/// The call reading for everyone, and its own reply once read ([`Link::complete`]).
struct Mine {
    id: u64,
    reply: Option<Result<Response, Error>>,
}

/// A call's wait for its reply ([`Link::poll_reply`]); dropped before it, it gives
/// reading back to the task, and the link's own cell to the next call. Not to be
/// polled once ready: its call is gone (the map of calls, not its cell, says
/// whether a call lives), and it would wait for good.
pub(crate) struct WaitReply<'a> {
    link: &'a Link,
    id: u64,
    reply: CallReply,
    /// The call may be reading for everyone.
    reading: bool,
    /// Ready: the call took its reply, and its cell is done with.
    done: bool,
}

impl<'a> WaitReply<'a> {
    pub(crate) fn new(link: &'a Link, id: u64, reply: CallReply) -> Self {
        WaitReply { link, id, reply, reading: false, done: false }
    }
}

impl std::future::Future for WaitReply<'_> {
    type Output = Received;

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Received> {
        let this = self.get_mut();
        let polled = this.link.poll_reply(this.id, &this.reply, &mut this.reading, cx);
        this.done = polled.is_ready();
        polled
    }
}

impl Drop for WaitReply<'_> {
    fn drop(&mut self) {
        if self.reading {
            self.link.stop_reading(self.id);
        }
        // Dropped before its reply: the call is given up (the link's own cell freed).
        if !self.done {
            self.link.unregister(self.id);
        }
        if let CallReply::Cell(reply) = &self.reply {
            self.link.recycle(reply);
        }
    }
}

/// A connected, welcomed client connection, not yet handed to its task.
pub(crate) struct Connected {
    stream: Stream,
    /// Bytes read past the welcome.
    buffered: BytesMut,
    pub(crate) welcome: Welcome,
}

/// Connects and says hello, retrying with [`Backoff`] until
/// `timeout`: workers often start before their coordinator listens. A refusal is
/// the coordinator's answer and is returned at once.
///
/// `shared_replies`: on a Unix socket (a node agent of this machine), take large
/// replies as shared memory (docs/PROTOCOL.md, section 13). `credentials`: the
/// token to prove (and to have the coordinator prove), and TLS.
pub(crate) async fn connect(
    addr: &str,
    identity: &Identity,
    timeout: Duration,
    shared_replies: bool,
    credentials: &Credentials,
    failed: Option<&Mutex<Option<String>>>,
) -> Result<Connected, Error> {
    let started = Instant::now();
    let deadline = started + timeout;
    let mut backoff = Backoff::new();
    let mut attempts = 0u32;
    // The most telling failure so far, for the final error.
    let mut last = None;
    loop {
        attempts += 1;
        let reached = AtomicBool::new(false);
        match tokio::time::timeout_at(deadline, attempt(addr, identity, shared_replies, credentials, &reached)).await {
            Ok(Ok(connected)) => {
                debug!(addr, attempts, session = %connected.welcome.session, "connected to the coordinator");
                return Ok(connected);
            }
            Ok(Err(Attempt::Refused(OpError::Unauthorized(why)))) => {
                return Err(Error::Auth { addr: addr.to_owned(), failure: AuthFailure::Refused(why) })
            }
            Ok(Err(Attempt::Auth(failure))) => return Err(Error::Auth { addr: addr.to_owned(), failure }),
            Ok(Err(Attempt::Refused(error))) => return Err(Error::Op(error)),
            Ok(Err(Attempt::Protocol(message))) => {
                return Err(Error::Protocol(format!("the coordinator at {addr}: {message}")));
            }
            Ok(Err(Attempt::NotCoordinator(message))) => {
                let source = io::Error::new(io::ErrorKind::InvalidData, message);
                return Err(Error::Connect { addr: addr.to_owned(), waited: started.elapsed(), source });
            }
            Ok(Err(Attempt::Io(error))) => {
                debug!(addr, attempts, %error, "cannot reach the coordinator yet; retrying");
                if let Some(failed) = failed {
                    *lock(failed) = Some(error.to_string());
                }
                last = Some(error);
            }
            // The deadline passed mid-attempt: an earlier failure says more than this
            // one, unless this one got further.
            Err(_) => {
                if reached.load(Ordering::Relaxed) {
                    last = Some(io::Error::new(io::ErrorKind::TimedOut, SILENT_PEER));
                } else if last.is_none() {
                    last = Some(io::Error::new(io::ErrorKind::TimedOut, "no answer within the connect timeout"));
                }
            }
        }
        tokio::time::sleep_until((Instant::now() + backoff.next_pause()).min(deadline)).await;
        if Instant::now() >= deadline {
            let source = last.unwrap_or_else(|| io::Error::new(io::ErrorKind::TimedOut, "connect timeout elapsed"));
            return Err(Error::Connect { addr: addr.to_owned(), waited: started.elapsed(), source });
        }
    }
}

enum Attempt {
    /// Worth retrying: nothing listening yet, connection reset, closed early, ...
    Io(io::Error),
    Refused(OpError),
    Protocol(String),
    /// The token or TLS handshake failed: final.
    Auth(AuthFailure),
    /// Something else answers there (an SSH or HTTP server): final.
    NotCoordinator(String),
}

impl From<GreetError> for Attempt {
    fn from(error: GreetError) -> Self {
        match error {
            GreetError::Io(error) => Attempt::Io(error),
            GreetError::Auth(failure) => Attempt::Auth(failure),
            GreetError::NotCoordinator(message) => Attempt::NotCoordinator(message),
        }
    }
}

/// What a peer that took the connection and the hello but never answered most
/// likely is.
const SILENT_PEER: &str = "it accepted the connection but sent no welcome within the connect timeout: \
     is it a rallypoint coordinator? (torchrun's MASTER_ADDR:MASTER_PORT is torch's TCPStore, which is not: \
     give a coordinator's address in RALLYPOINT_ADDR)";

/// Largest frame read before the welcome: a welcome or a refusal is small, and a
/// peer that is not a coordinator (an SSH or HTTP server) sends text whose first four
/// bytes read as a length of hundreds of megabytes.
const WELCOME_FRAME_LIMIT: FrameLimits = FrameLimits { max_frame_len: 1 << 20 };

/// `reached`: set once the peer took the connection and the hello (for the error of
/// an attempt its deadline ends).
async fn attempt(
    addr: &str,
    identity: &Identity,
    shared_replies: bool,
    credentials: &Credentials,
    reached: &AtomicBool,
) -> Result<Connected, Attempt> {
    let mut hello = BytesMut::new();
    encode_client_frame(&ClientFrame::Hello(identity.clone()), &mut hello);
    // Only a node agent of this machine, over a Unix socket, can pass shared memory.
    if shared_replies && unix_path(addr).is_some() {
        encode_client_frame(&ClientFrame::TakeSharedReplies, &mut hello);
    }
    let (stream, answer, buffered) =
        greet(addr, credentials, &hello, |buf| match decode_server_frame(buf, &WELCOME_FRAME_LIMIT) {
            Ok(None) => {
                reached.store(true, Ordering::Relaxed);
                None
            }
            Ok(Some(ServerFrame::Welcome(welcome))) => Some(Ok(welcome)),
            Ok(Some(ServerFrame::Refused(error))) => Some(Err(Attempt::Refused(error))),
            Ok(Some(
                ServerFrame::Reply { id, .. }
                | ServerFrame::SharedReply { id, .. }
                | ServerFrame::BarrierChannel { id, .. }
                | ServerFrame::NoBarrierChannel { id, .. },
            )) => Some(Err(Attempt::Protocol(format!("sent a reply (request id {id}) before its welcome")))),
            Ok(Some(ServerFrame::AuthChallenge { .. } | ServerFrame::AuthAccepted { .. })) => {
                Some(Err(Attempt::Protocol("sent a token handshake frame nobody asked for".to_owned())))
            }
            Err(ProtoError::FrameTooLarge { .. }) => Some(Err(Attempt::NotCoordinator(not_a_coordinator(buf)))),
            Err(error) => Some(Err(Attempt::Protocol(error.to_string()))),
        })
        .await?;
    answer.map(|welcome| Connected { stream, buffered, welcome })
}

/// What the connection task needs to connect again after a cut.
pub(crate) struct Redial {
    pub(crate) identity: Identity,
    pub(crate) shared_replies: bool,
    /// The client's timeout: a cut connection is not tried again for longer.
    pub(crate) timeout: Duration,
    /// The token and TLS settings the first connection was made with.
    pub(crate) credentials: Credentials,
}

/// Starts the task that owns the connection; returns the handle calls send through.
pub(crate) fn spawn(addr: String, connected: Connected, redial: Redial) -> (Arc<Link>, mpsc::UnboundedSender<Command>) {
    let (commands, queue) = mpsc::unbounded_channel();
    // Weak: slab releases must not keep the connection open once every client is gone.
    let link = Arc::new(Link::new(addr, connected.welcome.clone(), commands.downgrade()));
    // A task of its own: polled beside the connection's, it would be polled at every
    // reply read, for a timer that rarely fires.
    let expiry = tokio::spawn({
        let link = Arc::clone(&link);
        async move { match expire_calls(&link).await {} }
    });
    let task = Arc::clone(&link);
    tokio::spawn(async move {
        // However the task ends (a panic, the runtime going away), its calls must not
        // wait for replies nobody will route, nor for a timer nobody runs.
        let _closing = CloseOnDrop(&task);
        let _expiry = AbortOnDrop(expiry.abort_handle());
        run(connected, queue, &task, redial).await;
    });
    (link, commands)
}

/// Stops a task when dropped: the one that fails calls past their deadline once the
/// connection task ends (the link fails the calls still waiting then), a channel's
/// bell listener once nothing uses the channel.
pub(crate) struct AbortOnDrop(pub(crate) tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Fails every waiting call when dropped (see [`spawn`]); a no-op once the link is
/// closed.
struct CloseOnDrop<'a>(&'a Link);

impl Drop for CloseOnDrop<'_> {
    fn drop(&mut self) {
        let why = format!("the connection task for the coordinator at {} ended", self.0.addr);
        // Whoever waits in a channel of it must learn so too (the connection is gone
        // with the task), and later calls must not use its channels.
        self.0.channels.connection_ended();
        self.0.close(Closed::Lost(why));
    }
}

/// Fails the calls whose timeout passed, with one timer for the connection rather
/// than one per call (set, and cancelled, on every request otherwise). Runs for the
/// task's whole life, reconnections included.
async fn expire_calls(link: &Link) -> Infallible {
    loop {
        let moved = link.deadline_moved.notified();
        let armed = link.lock().armed;
        match armed {
            Some(at) => {
                tokio::select! {
                    () = tokio::time::sleep_until(at) => link.expire(Instant::now()),
                    () = moved => {}
                }
            }
            None => moved.await,
        }
    }
}

/// How one connection ended.
enum Ended {
    /// Cut (an I/O error, the coordinator closed it, or silence): worth a resume.
    Cut(String),
    /// A write failed: cut too, but the coordinator may have answered before it
    /// closed (a request beyond its frame limit is answered so), and that answer is
    /// still to be read.
    WriteFailed(String),
    /// For good: shut down by the client, dropped, or the coordinator broke the protocol.
    Done(String, Option<oneshot::Sender<()>>),
}

/// How long a connection whose write failed is still read: the coordinator's last
/// words are in the socket already, or never come.
const DRAIN_AFTER_WRITE_FAILED: Duration = Duration::from_millis(200);

async fn run(mut connected: Connected, mut queue: mpsc::UnboundedReceiver<Command>, link: &Link, redial: Redial) {
    let lease = connected.welcome.lease_ms;
    let period = heartbeat_period(lease);
    let mut beat = period.map(|period| {
        let mut beat = tokio::time::interval_at(Instant::now() + period, period);
        beat.set_missed_tick_behavior(MissedTickBehavior::Delay);
        beat
    });
    let window = if lease > 0 { Duration::from_millis(lease) } else { RESUME_WINDOW_WITHOUT_LEASE }.min(redial.timeout);
    // Each connection's slabs are its own: releases name the connection.
    let mut epoch = 0u64;
    let mut resend = Vec::new();
    loop {
        let (reader, writer) = connected.stream.into_split();
        link.start_reading(reader, std::mem::take(&mut connected.buffered), epoch);
        // Reading and writing run concurrently, so a large write never stops replies
        // from being read (which could deadlock against a server doing the same).
        let mut reading = std::pin::pin!(read_loop(link));
        let ended = tokio::select! {
            why = &mut reading => why,
            ended = write_loop(writer, &mut queue, link, &mut beat, epoch, std::mem::take(&mut resend)) => ended,
        };
        let ended = match ended {
            // Read to the end, briefly: otherwise the call would only see the cut,
            // write its request again on the resumed session, and so on until its
            // timeout.
            Ended::WriteFailed(why) => match tokio::time::timeout(DRAIN_AFTER_WRITE_FAILED, reading).await {
                Ok(Ended::Done(why, done)) => Ended::Done(why, done),
                Ok(_) | Err(_) => Ended::Cut(why),
            },
            ended => ended,
        };
        // The write half goes with its connection: calls hand their requests to the
        // task until the next one is up. Bytes a call left for it are moot.
        *link.lock_direct() = Direct::default();
        link.end_reading();
        if matches!(ended, Ended::Cut(_) | Ended::WriteFailed(_)) {
            link.adopt_channel_calls();
        }
        link.channels.connection_ended();
        let why = match ended {
            Ended::Done(why, done) => {
                debug!(addr = %link.addr, %why, "connection task ended");
                // Both socket halves are dropped here, before waiting calls learn of it.
                link.close(Closed::Lost(why));
                if let Some(done) = done {
                    let _ = done.send(());
                }
                return;
            }
            Ended::Cut(why) | Ended::WriteFailed(why) => why,
        };
        debug!(addr = %link.addr, %why, "connection cut; resuming the session");
        match reconnect(link, &redial, window, &why).await {
            Ok((again, unanswered)) => {
                connected = again;
                resend = unanswered;
                epoch += 1;
            }
            Err(closed) => {
                debug!(addr = %link.addr, %why, "cannot resume; connection task ended");
                link.close(closed);
                return;
            }
        }
    }
}

/// The heartbeat period under a lease of `lease_ms` (none without a lease): a third
/// of the lease, so that two may be lost before it expires.
pub(crate) fn heartbeat_period(lease_ms: u64) -> Option<Duration> {
    (lease_ms > 0).then(|| Duration::from_millis((lease_ms / 3).max(1)))
}

/// Connects again after a cut (`why`), resuming the session if the coordinator still
/// has it; returns the new connection and the requests to send again on it.
async fn reconnect(
    link: &Link,
    redial: &Redial,
    window: Duration,
    why: &str,
) -> Result<(Connected, Vec<(u64, Written)>), Closed> {
    let token = link.welcome().session;
    let identity = Identity { resume: Some(token), ..redial.identity.clone() };
    let deadline = Instant::now() + window;
    let mut backoff = Backoff::new();
    loop {
        let reached = AtomicBool::new(false);
        let attempt = attempt(&link.addr, &identity, redial.shared_replies, &redial.credentials, &reached);
        match tokio::time::timeout_at(deadline, attempt).await {
            Ok(Ok(connected)) => {
                let resumed = connected.welcome.session == token;
                link.set_welcome(connected.welcome.clone());
                if resumed {
                    info!(addr = %link.addr, session = %token, "resumed the session after a cut connection ({why})");
                    return Ok((connected, link.unanswered()));
                }
                let lost = format!(
                    "{}; the coordinator no longer had {token} (its reconnect grace ran out, or it restarted), so \
                     whether this call took effect is unknown",
                    link.lost(why)
                );
                info!(addr = %link.addr, old = %token, session = %connected.welcome.session, "reconnected as a new session after a cut connection ({why})");
                link.fail_written(&lost);
                return Ok((connected, Vec::new()));
            }
            Ok(Err(Attempt::Refused(error))) => return Err(Closed::Refused(error)),
            Ok(Err(Attempt::Protocol(message) | Attempt::NotCoordinator(message))) => {
                return Err(Closed::Lost(link.lost(format!("{why}; {message}"))))
            }
            Ok(Err(Attempt::Auth(failure))) => {
                return Err(Closed::Lost(link.lost(format!("{why}; connecting again failed: {failure}"))))
            }
            // Nothing listens there any more: the coordinator is gone, not a path.
            Ok(Err(Attempt::Io(error)))
                if matches!(error.kind(), io::ErrorKind::ConnectionRefused | io::ErrorKind::NotFound) =>
            {
                let gone = format!("{why}; connecting again failed at once ({error}): the coordinator is gone");
                return Err(Closed::Lost(link.lost(gone)));
            }
            Ok(Err(Attempt::Io(_))) | Err(_) => {}
        }
        if Instant::now() >= deadline {
            return Err(Closed::Lost(link.lost(format!("{why}; could not reconnect within {window:?}"))));
        }
        tokio::time::sleep_until((Instant::now() + backoff.next_pause()).min(deadline)).await;
    }
}

/// Reads replies and routes them to their calls when no call does
/// ([`Link::poll_reply`]); returns how the connection ended.
async fn read_loop(link: &Link) -> Ended {
    std::future::poll_fn(|cx| link.poll_task_read(cx)).await
}

/// Room to make in the read buffer before the next read: the rest of the reply
/// being received when its length is known (up to [`MAX_RESERVE`]), at least a
/// client's read chunk. An all-gather reply is world size × value size: reserving a
/// little per read would regrow the buffer, copying all it holds, again and again.
fn read_room(buf: &[u8]) -> usize {
    let missing = pending_frame_len(buf).map_or(0, |len| len.saturating_sub(buf.len()));
    missing.clamp(Buffering::CLIENT.chunk, MAX_RESERVE)
}

/// Writes `resend` (the requests a cut left unanswered, on a resumed session), then
/// requests and heartbeats; returns how the connection ended, and whom to tell once
/// it is fully closed if that was asked for. Between its writes, calls write their
/// requests themselves ([`Direct`]).
async fn write_loop(
    writer: WriteHalf,
    queue: &mut mpsc::UnboundedReceiver<Command>,
    link: &Link,
    beat: &mut Option<Interval>,
    epoch: u64,
    resend: Vec<(u64, Written)>,
) -> Ended {
    let mut writer = Arc::new(writer);
    if let Some(sender) = Sender::new(&writer) {
        link.lock_direct().writer = Some(sender);
    }
    let mut buf = BytesMut::new();
    for (id, request) in resend {
        request.encode(id, &mut buf);
    }
    let mut written = Vec::new();
    // Reads from the coordinator at the last tick, and the last tick that found more.
    let (mut reads, mut heard) = (link.reads.load(Ordering::Relaxed), Instant::now());
    loop {
        let mut shutdown = None;
        if buf.is_empty() {
            tokio::select! {
                command = queue.recv() => {
                    let Some(command) = command else {
                        // Every client handle is gone without close(): the session ends as a
                        // killed process's would. Said first, so that the coordinator does
                        // not hold the rank for a resume that will not come.
                        abandon(&mut writer, link, &mut buf).await;
                        return Ended::Done(format!("the client for the coordinator at {} was dropped", link.addr), None);
                    };
                    if let Command::Abandon(done) = command {
                        abandon(&mut writer, link, &mut buf).await;
                        shut_down(&mut writer, link).await;
                        return Ended::Done(format!("the client for the coordinator at {} was dropped", link.addr), Some(done));
                    }
                    let mut gathered = 0;
                    shutdown = gather(command, queue, &mut buf, &mut written, &mut gathered, epoch);
                    // Callers woken by the last replies that have not sent their next
                    // request yet: let them run first, so that their requests share this
                    // write instead of costing one system call each.
                    let woken = link.delivered.swap(0, Ordering::Relaxed);
                    if shutdown.is_none() && woken > gathered && buf.len() < MAX_WRITE_BATCH {
                        yield_to_ready_tasks().await;
                        if let Ok(command) = queue.try_recv() {
                            shutdown = gather(command, queue, &mut buf, &mut written, &mut gathered, epoch);
                        }
                    }
                    link.written(&buf, std::mem::take(&mut written));
                }
                (at, period) = tick(beat) => {
                    let count = link.reads.load(Ordering::Relaxed);
                    let answered = count != reads;
                    (reads, heard) = (count, heard_at(heard, answered, at, Instant::now(), period));
                    // Counted in time, not ticks: a skipped heartbeat moves the next tick.
                    if at.duration_since(heard) >= period * SILENT_BEATS {
                        return Ended::Cut(format!("nothing from the coordinator for {SILENT_BEATS} heartbeat periods"));
                    }
                    match (beat.as_mut(), next_beat(period, answered, link.last_call(), at)) {
                        (Some(beat), Some(due)) => beat.reset_at(due),
                        _ => {
                            let request = Request::Heartbeat;
                            encode_client_frame(&ClientFrame::Request { id: link.next_id(), request }, &mut buf);
                        }
                    }
                }
            }
        }
        // The end of a frame a call wrote in part goes first; calls hand their
        // requests over while this writes.
        let rest = {
            let mut direct = link.lock_direct();
            let writes = !buf.is_empty() || !direct.rest.is_empty();
            direct.busy |= writes;
            writes.then(|| std::mem::take(&mut *direct.rest))
        };
        if let Some(rest) = rest {
            let wrote = async {
                if !rest.is_empty() {
                    writer.write_locked(&rest).await?;
                }
                if !buf.is_empty() {
                    // Flushed: TLS holds what it encrypted until then.
                    writer.write_locked(&buf).await?;
                }
                Ok::<(), io::Error>(())
            }
            .await;
            if let Err(error) = wrote {
                return Ended::WriteFailed(error.to_string());
            }
            link.lock_direct().busy = false;
            buf.clear();
            Buffering::CLIENT.release_idle(&mut buf);
        }
        if let Some(done) = shutdown {
            shut_down(&mut writer, link).await;
            return Ended::Done(format!("the client for the coordinator at {} was closed", link.addr), Some(done));
        }
    }
}

/// Takes the write half back from the calls: they hand their requests to the task
/// from now on. Returns the end of a frame a call wrote in part, to write first.
fn take_writer(link: &Link) -> BytesMut {
    let mut direct = link.lock_direct();
    direct.writer = None;
    std::mem::take(&mut *direct.rest)
}

/// Shuts the write half down (a FIN, or TLS's close_notify) after what calls left.
async fn shut_down(writer: &mut Arc<WriteHalf>, link: &Link) {
    let rest = take_writer(link);
    if !rest.is_empty() {
        let _ = writer.write_locked(&rest).await;
    }
    // The task's is the only handle left: calls use theirs only under their lock.
    if let Some(writer) = Arc::get_mut(writer) {
        let _ = writer.shutdown().await;
    }
}

/// Writes an Abandon request (whatever `buf` holds is written with it). Calls can
/// no longer write afterwards.
async fn abandon(writer: &mut Arc<WriteHalf>, link: &Link, buf: &mut BytesMut) {
    let rest = take_writer(link);
    encode_client_frame(&ClientFrame::Request { id: link.next_id(), request: Request::Abandon }, buf);
    if !rest.is_empty() {
        let _ = writer.write_locked(&rest).await;
    }
    let _ = writer.write_locked(buf).await;
    buf.clear();
}

/// Encodes `first` and whatever else is queued (up to [`MAX_WRITE_BATCH`]) into
/// `buf`, counting requests in `gathered` and keeping them in `written`; stops at a
/// shutdown and returns it. Releases of another connection's slabs are dropped.
fn gather(
    first: Command,
    queue: &mut mpsc::UnboundedReceiver<Command>,
    buf: &mut BytesMut,
    written: &mut Vec<(u64, Option<Range<usize>>, Request)>,
    gathered: &mut usize,
    epoch: u64,
) -> Option<oneshot::Sender<()>> {
    let mut next = Some(first);
    while let Some(command) = next.take() {
        match command {
            Command::Request { id, request } => {
                let start = buf.len();
                encode_request_frame(id, &request, buf);
                written.push((id, Some(start..buf.len()), request));
                *gathered += 1;
            }
            Command::AttachBarrier { id, request, epoch: of } => {
                // Asked on a connection that ended, it goes as the plain request it
                // also is: its call counts on no answer on this one.
                let frame = if of == epoch {
                    ClientFrame::AttachBarrier { id, request }
                } else {
                    ClientFrame::Request { id, request }
                };
                encode_client_frame(&frame, buf);
                // Sent again after a cut as the plain request it also is.
                if let ClientFrame::AttachBarrier { id, request } | ClientFrame::Request { id, request } = frame {
                    written.push((id, None, request));
                }
                *gathered += 1;
            }
            Command::Release { slab, epoch: of } if of == epoch => {
                encode_client_frame(&ClientFrame::ReleaseShared { slab }, buf)
            }
            Command::Release { .. } => {}
            Command::LeaveChannel { channel, slot, epoch: of } if of == epoch => {
                encode_client_frame(&ClientFrame::LeaveBarrierChannel { channel, slot }, buf)
            }
            // The slot went with its connection.
            Command::LeaveChannel { .. } => {}
            Command::Shutdown(done) => return Some(done),
            // Dropping a client while another of its clones is mid-call: the call fails.
            Command::Abandon(done) => return Some(done),
            // The task writes what the call left in `Direct` before its next write.
            Command::Flush => {}
        }
        if buf.len() < MAX_WRITE_BATCH {
            next = queue.try_recv().ok();
        }
    }
    None
}

/// Lets the tasks already waiting to run go first, once. Unlike
/// `tokio::task::yield_now`, it does not wait for the runtime to poll for I/O:
/// a task that wakes itself is put at the back of the run queue at once.
async fn yield_to_ready_tasks() {
    let mut yielded = false;
    std::future::poll_fn(|cx| {
        if yielded {
            return Poll::Ready(());
        }
        yielded = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    })
    .await
}

/// At a heartbeat's tick `now`: `None` if it must go, else when the next one is due
/// instead. It is skipped while calls go out and replies come back (`answered`:
/// something came since the last tick): a call is as good a sign of life as a
/// heartbeat, so the next one is due a `period` after the latest call (`last_call`),
/// which keeps the lease's margin. Without replies, heartbeats go as ever: they are
/// how silence is told from calls the coordinator holds (a barrier, a wait for a key).
fn next_beat(period: Duration, answered: bool, last_call: Option<Instant>, now: Instant) -> Option<Instant> {
    let due = last_call? + period;
    (answered && due > now).then_some(due)
}

/// When the coordinator was last heard from, seen at a heartbeat tick due `at` that
/// ran at `now`. A tick that ran more than a period late means that this process did
/// not run meanwhile (stopped, or starved of CPU), not that the coordinator went
/// quiet: what it sent meanwhile is still unread, so it counts as heard now.
fn heard_at(heard: Instant, answered: bool, at: Instant, now: Instant, period: Duration) -> Instant {
    if answered {
        at
    } else if now.saturating_duration_since(at) > period {
        now
    } else {
        heard
    }
}

/// The next heartbeat's tick: when it was due, and the heartbeat period. Never, for
/// a coordinator without leases.
async fn tick(beat: &mut Option<Interval>) -> (Instant, Duration) {
    match beat {
        Some(beat) => (beat.tick().await, beat.period()),
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests;
