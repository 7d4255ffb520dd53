//! Large replies from a node agent to the ranks of its node through shared memory
//! (docs/PROTOCOL.md, section 13).
//!
//! An all-gather result is the same N values for every rank. Written to each rank's
//! socket it is copied twice per rank (into the socket, out of it): N² bytes per
//! round for a node of N ranks. Instead the agent writes it once into a sealed
//! memory file and passes the file with a small frame (`SCM_RIGHTS`) to every rank
//! that asked for shared replies; each rank maps it read-only and decodes the values
//! in place. The kernel frees the file when the last rank unmaps it.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, IoSlice, IoSliceMut, Write};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};

use bytes::{Bytes, BytesMut};
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage, SendFlags,
};

/// Reply bodies from this size up go as shared files to ranks that take them:
/// below it, copying through the socket costs less than creating and mapping a file.
pub(crate) const SHARED_REPLY_MIN: usize = 128 * 1024;

/// Files passed with one write at most. A receiver makes room for as many per
/// read; the kernel never hands over more than one write's files in one read.
pub(crate) const MAX_FDS_PER_WRITE: usize = 16;

/// Bytes a receiver reads at most per call: the socket carries only small frames
/// when large replies come as files, and the buffer is zeroed before each read.
const MAX_READ: usize = 64 * 1024;

/// No write, resize or further seal: what a rank needs to map the file safely.
const SEALS: SealFlags = SealFlags::WRITE.union(SealFlags::SHRINK).union(SealFlags::GROW).union(SealFlags::SEAL);

/// A reply body in a sealed memory file, shared by every rank it goes to.
pub(crate) struct SharedBody {
    pub(crate) file: OwnedFd,
    pub(crate) len: u64,
}

impl SharedBody {
    /// Writes `head` then `tail` into a new memory file and seals it.
    pub(crate) fn create(head: &[u8], tail: &[u8]) -> io::Result<SharedBody> {
        let fd = rustix::fs::memfd_create("rallypoint-reply", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
        let mut file = File::from(fd);
        file.write_all(head)?;
        file.write_all(tail)?;
        let file = OwnedFd::from(file);
        rustix::fs::fcntl_add_seals(&file, SEALS)?;
        Ok(SharedBody { file, len: (head.len() + tail.len()) as u64 })
    }
}

/// Maps the first `len` bytes of a shared reply's file, read-only, as `Bytes`
/// that unmap it when the last slice of them is dropped.
pub(crate) fn map_body(file: OwnedFd, len: u64) -> io::Result<Bytes> {
    let invalid = |message: String| io::Error::new(io::ErrorKind::InvalidData, message);
    let seals = rustix::fs::fcntl_get_seals(&file)?;
    if !seals.contains(SealFlags::WRITE | SealFlags::SHRINK) {
        return Err(invalid(format!("the file of a shared reply is not sealed against writes ({seals:?})")));
    }
    let size = rustix::fs::fstat(&file)?.st_size as u64;
    if size < len {
        return Err(invalid(format!("the file of a shared reply holds {size} bytes, not {len}")));
    }
    if len == 0 {
        return Ok(Bytes::new());
    }
    let len = usize::try_from(len).map_err(|_| invalid(format!("a shared reply of {len} bytes cannot be mapped")))?;
    // SAFETY: the file is sealed against writes and shrinking (checked above), so
    // the mapped bytes can neither change nor vanish while mapped.
    let map = unsafe { memmap2::MmapOptions::new().len(len).map(&File::from(file))? };
    Ok(Bytes::from_owner(map))
}

/// Writes what `socket` takes of `buf` without waiting, passing `files` with its
/// first byte (at most [`MAX_FDS_PER_WRITE`]).
pub(crate) fn send_with_files(socket: BorrowedFd<'_>, buf: &[u8], files: &[BorrowedFd<'_>]) -> io::Result<usize> {
    debug_assert!(files.len() <= MAX_FDS_PER_WRITE);
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS_PER_WRITE))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !files.is_empty() && !control.push(SendAncillaryMessage::ScmRights(files)) {
        return Err(io::Error::other("too many files for one write"));
    }
    let flags = SendFlags::DONTWAIT | SendFlags::NOSIGNAL;
    Ok(rustix::net::sendmsg(socket, &[IoSlice::new(buf)], &mut control, flags)?)
}

/// Reads what `socket` has into `buf` (up to `room` bytes) without waiting; files
/// that came with the bytes are appended to `files`, in the order they were sent.
pub(crate) fn recv_with_files(
    socket: BorrowedFd<'_>,
    buf: &mut BytesMut,
    room: usize,
    files: &mut VecDeque<OwnedFd>,
) -> io::Result<usize> {
    // Room for all of `room` at once (a large reply's rest), so the buffer does not
    // regrow step by step; zeroed and read a bounded part at a time.
    buf.reserve(room);
    let start = buf.len();
    buf.resize(start + room.clamp(1, MAX_READ), 0);
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
        return Err(io::Error::new(io::ErrorKind::InvalidData, "more files arrived in one read than there was room for"));
    }
    Ok(received.bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_body_maps_back_and_an_unsealed_or_short_file_is_refused() {
        let body = SharedBody::create(b"head:", &[7u8; 5000]).expect("a memory file");
        assert_eq!(body.len, 5005);
        let mapped = map_body(body.file.try_clone().expect("dup"), body.len).expect("maps");
        assert_eq!(&mapped[..5], b"head:");
        assert!(mapped[5..].iter().all(|&b| b == 7));
        let short = map_body(body.file.try_clone().expect("dup"), body.len + 1).expect_err("too short");
        assert!(short.to_string().contains("holds 5005 bytes"), "{short}");

        // A writer could still change or truncate this one under the mapping.
        let unsealed = rustix::fs::memfd_create("unsealed", MemfdFlags::CLOEXEC).expect("a memory file");
        File::from(unsealed.try_clone().expect("dup")).write_all(b"x").expect("write");
        let error = map_body(unsealed, 1).expect_err("unsealed");
        assert!(error.to_string().contains("not sealed"), "{error}");
    }
}
