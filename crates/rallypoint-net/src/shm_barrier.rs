//! Barriers through shared memory between a node agent and the ranks of its node
//! (docs/PROTOCOL.md, section 15): the layout of a barrier *channel* and the atomic
//! operations each side makes on it.
//!
//! Over sockets, a barrier of the n ranks of a node costs n messages up to the
//! agent and n releases back, each a system call on both sides and a wake-up of the
//! agent. A channel replaces them: a memory file the agent makes for one barrier
//! call of its ranks (same job, name, members and timeout), with a header and one
//! slot per rank that attached to it. A rank arrives by counting itself in the
//! header and writing its request id and round into its slot; the arrival that
//! completes the count (and the first one since the agent last looked) rings the
//! agent's doorbell, an eventfd. The agent forwards the node's arrivals to the
//! coordinator as one frame; when the coordinator releases them, it writes each
//! slot's outcome and wakes every waiting rank at once with one futex wake on the
//! header's release word, and rings the channel's *release bell* (a second eventfd)
//! when a rank that cannot block a thread on the futex (an async task) sleeps in
//! its event loop instead. A failure is marked in the slot; its typed error travels
//! on the rank's socket as the reply to the rank's request id, as without a channel.
//!
//! The counts only decide *when* the agent looks; *what* it forwards is what the
//! slots say, so a count that runs ahead (a rank killed between counting itself and
//! writing its slot) costs at most an early look, never a lost or invented arrival.
//! The orderings, and why each is needed, are in docs/PROTOCOL.md, section 15; the
//! `loom` model at the end of this file checks them (`RUSTFLAGS="--cfg
//! rallypoint_loom" cargo test -p rallypoint-net --release --lib shm_barrier`).

mod atomic {
    #[cfg(all(test, rallypoint_loom))]
    pub(crate) use loom::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
    #[cfg(not(all(test, rallypoint_loom)))]
    pub(crate) use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
}

use atomic::{fence, AtomicU32, AtomicU64, Ordering};

/// What a slot's last finished round came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Released: every member arrived.
    Released,
    /// Failed: the error is the reply to the rank's request id on its socket.
    Failed,
}

impl Outcome {
    fn word(self) -> u32 {
        match self {
            Outcome::Released => 0,
            Outcome::Failed => 1,
        }
    }

    fn of(word: u32) -> Outcome {
        if word == 0 {
            Outcome::Released
        } else {
            Outcome::Failed
        }
    }
}

/// The atomic words of one slot.
pub(crate) struct SlotCells<'a> {
    /// The round the rank arrived at last (written by the rank).
    pub(crate) arrived: &'a AtomicU32,
    /// The request id of that arrival (written by the rank before `arrived`).
    pub(crate) call: &'a AtomicU64,
    /// The last round the agent finished for this slot (written by the agent).
    pub(crate) done: &'a AtomicU32,
    /// How round `done` ended ([`Outcome`]; written by the agent before `done`).
    pub(crate) outcome: &'a AtomicU32,
}

/// Where a channel's words are: in a mapped file, or (in the model) in plain memory.
pub(crate) trait Cells {
    /// Arrivals counted and not yet taken by the agent.
    fn pending(&self) -> &AtomicU32;
    /// When `pending` reaches this, every attached rank has arrived (the agent keeps it up to date).
    fn expect(&self) -> &AtomicU32;
    /// Bumped by the agent after finishing rounds: the word ranks wait on.
    fn release(&self) -> &AtomicU32;
    /// Ranks asleep in an event loop, woken by the release bell, not the futex.
    fn bell_sleepers(&self) -> &AtomicU32;
    fn slot(&self, slot: u32) -> SlotCells<'_>;
}

/// A rank arrives at `round` of its slot with request `call`. Returns whether it
/// must ring the agent's doorbell: it is the first arrival since the agent last
/// took any, or the count says every attached rank has arrived.
pub(crate) fn arrive(cells: &impl Cells, slot: u32, round: u32, call: u64) -> bool {
    let s = cells.slot(slot);
    // Counted before it is written: the agent may see a count before the slot (it
    // then looks again), never a slot it has not counted (which would make the
    // count fall behind and an arrival go unannounced).
    let n = cells.pending().fetch_add(1, Ordering::SeqCst).wrapping_add(1);
    s.call.store(call, Ordering::Relaxed);
    // Release: publishes `call` with the round.
    s.arrived.store(round, Ordering::Release);
    // SeqCst with the count above, against the agent's store of `expect` and its
    // load of the count (`set_expect`): either this sees the new expectation or
    // the agent sees this arrival counted.
    let expect = cells.expect().load(Ordering::SeqCst);
    n == 1 || n >= expect
}

/// The agent: slot `slot`'s arrival newer than `seen`, if any: (round, request id).
pub(crate) fn arrival(cells: &impl Cells, slot: u32, seen: u32) -> Option<(u32, u64)> {
    let s = cells.slot(slot);
    // Acquire: pairs with the rank's Release store, so `call` is that arrival's.
    let round = s.arrived.load(Ordering::Acquire);
    (round != seen).then(|| (round, s.call.load(Ordering::Relaxed)))
}

/// The agent took `taken` arrivals, and every attached rank will have arrived when
/// the count reaches `expect`. Returns the count left: arrivals counted that the
/// agent could not see yet (it looks again shortly while this is not 0).
pub(crate) fn took(cells: &impl Cells, taken: u32, expect: u32) -> u32 {
    cells.expect().store(expect, Ordering::SeqCst);
    cells.pending().fetch_sub(taken, Ordering::SeqCst).wrapping_sub(taken)
}

/// The agent finishes `round` of `slot` with `outcome`; the ranks learn of it at
/// the next [`publish`].
pub(crate) fn finish(cells: &impl Cells, slot: u32, round: u32, outcome: Outcome) {
    let s = cells.slot(slot);
    s.outcome.store(outcome.word(), Ordering::Relaxed);
    // Release: a rank that sees the round done sees its outcome.
    s.done.store(round, Ordering::Release);
}

/// The agent publishes the rounds finished since the last call; the caller then
/// wakes the waiters (a futex wake of all on the release word) and, if this returns
/// true, rings the release bell: a rank sleeps on it ([`sleep_on_bell`]).
pub(crate) fn publish(cells: &impl Cells) -> bool {
    // Release: a rank that reads the new value sees every `finish` before it.
    cells.release().fetch_add(1, Ordering::Release);
    // Against the rank's fence in `sleep_on_bell`: either it sees the rounds
    // finished, or this sees it counted and rings.
    fence(Ordering::SeqCst);
    cells.bell_sleepers().load(Ordering::Relaxed) > 0
}

/// A rank is about to sleep on the release bell rather than the futex: counted
/// before it looks at its slot for the last time, so that a release it does not
/// see rings the bell ([`publish`]). Undone by [`woke_from_bell`].
pub(crate) fn sleep_on_bell(cells: &impl Cells) {
    cells.bell_sleepers().fetch_add(1, Ordering::Relaxed);
    fence(Ordering::SeqCst);
}

/// A rank counted by [`sleep_on_bell`] no longer sleeps.
pub(crate) fn woke_from_bell(cells: &impl Cells) {
    cells.bell_sleepers().fetch_sub(1, Ordering::Relaxed);
}

/// A rank: the release word to wait on (read before looking at the slot, so that
/// a release between the two makes the wait return at once).
pub(crate) fn release_word(cells: &impl Cells) -> u32 {
    cells.release().load(Ordering::Acquire)
}

/// A rank: how `round` of its slot ended, if it has.
pub(crate) fn outcome(cells: &impl Cells, slot: u32, round: u32) -> Option<Outcome> {
    let s = cells.slot(slot);
    (s.done.load(Ordering::Acquire) == round).then(|| Outcome::of(s.outcome.load(Ordering::Relaxed)))
}

#[cfg(not(all(test, rallypoint_loom)))]
pub use mapped::*;

#[cfg(not(all(test, rallypoint_loom)))]
mod mapped {
    use std::fs::File;
    use std::io;
    use std::os::fd::{AsFd, OwnedFd};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use memmap2::MmapMut;
    use rustix::event::EventfdFlags;
    use rustix::fs::{MemfdFlags, SealFlags};
    use rustix::thread::futex;

    use super::atomic::{AtomicU32, AtomicU64, Ordering};
    use super::{Cells, Outcome, SlotCells};

    /// Identifies a channel file: `RPBC`.
    const MAGIC: u32 = u32::from_le_bytes(*b"RPBC");
    /// The layout's version.
    const VERSION: u32 = 1;
    /// Header bytes: four cache lines (identification; the count and the expected
    /// count, which every arrival reads; the release word; spare), so that what the
    /// ranks hammer and what they wait on do not share a line.
    const HEADER: usize = 256;
    /// Bytes per slot: a cache line, so that ranks arriving at once write apart.
    const SLOT: usize = 64;
    const PENDING: usize = 64;
    const EXPECT: usize = 68;
    const RELEASE: usize = 128;
    const ATTACHED: usize = 132;
    const BELL_SLEEPERS: usize = 136;
    /// Slots per channel at most: a node with more ranks at one barrier uses more channels.
    pub const MAX_SLOTS: u32 = 4096;

    /// The same seals as a reply slab (module `shm`): no mapped page can vanish.
    const SEALS: SealFlags = SealFlags::SHRINK.union(SealFlags::GROW).union(SealFlags::SEAL);

    /// A channel's words in a mapping of its file.
    struct Words {
        map: MmapMut,
        slots: u32,
    }

    impl Words {
        fn u32_at(&self, offset: usize) -> &AtomicU32 {
            debug_assert!(offset + 4 <= self.map.len() && offset.is_multiple_of(4));
            // SAFETY: in bounds and aligned (the mapping is page-aligned, offsets are
            // multiples of 4); the bytes are shared memory only ever accessed
            // atomically by every process that maps them.
            unsafe { &*self.map.as_ptr().add(offset).cast::<AtomicU32>() }
        }

        fn u64_at(&self, offset: usize) -> &AtomicU64 {
            debug_assert!(offset + 8 <= self.map.len() && offset.is_multiple_of(8));
            // SAFETY: as `u32_at`, 8-byte aligned.
            unsafe { &*self.map.as_ptr().add(offset).cast::<AtomicU64>() }
        }

        fn slot_offset(&self, slot: u32) -> usize {
            assert!(slot < self.slots, "slot {slot} of a channel of {}", self.slots);
            HEADER + slot as usize * SLOT
        }
    }

    impl Cells for Words {
        fn pending(&self) -> &AtomicU32 {
            self.u32_at(PENDING)
        }
        fn expect(&self) -> &AtomicU32 {
            self.u32_at(EXPECT)
        }
        fn release(&self) -> &AtomicU32 {
            self.u32_at(RELEASE)
        }
        fn bell_sleepers(&self) -> &AtomicU32 {
            self.u32_at(BELL_SLEEPERS)
        }
        fn slot(&self, slot: u32) -> SlotCells<'_> {
            let at = self.slot_offset(slot);
            SlotCells {
                arrived: self.u32_at(at),
                done: self.u32_at(at + 4),
                outcome: self.u32_at(at + 8),
                call: self.u64_at(at + 16),
            }
        }
    }

    fn file_len(slots: u32) -> usize {
        HEADER + slots as usize * SLOT
    }

    /// A channel as its agent holds it: the memory file, the doorbell and the
    /// release bell to pass to the ranks, and the file mapped.
    pub struct AgentChannel {
        pub file: Arc<OwnedFd>,
        pub doorbell: Arc<OwnedFd>,
        pub bell: Arc<OwnedFd>,
        words: Words,
    }

    impl AgentChannel {
        /// A channel of `slots` slots (at most [`MAX_SLOTS`]), every slot idle and
        /// nothing expected yet.
        pub fn create(slots: u32) -> io::Result<AgentChannel> {
            let slots = slots.clamp(1, MAX_SLOTS);
            let fd = rustix::fs::memfd_create("rallypoint-barrier", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
            rustix::fs::ftruncate(&fd, file_len(slots) as u64)?;
            let file = File::from(fd);
            // SAFETY: a fresh memory file of this process, sealed below so that it
            // keeps its size; every access to it is atomic.
            let map = unsafe { MmapMut::map_mut(&file)? };
            let file = OwnedFd::from(file);
            rustix::fs::fcntl_add_seals(&file, SEALS)?;
            let doorbell = rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?;
            let bell = rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?;
            let words = Words { map, slots };
            words.u32_at(0).store(MAGIC, Ordering::Relaxed);
            words.u32_at(4).store(VERSION, Ordering::Relaxed);
            words.u32_at(8).store(slots, Ordering::Relaxed);
            words.expect().store(u32::MAX, Ordering::SeqCst);
            Ok(AgentChannel { file: Arc::new(file), doorbell: Arc::new(doorbell), bell: Arc::new(bell), words })
        }

        pub fn slots(&self) -> u32 {
            self.words.slots
        }

        /// Readies `slot` for a new rank: no round arrived, none finished.
        pub fn reset_slot(&self, slot: u32) {
            let s = self.words.slot(slot);
            s.arrived.store(0, Ordering::Relaxed);
            s.call.store(0, Ordering::Relaxed);
            s.outcome.store(0, Ordering::Relaxed);
            s.done.store(0, Ordering::Release);
        }

        /// Tells the ranks how many slots are in use (they spin longer when few are).
        pub fn set_attached(&self, attached: u32) {
            self.words.u32_at(ATTACHED).store(attached, Ordering::Relaxed);
        }

        /// See [`super::arrival`].
        pub fn arrival(&self, slot: u32, seen: u32) -> Option<(u32, u64)> {
            super::arrival(&self.words, slot, seen)
        }

        /// See [`super::took`].
        pub fn took(&self, taken: u32, expect: u32) -> u32 {
            super::took(&self.words, taken, expect)
        }

        /// See [`super::finish`].
        pub fn finish(&self, slot: u32, round: u32, outcome: Outcome) {
            super::finish(&self.words, slot, round, outcome)
        }

        /// Publishes every round finished since the last call and wakes every rank
        /// waiting on the channel: one futex wake of all, and one ring of the release
        /// bell if a rank sleeps on it.
        pub fn release(&self) {
            publish_and_wake(&self.words, Some(&self.bell));
        }

        /// Ranks asleep on the release bell now (async tasks waiting for a release).
        pub fn bell_sleepers(&self) -> u32 {
            self.words.bell_sleepers().load(Ordering::SeqCst)
        }

        /// Every attached rank has counted its arrival (or the count ran ahead, see
        /// the module's header): taking the arrivals now forwards the whole node.
        pub fn all_counted(&self) -> bool {
            self.words.pending().load(Ordering::SeqCst) >= self.words.expect().load(Ordering::SeqCst)
        }

        /// Empties the doorbell (nonblocking); true if it had rung.
        pub fn drain_doorbell(&self) -> bool {
            let mut buf = [0u8; 8];
            matches!(rustix::io::read(self.doorbell.as_fd(), &mut buf), Ok(8))
        }
    }

    /// A channel as a rank maps it: read-write (a rank writes its slot and the count).
    pub struct RankChannel {
        words: Words,
        doorbell: OwnedFd,
        /// `None`: this mapping neither listens to the bell nor rings it (a process
        /// with many mappings of one channel keeps the bell with one of them).
        bell: Option<OwnedFd>,
    }

    /// A rank counted among those asleep on the release bell ([`RankChannel::sleep_on_bell`])
    /// until this is dropped.
    pub struct BellSleep<'a>(&'a RankChannel);

    impl Drop for BellSleep<'_> {
        fn drop(&mut self) {
            super::woke_from_bell(&self.0.words);
        }
    }

    /// When a rank's wait for a round gives up.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Until {
        /// At this instant.
        Deadline(Instant),
        /// This long after the wait first reads the clock (which it does anyway):
        /// a caller without a deadline yet need not read the clock for one.
        Within(Duration),
    }

    /// How a rank's wait for a round ended.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Waited {
        /// The round ended so.
        Ended(Outcome),
        /// `stop` said to stop (the connection ended, the call was answered on the socket).
        Stopped,
        /// The deadline passed first.
        TimedOut,
    }

    impl RankChannel {
        /// Maps a channel's file (checked: sealed, of the layout this code knows,
        /// as large as it says) with its doorbell and, if this mapping listens to it,
        /// its release bell.
        pub fn map(file: OwnedFd, doorbell: OwnedFd, bell: Option<OwnedFd>) -> io::Result<RankChannel> {
            let invalid = |message: String| io::Error::new(io::ErrorKind::InvalidData, message);
            let seals = rustix::fs::fcntl_get_seals(&file)?;
            if !seals.contains(SealFlags::SHRINK) {
                return Err(invalid(format!("a barrier channel is not sealed against shrinking ({seals:?})")));
            }
            let file = File::from(file);
            let len = file.metadata()?.len();
            if len < HEADER as u64 {
                return Err(invalid(format!("a barrier channel of {len} bytes")));
            }
            // SAFETY: the file cannot shrink (checked above), so no mapped page can
            // vanish; every access to it is atomic.
            let map = unsafe { MmapMut::map_mut(&file)? };
            let probe = Words { map, slots: 0 };
            let (magic, version, slots) = (
                probe.u32_at(0).load(Ordering::Relaxed),
                probe.u32_at(4).load(Ordering::Relaxed),
                probe.u32_at(8).load(Ordering::Relaxed),
            );
            if magic != MAGIC || version != VERSION {
                return Err(invalid(format!(
                    "not a barrier channel of version {VERSION} (magic {magic:#x}, version {version})"
                )));
            }
            if slots > MAX_SLOTS || (file_len(slots) as u64) > len {
                return Err(invalid(format!("a barrier channel of {len} bytes claims {slots} slots")));
            }
            let words = Words { map: probe.map, slots };
            Ok(RankChannel { words, doorbell, bell })
        }

        pub fn slots(&self) -> u32 {
            self.words.slots
        }

        /// Arrives at `round` of `slot` with request `call`, ringing the agent's
        /// doorbell if this arrival must (see [`super::arrive`]).
        pub fn arrive(&self, slot: u32, round: u32, call: u64) {
            if super::arrive(&self.words, slot, round, call) {
                // A full doorbell (it counts to 2^64 - 2) has rung already.
                let _ = rustix::io::write(self.doorbell.as_fd(), &1u64.to_ne_bytes());
            }
        }

        /// How `round` of `slot` ended, if it has.
        pub fn outcome(&self, slot: u32, round: u32) -> Option<Outcome> {
            super::outcome(&self.words, slot, round)
        }

        /// Waits until `round` of `slot` ends, `stop` returns true, or `deadline`
        /// passes: a bounded spin first (longer when few ranks share the channel,
        /// as on a node with cores to spare), then futex waits on the release word.
        pub fn wait(&self, slot: u32, round: u32, deadline: Instant, stop: impl Fn() -> bool) -> Waited {
            self.wait_until(slot, round, Until::Deadline(deadline), stop).0
        }

        /// [`RankChannel::wait`], giving up as `until` says. Also returns the
        /// deadline it kept: `None` if the round ended before it read the clock.
        pub fn wait_until(
            &self,
            slot: u32,
            round: u32,
            until: Until,
            stop: impl Fn() -> bool,
        ) -> (Waited, Option<Instant>) {
            // Slots in use: few means spinning pays. (No spin, no clock read for it.)
            let spin = spin_budget(self.words.u32_at(ATTACHED).load(Ordering::Relaxed));
            let spun = (!spin.is_zero()).then(Instant::now);
            let mut deadline = match until {
                Until::Deadline(at) => Some(at),
                Until::Within(limit) => spun.map(|spun| spun + limit),
            };
            let mut tries = 0u32;
            loop {
                let seen = super::release_word(&self.words);
                if let Some(outcome) = self.outcome(slot, round) {
                    return (Waited::Ended(outcome), deadline);
                }
                if stop() {
                    return (Waited::Stopped, deadline);
                }
                let now = Instant::now();
                let deadline = *deadline.get_or_insert(match until {
                    Until::Deadline(at) => at,
                    Until::Within(limit) => now + limit,
                });
                if now >= deadline {
                    return (Waited::TimedOut, Some(deadline));
                }
                tries += 1;
                if tries < SPIN_CHECKS && spun.is_some_and(|spun| now.duration_since(spun) < spin) {
                    for _ in 0..SPINS_PER_CHECK {
                        std::hint::spin_loop();
                    }
                    continue;
                }
                // EAGAIN (released meanwhile), EINTR and ETIMEDOUT all mean: look again.
                let _ = futex::wait(self.words.release(), futex::Flags::empty(), seen, Some(&timespec(deadline - now)));
            }
        }

        /// Spins while a spin pays (see [`RankChannel::wait`]) for `round` of `slot`
        /// to end; its outcome if it did meanwhile.
        pub fn spin(&self, slot: u32, round: u32) -> Option<Outcome> {
            let spin = spin_budget(self.words.u32_at(ATTACHED).load(Ordering::Relaxed));
            if spin.is_zero() {
                // No spin, no clock read for it.
                return self.outcome(slot, round);
            }
            let spun = Instant::now();
            for _ in 0..SPIN_CHECKS {
                if let Some(outcome) = self.outcome(slot, round) {
                    return Some(outcome);
                }
                if spun.elapsed() >= spin {
                    break;
                }
                for _ in 0..SPINS_PER_CHECK {
                    std::hint::spin_loop();
                }
            }
            self.outcome(slot, round)
        }

        /// The release bell: an eventfd the agent writes after a release while a rank
        /// sleeps on it ([`RankChannel::sleep_on_bell`]). Nobody reads it: a waiter
        /// watches it edge-triggered (as an async runtime's event loop does), each
        /// ring an edge, and looks at its slot after each.
        pub fn bell(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
            self.bell.as_ref().map(AsFd::as_fd)
        }

        /// Counts the caller among the ranks asleep on the release bell until the
        /// guard drops: from now on every release rings it. Call before the last
        /// look at the slot (and be registered for the bell's edges before it).
        pub fn sleep_on_bell(&self) -> BellSleep<'_> {
            super::sleep_on_bell(&self.words);
            BellSleep(self)
        }

        /// The release word: it moves whenever the agent finishes rounds.
        pub fn release_word(&self) -> u32 {
            super::release_word(&self.words)
        }

        /// Sleeps until the release word no longer reads `seen` (or `timeout`
        /// passes, or a signal comes): for a thread that watches the channel for
        /// waiters that cannot block, such as async tasks.
        pub fn wait_release(&self, seen: u32, timeout: Duration) {
            // EAGAIN (moved meanwhile), EINTR and ETIMEDOUT all mean: look again.
            let _ = futex::wait(self.words.release(), futex::Flags::empty(), seen, Some(&timespec(timeout)));
        }

        /// Wakes whoever of this process waits on the channel (the connection it came
        /// with ended): the release word moves, so no waiter can sleep through it.
        /// Other ranks waiting wake too, find nothing new, and wait again.
        pub fn wake_waiters(&self) {
            publish_and_wake(&self.words, self.bell.as_ref());
        }
    }

    /// Checks of the slot while spinning at most, and spins between checks.
    const SPIN_CHECKS: u32 = 200;
    const SPINS_PER_CHECK: u32 = 32;

    /// How long a waiting rank spins before it sleeps: on a node with a core per
    /// rank a release comes within microseconds and a sleep costs more than that;
    /// with more ranks than cores, spinning only takes the core a peer needs.
    fn spin_budget(attached: u32) -> Duration {
        // Asked once: the answer reads files under /proc and /sys (cgroup quotas),
        // which cost more than the wait itself would.
        static CORES: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
        let cores = *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()) as u32);
        if attached.saturating_mul(2) <= cores {
            Duration::from_micros(50)
        } else {
            Duration::ZERO
        }
    }

    fn timespec(wait: Duration) -> rustix::thread::futex::Timespec {
        rustix::thread::futex::Timespec {
            tv_sec: wait.as_secs().min(i64::MAX as u64) as i64,
            tv_nsec: i64::from(wait.subsec_nanos()),
        }
    }

    /// Publishes the rounds finished since the last call (see [`super::publish`]) and
    /// wakes every waiter: one futex wake of all, and one ring of `bell` (if this
    /// mapping holds it) while a rank sleeps on it.
    fn publish_and_wake(words: &Words, bell: Option<&OwnedFd>) {
        let ring = super::publish(words);
        wake_all(words.release());
        if let (true, Some(bell)) = (ring, bell) {
            ring_bell(bell);
        }
    }

    /// Wakes every process waiting on `word` (a shared, not process-private, futex).
    fn wake_all(word: &AtomicU32) {
        let _ = futex::wake(word, futex::Flags::empty(), i32::MAX as u32);
    }

    /// Rings the release bell: an edge for every event loop watching it.
    fn ring_bell(bell: &OwnedFd) {
        // Nobody reads it, so its count only grows: full (2^64 - 2 rings), a write
        // fails, and the edges stop; it takes centuries at a million rounds a second.
        let _ = rustix::io::write(bell.as_fd(), &1u64.to_ne_bytes());
    }

    #[cfg(test)]
    mod tests {
        use std::os::fd::AsFd;
        use std::sync::atomic::{AtomicBool, AtomicU32};
        use std::sync::Arc;

        use super::*;

        fn rank_of(agent: &AgentChannel) -> RankChannel {
            let file = agent.file.as_fd().try_clone_to_owned().expect("dup");
            let doorbell = agent.doorbell.as_fd().try_clone_to_owned().expect("dup");
            let bell = agent.bell.as_fd().try_clone_to_owned().expect("dup");
            RankChannel::map(file, doorbell, Some(bell)).expect("maps")
        }

        /// Two ranks in two processes' worth of mappings: arrivals ring the doorbell
        /// only first and last; the agent sees both; one release wakes both.
        #[test]
        fn a_round_through_two_mappings() {
            let agent = AgentChannel::create(4).expect("a channel");
            agent.reset_slot(0);
            agent.reset_slot(2);
            agent.set_attached(2);
            assert_eq!(agent.took(0, 2), 0);
            let (a, b) = (rank_of(&agent), rank_of(&agent));
            assert!(!agent.drain_doorbell());
            a.arrive(0, 1, 11);
            assert!(agent.drain_doorbell(), "the first arrival rings");
            assert_eq!(agent.arrival(0, 0), Some((1, 11)));
            assert_eq!(agent.arrival(2, 0), None);
            // The agent took rank 0's arrival: one more completes the node.
            assert_eq!(agent.took(1, 1), 0);
            b.arrive(2, 1, 22);
            assert!(agent.drain_doorbell(), "the last arrival rings");
            assert_eq!(agent.arrival(2, 0), Some((1, 22)));
            assert_eq!(agent.took(1, 0), 0);

            let waiter = std::thread::spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(30);
                (a.wait(0, 1, deadline, || false), b.wait(2, 1, deadline, || false))
            });
            std::thread::sleep(Duration::from_millis(20));
            agent.finish(0, 1, Outcome::Released);
            agent.finish(2, 1, Outcome::Failed);
            agent.release();
            let (x, y) = waiter.join().expect("waiter");
            assert_eq!((x, y), (Waited::Ended(Outcome::Released), Waited::Ended(Outcome::Failed)));
        }

        #[test]
        fn a_wait_ends_at_its_deadline_or_when_told_to_stop() {
            let agent = AgentChannel::create(1).expect("a channel");
            let rank = Arc::new(rank_of(&agent));
            let soon = Instant::now() + Duration::from_millis(30);
            assert_eq!(rank.wait(0, 1, soon, || false), Waited::TimedOut);
            let stop = Arc::new(AtomicBool::new(false));
            let (r, s) = (Arc::clone(&rank), Arc::clone(&stop));
            let waiter = std::thread::spawn(move || {
                r.wait(0, 1, Instant::now() + Duration::from_secs(30), || s.load(Ordering::SeqCst))
            });
            std::thread::sleep(Duration::from_millis(20));
            stop.store(true, Ordering::SeqCst);
            rank.wake_waiters();
            assert_eq!(waiter.join().expect("waiter"), Waited::Stopped);
        }

        /// A wait given a limit instead of a deadline counts it from its own first
        /// look at the clock, and says which deadline it kept; a round that ended
        /// before it looked costs it no clock read and names none.
        #[test]
        fn a_wait_within_a_limit_keeps_the_deadline_it_counted() {
            let agent = AgentChannel::create(1).expect("a channel");
            // More ranks than cores: no spin (which reads the clock first).
            agent.set_attached(u32::MAX);
            let rank = rank_of(&agent);
            let before = Instant::now();
            let (waited, deadline) = rank.wait_until(0, 1, Until::Within(Duration::from_millis(30)), || false);
            let deadline = deadline.expect("a wait that timed out read the clock");
            assert_eq!(waited, Waited::TimedOut);
            assert!(deadline >= before + Duration::from_millis(30) && Instant::now() >= deadline);
            rank.arrive(0, 1, 7);
            agent.finish(0, 1, Outcome::Failed);
            agent.release();
            let ended = rank.wait_until(0, 1, Until::Within(Duration::from_secs(30)), || false);
            assert_eq!(ended, (Waited::Ended(Outcome::Failed), None));
            let at = Instant::now() + Duration::from_secs(30);
            assert_eq!(
                rank.wait_until(0, 1, Until::Deadline(at), || false),
                (Waited::Ended(Outcome::Failed), Some(at))
            );
        }

        /// Waits for the doorbell (at most `wait`), then empties it.
        fn await_bell(agent: &AgentChannel, wait: Duration) {
            let mut fds = [rustix::event::PollFd::new(&*agent.doorbell, rustix::event::PollFlags::IN)];
            let wait =
                rustix::event::Timespec { tv_sec: wait.as_secs() as i64, tv_nsec: i64::from(wait.subsec_nanos()) };
            let _ = rustix::event::poll(&mut fds, Some(&wait));
            agent.drain_doorbell();
        }

        /// The agent's side of `rounds` rounds of every slot, as the node agent runs
        /// it, with every rank attached; `end` says how each round ends. Checks that
        /// a round ends only once every rank has arrived (`arrivals` counts them),
        /// and that each arrival's call id is the rank's own.
        fn run_agent(
            agent: &AgentChannel,
            ranks: u32,
            rounds: u32,
            arrivals: &AtomicU32,
            end: impl Fn(u32) -> Outcome,
        ) {
            let mut seen = vec![0u32; ranks as usize];
            let deadline = Instant::now() + Duration::from_secs(120);
            for round in 1..=rounds {
                let mut held = 0;
                let mut look_again = false;
                while held < ranks {
                    assert!(Instant::now() < deadline, "round {round}: {held} of {ranks} arrivals seen");
                    // Without a ring, only when an arrival counted is not visible yet.
                    await_bell(agent, if look_again { Duration::from_millis(1) } else { Duration::from_secs(10) });
                    let mut taken = 0;
                    for slot in 0..ranks {
                        if let Some((arrived, call)) = agent.arrival(slot, seen[slot as usize]) {
                            assert_eq!(arrived, round, "slot {slot}");
                            assert_eq!(call, u64::from(slot) * 1_000_000 + u64::from(round));
                            seen[slot as usize] = arrived;
                            taken += 1;
                        }
                    }
                    held += taken;
                    look_again = agent.took(taken, ranks - held) > 0;
                }
                assert_eq!(arrivals.load(Ordering::SeqCst), ranks * round, "released before everyone arrived");
                for slot in 0..ranks {
                    agent.finish(slot, round, end(round));
                }
                agent.took(0, ranks);
                agent.release();
            }
        }

        fn channel_of(ranks: u32) -> AgentChannel {
            let agent = AgentChannel::create(ranks).expect("a channel");
            for slot in 0..ranks {
                agent.reset_slot(slot);
            }
            agent.set_attached(ranks);
            agent.took(0, ranks);
            agent
        }

        /// Many ranks, each with its own mapping as a process would have, through
        /// many rounds: no round ends early, none is missed, no waiter sleeps
        /// through its release.
        #[test]
        fn many_ranks_through_many_rounds() {
            const RANKS: u32 = 24;
            const ROUNDS: u32 = 300;
            let agent = channel_of(RANKS);
            let arrivals = Arc::new(AtomicU32::new(0));
            let ranks = spawn_ranks(&agent, RANKS, ROUNDS, &arrivals);
            run_agent(&agent, RANKS, ROUNDS, &arrivals, |_| Outcome::Released);
            for (slot, rank) in ranks.into_iter().enumerate() {
                let waited = rank.join().expect("a rank");
                let odd = waited.iter().position(|w| *w != Waited::Ended(Outcome::Released));
                assert_eq!(odd.map(|at| (at + 1, waited[at])), None, "slot {slot}: (round, how it ended)");
            }
        }

        /// `ranks` threads, each a rank with its own mapping, slot `0..ranks`, each
        /// arriving at `rounds` rounds in turn (counted in `arrivals` first); each
        /// returns how every round's wait ended.
        fn spawn_ranks(
            agent: &AgentChannel,
            ranks: u32,
            rounds: u32,
            arrivals: &Arc<AtomicU32>,
        ) -> Vec<std::thread::JoinHandle<Vec<Waited>>> {
            (0..ranks)
                .map(|slot| {
                    let rank = rank_of(agent);
                    let arrivals = Arc::clone(arrivals);
                    std::thread::spawn(move || {
                        (1..=rounds)
                            .map(|round| {
                                arrivals.fetch_add(1, Ordering::SeqCst);
                                rank.arrive(slot, round, u64::from(slot) * 1_000_000 + u64::from(round));
                                rank.wait(slot, round, Instant::now() + Duration::from_secs(60), || false)
                            })
                            .collect()
                    })
                })
                .collect()
        }

        /// A round that fails (a peer died) wakes every waiter with the failure, and
        /// the channel goes on with the next round.
        #[test]
        fn a_failed_round_wakes_every_waiter_with_the_failure() {
            const RANKS: u32 = 8;
            let agent = channel_of(RANKS);
            let arrivals = Arc::new(AtomicU32::new(0));
            let ranks = spawn_ranks(&agent, RANKS, 3, &arrivals);
            let end = |round| if round == 2 { Outcome::Failed } else { Outcome::Released };
            run_agent(&agent, RANKS, 3, &arrivals, end);
            let (released, failed) = (Waited::Ended(Outcome::Released), Waited::Ended(Outcome::Failed));
            for rank in ranks {
                assert_eq!(rank.join().expect("a rank"), [released, failed, released]);
            }
        }

        /// A rank waiting for peers that never come (one died before arriving) is
        /// woken when the agent fails its round, not at its deadline.
        #[test]
        fn a_waiter_is_woken_with_the_failure_of_a_peer_that_never_arrived() {
            let agent = channel_of(3);
            let (a, b) = (rank_of(&agent), rank_of(&agent));
            let far = Instant::now() + Duration::from_secs(600);
            let waiters = [(a, 0), (b, 1)].map(|(rank, slot)| {
                std::thread::spawn(move || {
                    rank.arrive(slot, 1, 7);
                    rank.wait(slot, 1, far, || false)
                })
            });
            // Slot 2's rank dies: the agent fails the round of those that came.
            let mut seen = 0;
            while seen < 2 {
                await_bell(&agent, Duration::from_millis(10));
                seen = (0..2).filter(|&slot| agent.arrival(slot, 0).is_some()).count();
            }
            agent.finish(0, 1, Outcome::Failed);
            agent.finish(1, 1, Outcome::Failed);
            agent.release();
            for waiter in waiters {
                assert_eq!(waiter.join().expect("a waiter"), Waited::Ended(Outcome::Failed));
            }
        }

        /// Whether `bell` has rung since it was last emptied here (a rank never
        /// empties it: this stands for an edge its event loop would see).
        fn rang(bell: &OwnedFd) -> bool {
            let mut buf = [0u8; 8];
            matches!(rustix::io::read(bell.as_fd(), &mut buf), Ok(8))
        }

        /// The release bell rings at a release only while a rank sleeps on it,
        /// and a rank's end of the connection (waking its own waiters) rings it too.
        #[test]
        fn the_release_bell_rings_only_while_a_rank_sleeps_on_it() {
            let agent = channel_of(2);
            let (rank, other) = (rank_of(&agent), rank_of(&agent));
            let bell = rank.bell().expect("a bell").try_clone_to_owned().expect("dup");
            agent.release();
            assert!(!rang(&bell), "nobody sleeps on the bell: no ring");
            {
                let _asleep = rank.sleep_on_bell();
                let _other = other.sleep_on_bell();
                agent.release();
                assert!(rang(&bell), "a release while ranks sleep on the bell rings it");
                rank.wake_waiters();
                assert!(rang(&bell), "waking this process's waiters rings it too");
            }
            agent.release();
            assert!(!rang(&bell), "both woke: no ring");
        }

        #[test]
        fn only_a_sealed_channel_of_this_layout_maps() {
            let agent = AgentChannel::create(2).expect("a channel");
            let doorbell = || agent.doorbell.as_fd().try_clone_to_owned().expect("dup");
            let unsealed = rustix::fs::memfd_create("unsealed", MemfdFlags::CLOEXEC).expect("a memory file");
            rustix::fs::ftruncate(&unsealed, 4096).expect("size");
            let error = RankChannel::map(unsealed, doorbell(), None).err().expect("unsealed");
            assert!(error.to_string().contains("not sealed"), "{error}");
            // A slab (module `shm`) is sealed, but no channel.
            let slab = crate::shm::Slab::create(10).expect("a slab");
            let slab_file = slab.file.as_fd().try_clone_to_owned().expect("dup");
            let error = RankChannel::map(slab_file, doorbell(), None).err();
            assert!(error.expect("not a channel").to_string().contains("magic"));
        }
    }
}

/// The protocol under `loom`: every interleaving (and every weak-memory outcome loom
/// models) of ranks arriving and waiting against an agent that takes, forwards and
/// releases, some ranks sleeping on the futex and some on the release bell. The
/// futex and the eventfds are modelled as what they guarantee: a futex wait sleeps
/// only while the word still holds the value seen (checked under the kernel's
/// lock), the doorbell keeps a count until read, and an event loop registered for
/// the release bell's edges wakes at any ring after it registered. Checked:
/// no arrival goes unannounced (the agent would sleep forever, a deadlock loom
/// reports), nothing is released before every rank arrived, a call id read is the
/// arrival's own, and every rank sees its own round end.
#[cfg(all(test, rallypoint_loom))]
mod model {
    use loom::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
    use loom::sync::{Arc, Condvar, Mutex};

    use super::*;

    struct Memory {
        pending: AtomicU32,
        expect: AtomicU32,
        release: AtomicU32,
        slots: Vec<[AtomicU32; 3]>,
        calls: Vec<AtomicU64>,
        /// The futex's wait queue.
        futex: (Mutex<()>, Condvar),
        /// The doorbell: an eventfd's count.
        doorbell: (Mutex<u32>, Condvar),
        bell_sleepers: AtomicU32,
        /// The release bell, as an event loop watching it sees it: rings so far.
        bell: (Mutex<u32>, Condvar),
        /// Set by the agent when it forwards a round: every rank had arrived.
        all_arrived: Vec<AtomicBool>,
    }

    impl Cells for Memory {
        fn pending(&self) -> &AtomicU32 {
            &self.pending
        }
        fn expect(&self) -> &AtomicU32 {
            &self.expect
        }
        fn release(&self) -> &AtomicU32 {
            &self.release
        }
        fn bell_sleepers(&self) -> &AtomicU32 {
            &self.bell_sleepers
        }
        fn slot(&self, slot: u32) -> SlotCells<'_> {
            let [arrived, done, outcome] = &self.slots[slot as usize];
            SlotCells { arrived, done, outcome, call: &self.calls[slot as usize] }
        }
    }

    impl Memory {
        fn futex_wait(&self, seen: u32) {
            let (lock, queue) = &self.futex;
            let mut guard = lock.lock().expect("lock");
            while self.release.load(Ordering::Relaxed) == seen {
                guard = queue.wait(guard).expect("wait");
            }
        }

        fn futex_wake(&self) {
            let (lock, queue) = &self.futex;
            drop(lock.lock().expect("lock"));
            queue.notify_all();
        }

        fn ring(&self) {
            let (count, bell) = &self.doorbell;
            *count.lock().expect("lock") += 1;
            bell.notify_one();
        }

        fn ring_release_bell(&self) {
            let (rings, bell) = &self.bell;
            *rings.lock().expect("lock") += 1;
            bell.notify_all();
        }

        /// An event loop registered for the bell's edges: the rings it has seen.
        fn bell_rings(&self) -> u32 {
            *self.bell.0.lock().expect("lock")
        }

        /// Sleeps until the bell rang past `seen` rings (an edge since registering).
        fn bell_wait(&self, seen: u32) {
            let (rings, bell) = &self.bell;
            let mut rung = rings.lock().expect("lock");
            while *rung == seen {
                rung = bell.wait(rung).expect("wait");
            }
        }

        /// Waits for the doorbell unless `look_again`; empties it.
        fn wait_bell(&self, look_again: bool) {
            let (count, bell) = &self.doorbell;
            let mut rung = count.lock().expect("lock");
            while *rung == 0 && !look_again {
                rung = bell.wait(rung).expect("wait");
            }
            *rung = 0;
        }
    }

    fn memory(ranks: u32, rounds: u32) -> Arc<Memory> {
        Arc::new(Memory {
            pending: AtomicU32::new(0),
            expect: AtomicU32::new(ranks),
            release: AtomicU32::new(0),
            slots: (0..ranks).map(|_| [AtomicU32::new(0), AtomicU32::new(0), AtomicU32::new(0)]).collect(),
            calls: (0..ranks).map(|_| AtomicU64::new(0)).collect(),
            futex: (Mutex::new(()), Condvar::new()),
            doorbell: (Mutex::new(0), Condvar::new()),
            bell_sleepers: AtomicU32::new(0),
            bell: (Mutex::new(0), Condvar::new()),
            all_arrived: (0..=rounds).map(|_| AtomicBool::new(false)).collect(),
        })
    }

    /// A rank; `on_bell`: it sleeps on the release bell, as an async task does,
    /// else on the futex.
    fn rank(m: &Memory, slot: u32, rounds: u32, on_bell: bool) {
        for round in 1..=rounds {
            if arrive(m, slot, round, u64::from(slot * 100 + round)) {
                m.ring();
            }
            if on_bell {
                sleep_on_bell(m);
            }
            loop {
                let seen = release_word(m);
                let rings = m.bell_rings();
                if let Some(outcome) = outcome(m, slot, round) {
                    assert_eq!(outcome, Outcome::Released);
                    assert!(m.all_arrived[round as usize].load(Ordering::Relaxed), "released before everyone arrived");
                    break;
                }
                if on_bell {
                    m.bell_wait(rings);
                } else {
                    m.futex_wait(seen);
                }
            }
            if on_bell {
                woke_from_bell(m);
            }
        }
    }

    /// The agent as the reference agent runs it: it looks when the doorbell rang or
    /// the count says an arrival it could not see yet is on its way (the reference
    /// agent then looks again shortly; here: at once, yielding first); it forwards
    /// (here: releases at once) when every rank has arrived.
    fn agent(m: &Memory, ranks: u32, rounds: u32) {
        let mut seen = vec![0u32; ranks as usize];
        let mut held: Vec<u32> = Vec::new();
        let mut look_again = false;
        let mut released = 0;
        while released < rounds {
            if look_again {
                loom::thread::yield_now();
            }
            m.wait_bell(look_again);
            let mut taken = 0;
            for slot in 0..ranks {
                if let Some((round, call)) = arrival(m, slot, seen[slot as usize]) {
                    assert_eq!(round, seen[slot as usize] + 1);
                    assert_eq!(call, u64::from(slot * 100 + round), "an arrival's call id is its own");
                    seen[slot as usize] = round;
                    held.push(slot);
                    taken += 1;
                }
            }
            look_again = took(m, taken, ranks - held.len() as u32) > 0;
            if held.len() as u32 == ranks {
                released += 1;
                m.all_arrived[released as usize].store(true, Ordering::Relaxed);
                for slot in held.drain(..) {
                    finish(m, slot, released, Outcome::Released);
                }
                look_again |= took(m, 0, ranks) > 0;
                let ring = publish(m);
                m.futex_wake();
                if ring {
                    m.ring_release_bell();
                }
            }
        }
    }

    /// `on_bell`: how many of the ranks (the first ones) sleep on the release bell.
    fn check(ranks: u32, rounds: u32, on_bell: u32) {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(3);
        builder.check(move || {
            let m = memory(ranks, rounds);
            let threads: Vec<_> = (0..ranks)
                .map(|slot| {
                    let m = Arc::clone(&m);
                    loom::thread::spawn(move || rank(&m, slot, rounds, slot < on_bell))
                })
                .collect();
            agent(&m, ranks, rounds);
            for t in threads {
                t.join().expect("rank");
            }
        });
    }

    #[test]
    fn one_rank_one_round() {
        check(1, 1, 0);
    }

    #[test]
    fn two_ranks_one_round() {
        check(2, 1, 0);
    }

    #[test]
    fn two_ranks_two_rounds() {
        check(2, 2, 0);
    }

    #[test]
    fn three_ranks_one_round() {
        check(3, 1, 0);
    }

    #[test]
    fn one_rank_on_the_bell_two_rounds() {
        check(1, 2, 1);
    }

    #[test]
    fn two_ranks_one_on_the_bell_two_rounds() {
        check(2, 2, 1);
    }

    #[test]
    fn two_ranks_on_the_bell_one_round() {
        check(2, 1, 2);
    }
}
