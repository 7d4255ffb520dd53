//! Checks of everything a client sends, done before any state changes, so a bad
//! request gets a clear error and never disturbs anyone else.

use bytes::Bytes;

use crate::{CollectiveKind, Identity, Limits, Members, OpError, Request};

use super::ranks::Ranks;

pub(crate) fn identity(identity: &Identity, limits: &Limits) -> Result<(), OpError> {
    if identity.job.is_empty() {
        return Err(OpError::Invalid("the job name is empty".into()));
    }
    name("job name", &identity.job, limits)?;
    shown("job name", &identity.job)?;
    name("host name", &identity.host, limits)?;
    shown("host name", &identity.host)?;
    if let Some(role) = &identity.role {
        if role.is_empty() {
            return Err(OpError::Invalid("the role name is empty".into()));
        }
        name("role name", role, limits)?;
        shown("role name", role)?;
    }
    if let Some(world) = identity.world_size {
        world_size(u64::from(world), limits)?;
    }
    match (identity.rank, identity.world_size) {
        (_, Some(0)) => Err(OpError::Invalid("world size 0: a world needs at least one rank".into())),
        (Some(rank), Some(world)) if rank >= world => {
            Err(OpError::Invalid(format!("rank {rank} is out of range for world size {world} (ranks are 0..{world})")))
        }
        (Some(rank), None) => Err(OpError::Invalid(format!("rank {rank} was given without a world size"))),
        _ => Ok(()),
    }
}

pub(crate) fn request(request: &Request, limits: &Limits) -> Result<(), OpError> {
    match request {
        Request::Set { key, value } | Request::Append { key, value } | Request::QueuePush { key, value } => {
            self::key(key, limits)?;
            self::value(value, limits)
        }
        Request::Get { key, .. }
        | Request::Add { key, .. }
        | Request::Delete { key }
        | Request::QueuePop { key }
        | Request::QueueLen { key } => self::key(key, limits),
        Request::StoreBarrier { key, world_size, .. } => {
            self::key(key, limits)?;
            // A world size of 0 or less releases at once: nothing to bound.
            self::world_size(u64::try_from(*world_size).unwrap_or(0), limits)
        }
        Request::CompareSet { key, expected, desired } => {
            self::key(key, limits)?;
            self::value(expected, limits)?;
            self::value(desired, limits)
        }
        Request::Check { keys } | Request::Wait { keys, .. } | Request::MultiGet { keys, .. } => {
            count(keys.len(), limits)?;
            keys.iter().try_for_each(|k| self::key(k, limits))
        }
        Request::MultiSet { entries } => {
            count(entries.len(), limits)?;
            entries.iter().try_for_each(|(k, v)| {
                self::key(k, limits)?;
                self::value(v, limits)
            })
        }
        Request::ListKeys { prefix } => self::key(prefix, limits),
        Request::Barrier { name, members, .. } => {
            collective_name(name, limits)?;
            member_list(members, limits)
        }
        Request::AllGather { name, members, value, .. } => {
            collective_name(name, limits)?;
            member_list(members, limits)?;
            self::value(value, limits)
        }
        Request::Broadcast { name, members, value, .. } => {
            collective_name(name, limits)?;
            member_list(members, limits)?;
            value.as_ref().map_or(Ok(()), |v| self::value(v, limits))
        }
        Request::Abort { reason } => self::name("abort reason", reason, limits),
        Request::RankExited { host, .. } => self::name("host", host, limits),
        Request::NumKeys
        | Request::CancelWait
        | Request::Status
        | Request::Snapshot
        | Request::Jobs
        | Request::Heartbeat
        | Request::Leave
        | Request::Abandon
        | Request::Reset { .. } => Ok(()),
    }
}

/// Checks a collective call's members against the caller and the world, and returns
/// them normalised (a rank list sorted and without duplicates).
#[allow(clippy::too_many_arguments)]
pub(crate) fn members(
    kind: CollectiveKind,
    op_name: &str,
    rank: u32,
    world_size: u32,
    role: &Option<String>,
    members: Members,
    root: Option<u32>,
    ranks: &Ranks,
) -> Result<Members, OpError> {
    let bad = |reason: String| OpError::BadMembers { kind, name: op_name.to_owned(), reason };
    if let Some(root) = root {
        if root >= world_size {
            return Err(bad(format!("root rank {root} is out of range for world size {world_size}")));
        }
    }
    match members {
        Members::World => Ok(Members::World),
        Members::Ranks(mut list) => {
            list.sort_unstable();
            list.dedup();
            if list.is_empty() {
                return Err(bad("the rank list is empty".into()));
            }
            if let Some(outside) = list.iter().find(|&&r| r >= world_size) {
                return Err(bad(format!("rank {outside} is out of range for world size {world_size}")));
            }
            // Every rank listed is the whole job, one collective with the callers
            // that say so (module `collective`).
            if list.len() == world_size as usize {
                return Ok(Members::World);
            }
            let normalised = Members::Ranks(list);
            let Members::Ranks(list) = &normalised else { unreachable!("constructed just above") };
            if list.binary_search(&rank).is_err() {
                return Err(bad(format!("rank {rank} called it but is not among its members, {normalised}")));
            }
            if let Some(root) = root {
                if list.binary_search(&root).is_err() {
                    return Err(bad(format!("root rank {root} is not among its members, {normalised}")));
                }
            }
            Ok(normalised)
        }
        Members::Role(wanted) => {
            if wanted.is_empty() {
                return Err(bad("the role name is empty".into()));
            }
            if role.as_deref() != Some(wanted.as_str()) {
                let has = role.as_ref().map_or("no role".to_owned(), |r| format!("role '{r}'"));
                return Err(bad(format!("rank {rank} called it for role '{wanted}' but has {has}")));
            }
            if let Some(root) = root {
                if let Some(root_role) = ranks.role(root).filter(|_| ranks.has_connected(root)) {
                    if root_role != wanted {
                        return Err(bad(format!("root rank {root} has role '{root_role}', not '{wanted}'")));
                    }
                }
            }
            Ok(Members::Role(wanted))
        }
    }
}

/// A world size a client states: the engine never allocates by it, but it bounds
/// what one client may make the engine consider.
fn world_size(world: u64, limits: &Limits) -> Result<(), OpError> {
    if world > u64::from(limits.max_world_size) {
        return Err(OpError::TooLarge { what: "world size".into(), len: world, limit: limits.max_world_size.into() });
    }
    Ok(())
}

/// A member list longer than any world may be is refused before it is sorted.
fn member_list(members: &Members, limits: &Limits) -> Result<(), OpError> {
    let Members::Ranks(list) = members else { return Ok(()) };
    if list.len() as u64 > u64::from(limits.max_world_size) {
        let limit = limits.max_world_size.into();
        return Err(OpError::TooLarge { what: "member list length".into(), len: list.len() as u64, limit });
    }
    Ok(())
}

fn collective_name(name: &str, limits: &Limits) -> Result<(), OpError> {
    if name.is_empty() {
        return Err(OpError::Invalid("the collective's name is empty".into()));
    }
    // Its characters are looked at once, when its collective is made
    // (`Collectives::find`): not at every call.
    self::name("collective name", name, limits)
}

fn name(what: &str, name: &str, limits: &Limits) -> Result<(), OpError> {
    // Checked before the message is built: this runs on every named request.
    if name.len() > limits.max_name_len {
        return too_large(&format!("{what} length"), name.len(), limits.max_name_len);
    }
    Ok(())
}

/// A name `status`, the live page, metrics and logs show as text (a job's, a
/// host's, a role's): no control characters, which would garble them.
pub(crate) fn shown(what: &str, name: &str) -> Result<(), OpError> {
    match name.chars().find(|c| c.is_control()) {
        Some(c) => {
            Err(OpError::Invalid(format!("the {what} {name:?} holds a control character (U+{:04X})", u32::from(c))))
        }
        None => Ok(()),
    }
}

fn key(key: &Bytes, limits: &Limits) -> Result<(), OpError> {
    too_large("key length", key.len(), limits.max_key_len)
}

fn value(value: &Bytes, limits: &Limits) -> Result<(), OpError> {
    too_large("value length", value.len(), limits.max_value_len)
}

fn count(n: usize, limits: &Limits) -> Result<(), OpError> {
    if n > limits.max_keys_per_op {
        return Err(OpError::TooLarge {
            what: "number of keys".into(),
            len: n as u64,
            limit: limits.max_keys_per_op as u64,
        });
    }
    Ok(())
}

fn too_large(what: &str, len: usize, limit: usize) -> Result<(), OpError> {
    if len > limit {
        return Err(OpError::TooLarge { what: what.to_owned(), len: len as u64, limit: limit as u64 });
    }
    Ok(())
}
