//! Shared-memory slabs (docs/PROTOCOL.md, section 13): where the agent writes a
//! large reply once for every rank of its node that takes shared replies, and the
//! bookkeeping of which ranks still hold a slab's current contents, so that a slab
//! is rewritten only once none does.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};

use bytes::BytesMut;
use rallypoint_core::Reply;
use rallypoint_net::shm::Slab;
use rallypoint_net::sync::lock;
use rallypoint_proto::native::encode_reply_body_parts;
use tracing::{debug, warn};

/// Shared-memory slabs an agent makes at most. Each is free again once its ranks
/// released it, so a job needs about one per large result its ranks hold at once;
/// past this, large replies go through the sockets.
const MAX_SLABS: usize = 64;

/// The agent's slabs; a slab's id is its index.
#[derive(Default)]
pub(crate) struct Slabs(Mutex<Vec<SlabUse>>);

/// A slab and the ranks holding its current contents.
struct SlabUse {
    slab: Slab,
    /// Per sub-session: shared replies from this slab's contents not yet released.
    holders: HashMap<u64, u32>,
}

/// A reply body written into a slab.
pub(crate) struct Placed {
    pub(crate) slab: u64,
    pub(crate) len: u64,
    pub(crate) file: Arc<OwnedFd>,
}

impl Slabs {
    /// Writes `reply`'s body into the smallest free slab that holds it, making one
    /// if none does (up to [`MAX_SLABS`]); `None` if there is no room, or a slab
    /// cannot be made (logged), and the ranks get the reply through their sockets.
    pub(crate) fn place(&self, reply: &Reply) -> Option<Placed> {
        let mut head = BytesMut::new();
        let tail = encode_reply_body_parts(reply, &mut head);
        let tail = tail.as_deref().unwrap_or_default();
        let len = head.len() + tail.len();
        let mut slabs = lock(&self.0);
        let free = slabs
            .iter()
            .enumerate()
            .filter(|(_, s)| s.holders.is_empty() && s.slab.capacity() >= len)
            .min_by_key(|(_, s)| s.slab.capacity())
            .map(|(at, _)| at);
        let at = match free {
            Some(at) => at,
            None if slabs.len() < MAX_SLABS => match Slab::create(len) {
                Ok(slab) => {
                    slabs.push(SlabUse { slab, holders: HashMap::new() });
                    slabs.len() - 1
                }
                Err(error) => {
                    warn!(%error, "cannot make a shared-memory slab; sending large replies through the sockets");
                    return None;
                }
            },
            None => {
                debug!(
                    slabs = slabs.len(),
                    "every shared-memory slab is held; sending a large reply through the sockets"
                );
                return None;
            }
        };
        let used = &mut slabs[at];
        let len = used.slab.write(&head, tail);
        Some(Placed { slab: at as u64, len, file: Arc::clone(&used.slab.file) })
    }

    /// `sub` is given the current contents of `slab`.
    pub(crate) fn hold(&self, slab: u64, sub: u64) {
        if let Some(used) = lock(&self.0).get_mut(slab as usize) {
            *used.holders.entry(sub).or_default() += 1;
        }
    }

    /// `sub` released one shared reply from `slab`; with `None`, every one it held
    /// of every slab (its connection ended). A rank can only release its own holds.
    pub(crate) fn release(&self, slab: Option<u64>, sub: u64) {
        let mut slabs = lock(&self.0);
        let drop_one = |used: &mut SlabUse| {
            if let Some(count) = used.holders.get_mut(&sub) {
                *count -= 1;
                if *count == 0 {
                    used.holders.remove(&sub);
                }
            }
        };
        match slab {
            Some(slab) => {
                if let Some(used) = slabs.get_mut(slab as usize) {
                    drop_one(used);
                }
            }
            None => {
                for used in slabs.iter_mut() {
                    used.holders.remove(&sub);
                }
            }
        }
    }
}
