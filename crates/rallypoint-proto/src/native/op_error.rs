//! Encoding of every [`OpError`] with all its fields, so that a client rebuilds
//! exactly the typed error the engine produced (docs/PROTOCOL.md, "Errors").

use bytes::{BufMut, BytesMut};
use rallypoint_core::{
    AbortInfo, AuthRefusal, CallShape, CollectiveKind, JobIncarnation, LossReason, Missing, OpError, OpRef,
    ProcessInfo, RankInfo, RankRanges, RankState,
};

use super::request::{blobs, decode_exit, decode_members, encode_exit, encode_members, put_blobs};
use super::wire::{DecodeError, DecodeResult, Reader, WireWrite};

/// Set in every error tag: a reply tag with this bit is an error, otherwise a response.
pub(crate) const ERROR_TAG_BIT: u8 = 0x80;

/// One tag per [`OpError`] variant. Values are part of the protocol: never renumber.
mod tag {
    pub const COLLECTIVE_TIMEOUT: u8 = 0x81;
    pub const KEY_TIMEOUT: u8 = 0x82;
    pub const PEER_LOST: u8 = 0x83;
    pub const ABORTED: u8 = 0x84;
    pub const MISMATCH: u8 = 0x85;
    pub const BAD_MEMBERS: u8 = 0x86;
    pub const NO_RANK: u8 = 0x87;
    pub const NOT_A_NUMBER: u8 = 0x88;
    pub const OVERFLOW: u8 = 0x89;
    pub const TOO_LARGE: u8 = 0x8a;
    pub const INVALID: u8 = 0x8b;
    pub const CLOSED: u8 = 0x8c;
    pub const RANK_HELD: u8 = 0x8d;
    pub const TAKEN_OVER: u8 = 0x8e;
    pub const JOB_RESET: u8 = 0x8f;
    pub const STALE_INCARNATION: u8 = 0x90;
    pub const UNAUTHORIZED: u8 = 0x91;
    pub const THIS_RANK_LOST: u8 = 0x92;
}

/// Fewest bytes of one encoded [`RankInfo`]: rank + three absent options + state tag.
const MIN_RANK_INFO_LEN: usize = 4 + 1 + 1 + 1 + 1;
/// Bytes of one encoded range of ranks: first and last.
const RANK_RANGE_LEN: usize = 4 + 4;

pub(crate) fn encode_op_error(error: &OpError, dst: &mut BytesMut) {
    match error {
        OpError::CollectiveTimeout { op, waited_ms, members, missing, before_call_ms } => {
            dst.put_u8(tag::COLLECTIVE_TIMEOUT);
            encode_op_ref(op, dst);
            dst.put_u64_le(*waited_ms);
            dst.put_u32_le(*members);
            dst.put_list(missing.named(), |dst, info| encode_rank_info(info, dst));
            encode_rank_ranges(missing.rest(), dst);
            dst.put_option(*before_call_ms, BytesMut::put_u64_le);
        }
        OpError::KeyTimeout { waited_ms, missing } => {
            dst.put_u8(tag::KEY_TIMEOUT);
            dst.put_u64_le(*waited_ms);
            put_blobs(dst, missing);
        }
        OpError::PeerLost { op, peer } => {
            dst.put_u8(tag::PEER_LOST);
            encode_op_ref(op, dst);
            encode_rank_info(peer, dst);
        }
        OpError::ThisRankLost { op, this } => {
            dst.put_u8(tag::THIS_RANK_LOST);
            encode_op_ref(op, dst);
            encode_rank_info(this, dst);
        }
        OpError::Aborted { job, by } => {
            dst.put_u8(tag::ABORTED);
            dst.put_str(job);
            encode_abort_info(by, dst);
        }
        OpError::Mismatch { op, mine, theirs } => {
            dst.put_u8(tag::MISMATCH);
            encode_op_ref(op, dst);
            encode_call_shape(mine, dst);
            encode_call_shape(theirs, dst);
        }
        OpError::BadMembers { kind, name, reason } => {
            dst.put_u8(tag::BAD_MEMBERS);
            dst.put_u8(collective_kind_tag(*kind));
            dst.put_str(name);
            dst.put_str(reason);
        }
        OpError::NoRank { op } => {
            dst.put_u8(tag::NO_RANK);
            dst.put_str(op);
        }
        OpError::NotANumber { key, value } => {
            dst.put_u8(tag::NOT_A_NUMBER);
            dst.put_blob(key);
            dst.put_blob(value);
        }
        OpError::Overflow { key, current, delta } => {
            dst.put_u8(tag::OVERFLOW);
            dst.put_blob(key);
            dst.put_i64_le(*current);
            dst.put_i64_le(*delta);
        }
        OpError::TooLarge { what, len, limit } => {
            dst.put_u8(tag::TOO_LARGE);
            dst.put_str(what);
            dst.put_u64_le(*len);
            dst.put_u64_le(*limit);
        }
        OpError::Invalid(message) => {
            dst.put_u8(tag::INVALID);
            dst.put_str(message);
        }
        OpError::Closed(message) => {
            dst.put_u8(tag::CLOSED);
            dst.put_str(message);
        }
        OpError::RankHeld { rank, holder, since_unix_ms, claimant } => {
            dst.put_u8(tag::RANK_HELD);
            dst.put_u32_le(*rank);
            encode_process(holder, dst);
            dst.put_u64_le(*since_unix_ms);
            encode_process(claimant, dst);
        }
        OpError::TakenOver { rank, by, at_unix_ms, this } => {
            dst.put_u8(tag::TAKEN_OVER);
            dst.put_u32_le(*rank);
            encode_process(by, dst);
            dst.put_u64_le(*at_unix_ms);
            encode_process(this, dst);
        }
        OpError::JobReset { job, to } => {
            dst.put_u8(tag::JOB_RESET);
            dst.put_str(job);
            encode_job_incarnation(to, dst);
        }
        OpError::StaleIncarnation { job, mine, current } => {
            dst.put_u8(tag::STALE_INCARNATION);
            dst.put_str(job);
            dst.put_u64_le(*mine);
            encode_job_incarnation(current, dst);
        }
        OpError::Unauthorized(why) => {
            dst.put_u8(tag::UNAUTHORIZED);
            dst.put_u8(match why {
                AuthRefusal::TokenRequired => 0,
                AuthRefusal::WrongToken => 1,
                AuthRefusal::TlsRequired => 2,
                AuthRefusal::NoTokenHere => 3,
            });
        }
    }
}

pub(crate) fn decode_op_error(r: &mut Reader) -> DecodeResult<OpError> {
    let tag = r.u8("error tag")?;
    decode_op_error_fields(tag, r)
}

/// The fields of the error whose tag was already read.
pub(crate) fn decode_op_error_fields(tag: u8, r: &mut Reader) -> DecodeResult<OpError> {
    Ok(match tag {
        tag::COLLECTIVE_TIMEOUT => OpError::CollectiveTimeout {
            op: decode_op_ref(r)?,
            waited_ms: r.u64("waited_ms")?,
            members: r.u32("members")?,
            missing: Missing::new(r.list("missing", MIN_RANK_INFO_LEN, decode_rank_info)?, decode_rank_ranges(r)?),
            before_call_ms: r.option("before_call_ms", |r| r.u64("before_call_ms"))?,
        },
        tag::KEY_TIMEOUT => OpError::KeyTimeout { waited_ms: r.u64("waited_ms")?, missing: blobs(r, "missing")? },
        tag::PEER_LOST => OpError::PeerLost { op: decode_op_ref(r)?, peer: decode_rank_info(r)? },
        tag::THIS_RANK_LOST => OpError::ThisRankLost { op: decode_op_ref(r)?, this: decode_rank_info(r)? },
        tag::ABORTED => OpError::Aborted { job: r.string("job")?, by: decode_abort_info(r)? },
        tag::MISMATCH => OpError::Mismatch {
            op: decode_op_ref(r)?,
            mine: Box::new(decode_call_shape(r)?),
            theirs: Box::new(decode_call_shape(r)?),
        },
        tag::BAD_MEMBERS => OpError::BadMembers {
            kind: decode_collective_kind(r)?,
            name: r.string("name")?,
            reason: r.string("reason")?,
        },
        tag::NO_RANK => OpError::NoRank { op: r.string("op")? },
        tag::NOT_A_NUMBER => OpError::NotANumber { key: r.bytes("key")?, value: r.bytes("value")? },
        tag::OVERFLOW => OpError::Overflow { key: r.bytes("key")?, current: r.i64("current")?, delta: r.i64("delta")? },
        tag::TOO_LARGE => OpError::TooLarge { what: r.string("what")?, len: r.u64("len")?, limit: r.u64("limit")? },
        tag::INVALID => OpError::Invalid(r.string("message")?),
        tag::CLOSED => OpError::Closed(r.string("message")?),
        tag::RANK_HELD => OpError::RankHeld {
            rank: r.u32("rank")?,
            holder: Box::new(decode_process(r)?),
            since_unix_ms: r.u64("since_unix_ms")?,
            claimant: Box::new(decode_process(r)?),
        },
        tag::TAKEN_OVER => OpError::TakenOver {
            rank: r.u32("rank")?,
            by: Box::new(decode_process(r)?),
            at_unix_ms: r.u64("at_unix_ms")?,
            this: Box::new(decode_process(r)?),
        },
        tag::JOB_RESET => OpError::JobReset { job: r.string("job")?, to: Box::new(decode_job_incarnation(r)?) },
        tag::STALE_INCARNATION => OpError::StaleIncarnation {
            job: r.string("job")?,
            mine: r.u64("mine")?,
            current: Box::new(decode_job_incarnation(r)?),
        },
        tag::UNAUTHORIZED => OpError::Unauthorized(match r.u8("auth refusal")? {
            0 => AuthRefusal::TokenRequired,
            1 => AuthRefusal::WrongToken,
            2 => AuthRefusal::TlsRequired,
            3 => AuthRefusal::NoTokenHere,
            other => return Err(DecodeError::unknown("auth refusal", other)),
        }),
        other => return Err(DecodeError::unknown("error tag", other)),
    })
}

fn collective_kind_tag(kind: CollectiveKind) -> u8 {
    match kind {
        CollectiveKind::Barrier => 0,
        CollectiveKind::AllGather => 1,
        CollectiveKind::Broadcast => 2,
    }
}

fn decode_collective_kind(r: &mut Reader) -> DecodeResult<CollectiveKind> {
    Ok(match r.u8("collective kind")? {
        0 => CollectiveKind::Barrier,
        1 => CollectiveKind::AllGather,
        2 => CollectiveKind::Broadcast,
        other => return Err(DecodeError::unknown("collective kind", other)),
    })
}

fn encode_op_ref(op: &OpRef, dst: &mut BytesMut) {
    dst.put_u8(collective_kind_tag(op.kind));
    dst.put_str(&op.name);
    dst.put_u64_le(op.generation);
}

fn decode_op_ref(r: &mut Reader) -> DecodeResult<OpRef> {
    Ok(OpRef { kind: decode_collective_kind(r)?, name: r.string("op.name")?, generation: r.u64("op.generation")? })
}

fn encode_rank_info(info: &RankInfo, dst: &mut BytesMut) {
    dst.put_u32_le(info.rank);
    dst.put_option(info.host.as_deref(), BytesMut::put_str);
    dst.put_option(info.pid, BytesMut::put_u32_le);
    match info.state {
        RankState::NeverConnected => dst.put_u8(0),
        RankState::Connected => dst.put_u8(1),
        RankState::Left => dst.put_u8(2),
        RankState::Lost(LossReason::Disconnected) => dst.put_u8(3),
        RankState::Lost(LossReason::LeaseExpired { lease_ms }) => {
            dst.put_u8(4);
            dst.put_u64_le(lease_ms);
        }
        RankState::Lost(LossReason::Exited { pid, exit }) => {
            dst.put_u8(5);
            dst.put_u32_le(pid);
            encode_exit(exit, dst);
        }
        RankState::Finished { pid } => {
            dst.put_u8(6);
            dst.put_u32_le(pid);
        }
    }
    dst.put_option(info.last_seen_ms_ago, BytesMut::put_u64_le);
}

fn decode_rank_info(r: &mut Reader) -> DecodeResult<RankInfo> {
    Ok(RankInfo {
        rank: r.u32("rank_info.rank")?,
        host: r.option("rank_info.host", |r| r.string("rank_info.host"))?,
        pid: r.option("rank_info.pid", |r| r.u32("rank_info.pid"))?,
        state: match r.u8("rank_info.state")? {
            0 => RankState::NeverConnected,
            1 => RankState::Connected,
            2 => RankState::Left,
            3 => RankState::Lost(LossReason::Disconnected),
            4 => RankState::Lost(LossReason::LeaseExpired { lease_ms: r.u64("rank_info.lease_ms")? }),
            5 => RankState::Lost(LossReason::Exited { pid: r.u32("rank_info.worker_pid")?, exit: decode_exit(r)? }),
            6 => RankState::Finished { pid: r.u32("rank_info.worker_pid")? },
            other => return Err(DecodeError::unknown("rank state", other)),
        },
        last_seen_ms_ago: r.option("rank_info.last_seen_ms_ago", |r| r.u64("rank_info.last_seen_ms_ago"))?,
    })
}

fn encode_rank_ranges(ranks: &RankRanges, dst: &mut BytesMut) {
    dst.put_u64_le(ranks.count);
    dst.put_list(&ranks.ranges, |dst, &(first, last)| {
        dst.put_u32_le(first);
        dst.put_u32_le(last);
    });
}

fn decode_rank_ranges(r: &mut Reader) -> DecodeResult<RankRanges> {
    let count = r.u64("more.count")?;
    let ranges = r.list("more.ranges", RANK_RANGE_LEN, |r| Ok((r.u32("more.first")?, r.u32("more.last")?)))?;
    Ok(RankRanges { ranges, count })
}

fn encode_call_shape(shape: &CallShape, dst: &mut BytesMut) {
    dst.put_u32_le(shape.rank);
    encode_members(&shape.members, dst);
    dst.put_u32_le(shape.world_size);
    dst.put_option(shape.root, BytesMut::put_u32_le);
}

fn decode_call_shape(r: &mut Reader) -> DecodeResult<CallShape> {
    Ok(CallShape {
        rank: r.u32("call.rank")?,
        members: decode_members(r)?,
        world_size: r.u32("call.world_size")?,
        root: r.option("call.root", |r| r.u32("call.root"))?,
    })
}

fn encode_abort_info(by: &AbortInfo, dst: &mut BytesMut) {
    dst.put_option(by.by_rank, BytesMut::put_u32_le);
    dst.put_str(&by.host);
    dst.put_u32_le(by.pid);
    dst.put_str(&by.reason);
}

fn decode_abort_info(r: &mut Reader) -> DecodeResult<AbortInfo> {
    Ok(AbortInfo {
        by_rank: r.option("by.rank", |r| r.u32("by.rank"))?,
        host: r.string("by.host")?,
        pid: r.u32("by.pid")?,
        reason: r.string("by.reason")?,
    })
}

fn encode_process(process: &ProcessInfo, dst: &mut BytesMut) {
    dst.put_u32_le(process.pid);
    dst.put_str(&process.host);
    dst.put_option(process.incarnation, BytesMut::put_u64_le);
}

fn decode_process(r: &mut Reader) -> DecodeResult<ProcessInfo> {
    Ok(ProcessInfo {
        pid: r.u32("process.pid")?,
        host: r.string("process.host")?,
        incarnation: r.option("process.incarnation", |r| r.u64("process.incarnation"))?,
    })
}

fn encode_job_incarnation(job: &JobIncarnation, dst: &mut BytesMut) {
    dst.put_u64_le(job.incarnation);
    dst.put_u64_le(job.since_unix_ms);
    dst.put_bool(job.reset);
    encode_process(&job.by, dst);
}

fn decode_job_incarnation(r: &mut Reader) -> DecodeResult<JobIncarnation> {
    Ok(JobIncarnation {
        incarnation: r.u64("incarnation")?,
        since_unix_ms: r.u64("since_unix_ms")?,
        reset: r.bool("reset")?,
        by: decode_process(r)?,
    })
}
