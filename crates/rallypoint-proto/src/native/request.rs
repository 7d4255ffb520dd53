//! Request opcodes and field layouts (docs/PROTOCOL.md, "Requests").

use bytes::{BufMut, Bytes, BytesMut};
use rallypoint_core::{Exit, Members, Request};

use super::wire::{DecodeError, DecodeResult, Reader, WireWrite};

/// One opcode per [`Request`] variant. Values are part of the protocol: never renumber.
mod op {
    pub const SET: u8 = 0x01;
    pub const GET: u8 = 0x02;
    pub const ADD: u8 = 0x03;
    pub const COMPARE_SET: u8 = 0x04;
    pub const APPEND: u8 = 0x05;
    pub const DELETE: u8 = 0x06;
    pub const CHECK: u8 = 0x07;
    pub const WAIT: u8 = 0x08;
    pub const MULTI_GET: u8 = 0x09;
    pub const MULTI_SET: u8 = 0x0a;
    pub const NUM_KEYS: u8 = 0x0b;
    pub const LIST_KEYS: u8 = 0x0c;
    pub const BARRIER: u8 = 0x0d;
    pub const ALL_GATHER: u8 = 0x0e;
    pub const BROADCAST: u8 = 0x0f;
    pub const ABORT: u8 = 0x10;
    pub const HEARTBEAT: u8 = 0x11;
    pub const LEAVE: u8 = 0x12;
    pub const QUEUE_PUSH: u8 = 0x13;
    pub const QUEUE_POP: u8 = 0x14;
    pub const QUEUE_LEN: u8 = 0x15;
    pub const CANCEL_WAIT: u8 = 0x16;
    pub const STORE_BARRIER: u8 = 0x17;
    pub const STATUS: u8 = 0x18;
    pub const RESET: u8 = 0x19;
    pub const ABANDON: u8 = 0x1a;
    pub const JOBS: u8 = 0x1b;
    pub const SNAPSHOT: u8 = 0x1c;
    pub const RANK_EXITED: u8 = 0x1d;
}

mod members {
    pub const WORLD: u8 = 0;
    pub const RANKS: u8 = 1;
    pub const ROLE: u8 = 2;
}

/// Fewest bytes a byte string takes on the wire (its u32 length).
pub(crate) const MIN_BLOB_LEN: usize = 4;

/// Appends the fields of a request after its opcode, chained in wire order.
struct Fields<'a>(&'a mut BytesMut);

impl Fields<'_> {
    fn op(self, opcode: u8) -> Self {
        self.0.put_u8(opcode);
        self
    }

    fn blob(self, b: &[u8]) -> Self {
        self.0.put_blob(b);
        self
    }

    fn str(self, s: &str) -> Self {
        self.0.put_str(s);
        self
    }

    fn i64(self, n: i64) -> Self {
        self.0.put_i64_le(n);
        self
    }

    fn u64(self, n: u64) -> Self {
        self.0.put_u64_le(n);
        self
    }

    fn u32(self, n: u32) -> Self {
        self.0.put_u32_le(n);
        self
    }

    fn blobs(self, items: &[Bytes]) -> Self {
        put_blobs(self.0, items);
        self
    }

    fn entries(self, entries: &[(Bytes, Bytes)]) -> Self {
        self.0.put_list(entries, |dst, (key, value)| {
            dst.put_blob(key);
            dst.put_blob(value);
        });
        self
    }

    fn members(self, members: &Members) -> Self {
        encode_members(members, self.0);
        self
    }

    fn option_blob(self, value: Option<&[u8]>) -> Self {
        self.0.put_option(value, BytesMut::put_blob);
        self
    }

    fn timeout(self, timeout_ms: Option<u64>) -> Self {
        put_timeout(self.0, timeout_ms);
        self
    }
}

pub(crate) fn encode_request(request: &Request, dst: &mut BytesMut) {
    let w = Fields(dst);
    match request {
        Request::Set { key, value } => w.op(op::SET).blob(key).blob(value),
        Request::Get { key, timeout_ms } => w.op(op::GET).blob(key).timeout(*timeout_ms),
        Request::Add { key, delta } => w.op(op::ADD).blob(key).i64(*delta),
        Request::CompareSet { key, expected, desired } => w.op(op::COMPARE_SET).blob(key).blob(expected).blob(desired),
        Request::Append { key, value } => w.op(op::APPEND).blob(key).blob(value),
        Request::Delete { key } => w.op(op::DELETE).blob(key),
        Request::Check { keys } => w.op(op::CHECK).blobs(keys),
        Request::Wait { keys, timeout_ms } => w.op(op::WAIT).blobs(keys).timeout(*timeout_ms),
        Request::MultiGet { keys, timeout_ms } => w.op(op::MULTI_GET).blobs(keys).timeout(*timeout_ms),
        Request::MultiSet { entries } => w.op(op::MULTI_SET).entries(entries),
        Request::NumKeys => w.op(op::NUM_KEYS),
        Request::ListKeys { prefix } => w.op(op::LIST_KEYS).blob(prefix),
        Request::Barrier { name, members, timeout_ms } => {
            w.op(op::BARRIER).str(name).members(members).timeout(*timeout_ms)
        }
        Request::AllGather { name, members, value, timeout_ms } => {
            w.op(op::ALL_GATHER).str(name).members(members).blob(value).timeout(*timeout_ms)
        }
        Request::Broadcast { name, members, root, value, timeout_ms } => {
            w.op(op::BROADCAST).str(name).members(members).u32(*root).option_blob(value.as_deref()).timeout(*timeout_ms)
        }
        Request::Abort { reason } => w.op(op::ABORT).str(reason),
        Request::RankExited { rank, host, pid, exit } => {
            let w = w.op(op::RANK_EXITED).u32(*rank).str(host).u32(*pid);
            encode_exit(*exit, w.0);
            w
        }
        Request::QueuePush { key, value } => w.op(op::QUEUE_PUSH).blob(key).blob(value),
        Request::QueuePop { key } => w.op(op::QUEUE_POP).blob(key),
        Request::QueueLen { key } => w.op(op::QUEUE_LEN).blob(key),
        Request::CancelWait => w.op(op::CANCEL_WAIT),
        Request::StoreBarrier { key, world_size, timeout_ms } => {
            w.op(op::STORE_BARRIER).blob(key).i64(*world_size).timeout(*timeout_ms)
        }
        Request::Status => w.op(op::STATUS),
        Request::Jobs => w.op(op::JOBS),
        Request::Snapshot => w.op(op::SNAPSHOT),
        Request::Reset { incarnation } => w.op(op::RESET).u64(*incarnation),
        Request::Heartbeat => w.op(op::HEARTBEAT),
        Request::Leave => w.op(op::LEAVE),
        Request::Abandon => w.op(op::ABANDON),
    };
}

pub(crate) fn decode_request(r: &mut Reader) -> DecodeResult<Request> {
    // Struct literal fields are evaluated in source order, which is wire order.
    Ok(match r.u8("opcode")? {
        op::SET => Request::Set { key: r.bytes("key")?, value: r.bytes("value")? },
        op::GET => Request::Get { key: r.bytes("key")?, timeout_ms: timeout(r)? },
        op::ADD => Request::Add { key: r.bytes("key")?, delta: r.i64("delta")? },
        op::COMPARE_SET => {
            Request::CompareSet { key: r.bytes("key")?, expected: r.bytes("expected")?, desired: r.bytes("desired")? }
        }
        op::APPEND => Request::Append { key: r.bytes("key")?, value: r.bytes("value")? },
        op::DELETE => Request::Delete { key: r.bytes("key")? },
        op::CHECK => Request::Check { keys: blobs(r, "keys")? },
        op::WAIT => Request::Wait { keys: blobs(r, "keys")?, timeout_ms: timeout(r)? },
        op::MULTI_GET => Request::MultiGet { keys: blobs(r, "keys")?, timeout_ms: timeout(r)? },
        op::MULTI_SET => Request::MultiSet {
            entries: r.list("entries", 2 * MIN_BLOB_LEN, |r| Ok((r.bytes("key")?, r.bytes("value")?)))?,
        },
        op::NUM_KEYS => Request::NumKeys,
        op::LIST_KEYS => Request::ListKeys { prefix: r.bytes("prefix")? },
        op::BARRIER => Request::Barrier { name: r.name("name")?, members: decode_members(r)?, timeout_ms: timeout(r)? },
        op::ALL_GATHER => Request::AllGather {
            name: r.name("name")?,
            members: decode_members(r)?,
            value: r.bytes("value")?,
            timeout_ms: timeout(r)?,
        },
        op::BROADCAST => Request::Broadcast {
            name: r.name("name")?,
            members: decode_members(r)?,
            root: r.u32("root")?,
            value: r.option("value", |r| r.bytes("value"))?,
            timeout_ms: timeout(r)?,
        },
        op::ABORT => Request::Abort { reason: r.string("reason")? },
        op::RANK_EXITED => Request::RankExited {
            rank: r.u32("rank")?,
            host: r.string("host")?,
            pid: r.u32("pid")?,
            exit: decode_exit(r)?,
        },
        op::QUEUE_PUSH => Request::QueuePush { key: r.bytes("key")?, value: r.bytes("value")? },
        op::QUEUE_POP => Request::QueuePop { key: r.bytes("key")? },
        op::QUEUE_LEN => Request::QueueLen { key: r.bytes("key")? },
        op::CANCEL_WAIT => Request::CancelWait,
        op::STORE_BARRIER => {
            Request::StoreBarrier { key: r.bytes("key")?, world_size: r.i64("world_size")?, timeout_ms: timeout(r)? }
        }
        op::STATUS => Request::Status,
        op::RESET => Request::Reset { incarnation: r.u64("incarnation")? },
        op::JOBS => Request::Jobs,
        op::SNAPSHOT => Request::Snapshot,
        op::HEARTBEAT => Request::Heartbeat,
        op::LEAVE => Request::Leave,
        op::ABANDON => Request::Abandon,
        other => return Err(DecodeError::unknown("request opcode", other)),
    })
}

/// How a process ended: `0` and its exit code, or `1` and the signal that killed
/// it, either an `i64` within an `i32` (docs/PROTOCOL.md, section 8's `Exit`).
pub(crate) fn encode_exit(exit: Exit, dst: &mut BytesMut) {
    let (tag, value) = match exit {
        Exit::Code(code) => (0, code),
        Exit::Signal(signal) => (1, signal),
    };
    dst.put_u8(tag);
    dst.put_i64_le(value.into());
}

pub(crate) fn decode_exit(r: &mut Reader) -> DecodeResult<Exit> {
    let (make, field): (fn(i32) -> Exit, _) = match r.u8("exit")? {
        0 => (Exit::Code, "exit.code"),
        1 => (Exit::Signal, "exit.signal"),
        other => return Err(DecodeError::unknown("exit tag", other)),
    };
    let value = r.i64(field)?;
    Ok(make(i32::try_from(value).map_err(|_| DecodeError::out_of_range(field, value))?))
}

pub(crate) fn encode_members(members: &Members, dst: &mut BytesMut) {
    match members {
        Members::World => dst.put_u8(members::WORLD),
        Members::Ranks(ranks) => {
            dst.put_u8(members::RANKS);
            dst.put_list(ranks, |dst, rank| dst.put_u32_le(*rank));
        }
        Members::Role(role) => {
            dst.put_u8(members::ROLE);
            dst.put_str(role);
        }
    }
}

pub(crate) fn decode_members(r: &mut Reader) -> DecodeResult<Members> {
    Ok(match r.u8("members")? {
        members::WORLD => Members::World,
        members::RANKS => Members::Ranks(r.list("members.ranks", 4, |r| r.u32("members.ranks"))?),
        members::ROLE => Members::Role(r.name("members.role")?),
        other => return Err(DecodeError::unknown("members tag", other)),
    })
}

/// A `list<bytes>`: the count, then each item with its length. Any byte strings,
/// so that an all-gather's result writes its values as they lie, without a list.
pub(crate) fn put_blobs<B: AsRef<[u8]>>(
    dst: &mut BytesMut,
    items: impl IntoIterator<Item = B, IntoIter: ExactSizeIterator>,
) {
    let items = items.into_iter();
    dst.put_count(items.len());
    for item in items {
        dst.put_blob(item.as_ref());
    }
}

pub(crate) fn blobs(r: &mut Reader, field: &str) -> DecodeResult<Vec<Bytes>> {
    r.list(field, MIN_BLOB_LEN, |r| r.bytes(field))
}

/// Timeouts are optional u64 milliseconds: flag byte 0 = wait without limit.
fn put_timeout(dst: &mut BytesMut, timeout_ms: Option<u64>) {
    dst.put_option(timeout_ms, BytesMut::put_u64_le);
}

fn timeout(r: &mut Reader) -> DecodeResult<Option<u64>> {
    r.option("timeout_ms", |r| r.u64("timeout_ms"))
}
