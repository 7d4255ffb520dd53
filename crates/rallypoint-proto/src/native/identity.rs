//! The identity a client states in its Hello frame, and the Welcome that accepts it.

use bytes::{BufMut, BytesMut};
use rallypoint_core::{Identity, SessionId, Welcome};

use super::wire::{DecodeResult, Reader, WireWrite};

pub(crate) fn encode_identity(identity: &Identity, dst: &mut BytesMut) {
    dst.put_str(&identity.job);
    dst.put_option(identity.rank, BytesMut::put_u32_le);
    dst.put_option(identity.world_size, BytesMut::put_u32_le);
    dst.put_str(&identity.host);
    dst.put_u32_le(identity.pid);
    dst.put_option(identity.role.as_deref(), BytesMut::put_str);
    dst.put_option(identity.incarnation, BytesMut::put_u64_le);
    dst.put_option(identity.job_incarnation, BytesMut::put_u64_le);
    dst.put_option(identity.resume.map(|s| s.0), BytesMut::put_u64_le);
}

pub(crate) fn decode_identity(r: &mut Reader) -> DecodeResult<Identity> {
    Ok(Identity {
        job: r.string("job")?,
        rank: r.option("rank", |r| r.u32("rank"))?,
        world_size: r.option("world_size", |r| r.u32("world_size"))?,
        host: r.string("host")?,
        pid: r.u32("pid")?,
        role: r.option("role", |r| r.string("role"))?,
        incarnation: r.option("incarnation", |r| r.u64("incarnation"))?,
        job_incarnation: r.option("job_incarnation", |r| r.u64("job_incarnation"))?,
        resume: r.option("resume", |r| r.u64("resume"))?.map(SessionId),
    })
}

/// The fields of a welcome after its frame kind (and, for a sub-session, its `sub`).
pub(crate) fn encode_welcome(welcome: &Welcome, dst: &mut BytesMut) {
    dst.put_u64_le(welcome.session.0);
    dst.put_u64_le(welcome.lease_ms);
    dst.put_option(welcome.job_incarnation, BytesMut::put_u64_le);
}

pub(crate) fn decode_welcome(r: &mut Reader) -> DecodeResult<Welcome> {
    Ok(Welcome {
        session: SessionId(r.u64("session")?),
        lease_ms: r.u64("lease_ms")?,
        job_incarnation: r.option("job_incarnation", |r| r.u64("job_incarnation"))?,
    })
}
