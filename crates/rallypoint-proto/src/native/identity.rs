//! The identity a client states in its Hello frame.

use bytes::{BufMut, BytesMut};
use rallypoint_core::Identity;

use super::wire::{DecodeResult, Reader, WireWrite};

pub(crate) fn encode_identity(identity: &Identity, dst: &mut BytesMut) {
    dst.put_str(&identity.job);
    dst.put_option(identity.rank, BytesMut::put_u32_le);
    dst.put_option(identity.world_size, BytesMut::put_u32_le);
    dst.put_str(&identity.host);
    dst.put_u32_le(identity.pid);
    dst.put_option(identity.role.as_deref(), BytesMut::put_str);
}

pub(crate) fn decode_identity(r: &mut Reader) -> DecodeResult<Identity> {
    Ok(Identity {
        job: r.string("job")?,
        rank: r.option("rank", |r| r.u32("rank"))?,
        world_size: r.option("world_size", |r| r.u32("world_size"))?,
        host: r.string("host")?,
        pid: r.u32("pid")?,
        role: r.option("role", |r| r.string("role"))?,
    })
}
