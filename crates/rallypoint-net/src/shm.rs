//! Large replies from a node agent to the ranks of its node through shared memory
//! (docs/PROTOCOL.md, section 13).
//!
//! An all-gather result is the same N values for every rank. Written to each rank's
//! socket it is copied twice per rank (into the socket, out of it): N² bytes per
//! round for a node of N ranks. Instead the agent writes it once into a shared
//! memory *slab*, a memory file it passes (`SCM_RIGHTS`) to each rank the first
//! time it names it; each rank maps the slab read-only once and decodes the values
//! in place. A rank tells the agent when it no longer holds anything of a slab, and
//! the agent writes the slab's next contents only once every rank it gave the
//! current ones to has done so: a rank's mapping stays valid and its pages stay
//! mapped from one round to the next, so a round costs no mapping work at all.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use memmap2::{Mmap, MmapMut};
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage, SendFlags,
};

/// Reply bodies from this size up may go to ranks that take them through slabs:
/// below it, copying one through a socket costs a rank less than the frame, the
/// file and the mapping of a slab.
pub const SHARED_REPLY_MIN: usize = 16 * 1024;

/// ... if the copies a slab saves, over all the ranks given one reply, come to this
/// much: the slab itself is made and written once, whatever number of ranks take it.
pub const SHARED_FAN_OUT_MIN: usize = 128 * 1024;

/// Whether a reply body of `len` bytes for `recipients` ranks goes through a slab
/// to those that take shared replies.
pub fn through_slab(len: usize, recipients: usize) -> bool {
    len >= SHARED_REPLY_MIN && len.saturating_mul(recipients) >= SHARED_FAN_OUT_MIN
}

/// Files passed with one write at most. A receiver makes room for as many per
/// read; the kernel never hands over more than one write's files in one read.
pub const MAX_FDS_PER_WRITE: usize = 16;

/// Bytes a receiver reads at most per call: the socket carries only small frames
/// when large replies come through slabs, and the buffer is zeroed before each read.
const MAX_READ: usize = 64 * 1024;

/// Smallest slab made: a result that grows a little from one round to the next
/// still fits the slab the last one used.
const MIN_SLAB: usize = 1 << 20;

/// No resize and no further seal: a rank's mapping of the whole file can never
/// point past its end (which would be a SIGBUS on access).
const SEALS: SealFlags = SealFlags::SHRINK.union(SealFlags::GROW).union(SealFlags::SEAL);

/// A slab as the agent holds it: a memory file, mapped writable here.
pub struct Slab {
    pub file: Arc<OwnedFd>,
    map: MmapMut,
}

impl Slab {
    /// A slab of at least `len` bytes (a power of two, at least [`MIN_SLAB`]).
    pub fn create(len: usize) -> io::Result<Slab> {
        let capacity = len.max(MIN_SLAB).checked_next_power_of_two().unwrap_or(len);
        let fd = rustix::fs::memfd_create("rallypoint-slab", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
        rustix::fs::ftruncate(&fd, capacity as u64)?;
        let file = File::from(fd);
        // SAFETY: a fresh memory file of this process; ranks only ever map it
        // read-only, and the seals keep its size.
        let map = unsafe { MmapMut::map_mut(&file)? };
        let file = OwnedFd::from(file);
        rustix::fs::fcntl_add_seals(&file, SEALS)?;
        Ok(Slab { file: Arc::new(file), map })
    }

    pub fn capacity(&self) -> usize {
        self.map.len()
    }

    /// Writes a reply body (`head`, then `tail`) at the start of the slab; returns
    /// its length. The caller makes sure no rank still holds the previous body.
    pub fn write(&mut self, head: &[u8], tail: &[u8]) -> u64 {
        self.map[..head.len()].copy_from_slice(head);
        self.map[head.len()..head.len() + tail.len()].copy_from_slice(tail);
        (head.len() + tail.len()) as u64
    }
}

/// Maps a slab's file read-only, whole, as a rank keeps it.
pub fn map_slab(file: OwnedFd) -> io::Result<Arc<Mmap>> {
    let seals = rustix::fs::fcntl_get_seals(&file)?;
    if !seals.contains(SealFlags::SHRINK) {
        let message = format!("a shared-memory slab is not sealed against shrinking ({seals:?})");
        return Err(io::Error::new(io::ErrorKind::InvalidData, message));
    }
    // SAFETY: the file cannot shrink (checked above), so no mapped page can vanish;
    // the agent writes a slab only when no rank holds what it held.
    Ok(Arc::new(unsafe { Mmap::map(&File::from(file))? }))
}

/// The first `len` bytes of a mapped slab as `Bytes`; `release` runs once the last
/// slice of them is dropped (and at once if `len` does not fit).
pub fn held_body(map: Arc<Mmap>, len: u64, release: impl FnOnce() + Send + 'static) -> io::Result<Bytes> {
    match usize::try_from(len).ok().filter(|&len| len <= map.len()) {
        Some(len) => Ok(Bytes::from_owner(Held { map, len, release: Some(release) })),
        None => {
            release();
            let message = format!("a shared reply of {len} bytes does not fit its slab of {} bytes", map.len());
            Err(io::Error::new(io::ErrorKind::InvalidData, message))
        }
    }
}

/// What a rank holds of a slab: the owner of the `Bytes` decoded from it.
struct Held<F: FnOnce()> {
    map: Arc<Mmap>,
    len: usize,
    release: Option<F>,
}

impl<F: FnOnce()> AsRef<[u8]> for Held<F> {
    fn as_ref(&self) -> &[u8] {
        &self.map[..self.len]
    }
}

impl<F: FnOnce()> Drop for Held<F> {
    fn drop(&mut self) {
        if let Some(release) = self.release.take() {
            release();
        }
    }
}

/// Writes what `socket` takes of `buf` without waiting, passing `files` with its
/// first byte (at most [`MAX_FDS_PER_WRITE`]).
pub fn send_with_files(socket: BorrowedFd<'_>, buf: &[u8], files: &[BorrowedFd<'_>]) -> io::Result<usize> {
    debug_assert!(files.len() <= MAX_FDS_PER_WRITE);
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS_PER_WRITE))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !files.is_empty() && !control.push(SendAncillaryMessage::ScmRights(files)) {
        return Err(io::Error::other("too many files for one write"));
    }
    let flags = SendFlags::DONTWAIT | SendFlags::NOSIGNAL;
    Ok(rustix::net::sendmsg(socket, &[IoSlice::new(buf)], &mut control, flags)?)
}

/// How many bytes [`recv_with_files`] asks for at most, given `room`: a read that
/// gives fewer found the socket emptied (unless files came with it).
pub fn read_size(room: usize) -> usize {
    room.clamp(1, MAX_READ)
}

/// Reads what `socket` has into `buf` (up to `room` bytes) without waiting; files
/// that came with the bytes are appended to `files`, in the order they were sent.
pub fn recv_with_files(
    socket: BorrowedFd<'_>,
    buf: &mut BytesMut,
    room: usize,
    files: &mut VecDeque<OwnedFd>,
) -> io::Result<usize> {
    // Room for all of `room` at once (a large reply's rest), so the buffer does not
    // regrow step by step; zeroed and read a bounded part at a time.
    buf.reserve(room);
    let start = buf.len();
    buf.resize(start + read_size(room), 0);
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS_PER_WRITE))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let received = rustix::net::recvmsg(
        socket,
        &mut [IoSliceMut::new(&mut buf[start..])],
        &mut control,
        RecvFlags::DONTWAIT | RecvFlags::CMSG_CLOEXEC,
    );
    let received = match received {
        Ok(received) => received,
        Err(error) => {
            buf.truncate(start);
            return Err(error.into());
        }
    };
    buf.truncate(start + received.bytes);
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = message {
            files.extend(received);
        }
    }
    if received.flags.contains(rustix::net::ReturnFlags::CTRUNC) {
        // Files were dropped by the kernel: a later shared reply would take the wrong one.
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "more files arrived in one read than there was room for",
        ));
    }
    Ok(received.bytes)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[test]
    fn a_reply_goes_through_a_slab_when_the_copies_it_saves_outweigh_it() {
        // Too small for a slab, however many ranks take it.
        assert!(!through_slab(SHARED_REPLY_MIN - 1, 100_000));
        // A mid-size reply: copied to a few ranks, shared among many.
        assert!(!through_slab(SHARED_REPLY_MIN, 1));
        assert!(through_slab(SHARED_REPLY_MIN, SHARED_FAN_OUT_MIN / SHARED_REPLY_MIN));
        // A large one: shared even with one rank (its mapping stays for later rounds).
        assert!(through_slab(SHARED_FAN_OUT_MIN, 1));
        assert!(!through_slab(usize::MAX, 0), "no rank, nothing to share");
    }

    #[test]
    fn a_slab_maps_back_and_its_release_runs_when_the_last_slice_goes() {
        let mut slab = Slab::create(5000).expect("a slab");
        assert_eq!(slab.capacity(), MIN_SLAB);
        assert_eq!(slab.write(b"head:", &[7u8; 5000]), 5005);
        let map = map_slab(slab.file.try_clone().expect("dup")).expect("maps");
        let released = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&released);
        let body = held_body(Arc::clone(&map), 5005, move || {
            counter.fetch_add(1, Ordering::SeqCst);
        })
        .expect("fits");
        let (head, tail) = (body.slice(..5), body.slice(5..));
        drop(body);
        assert_eq!(&head[..], b"head:");
        assert!(tail.iter().all(|&b| b == 7) && tail.len() == 5000);
        drop(head);
        assert_eq!(released.load(Ordering::SeqCst), 0, "released while a slice is held");
        drop(tail);
        assert_eq!(released.load(Ordering::SeqCst), 1);

        let counter = Arc::clone(&released);
        let too_long = held_body(map, MIN_SLAB as u64 + 1, move || {
            counter.fetch_add(1, Ordering::SeqCst);
        });
        assert!(too_long.expect_err("too long").to_string().contains("does not fit"));
        assert_eq!(released.load(Ordering::SeqCst), 2, "a refused body is released at once");

        // A file that could shrink under the mapping is refused.
        let unsealed = rustix::fs::memfd_create("unsealed", MemfdFlags::CLOEXEC).expect("a memory file");
        rustix::fs::ftruncate(&unsealed, 4096).expect("size");
        let error = map_slab(unsealed).expect_err("unsealed");
        assert!(error.to_string().contains("not sealed"), "{error}");
    }
}
