//! The member set of one generation, and which of them have arrived.

use std::collections::BTreeMap;

use bytes::Bytes;

use super::ranks::Ranks;

/// Who a generation waits for.
#[derive(Debug)]
pub(crate) enum MemberSet {
    /// Ranks `0..world_size`.
    World(u32),
    /// Sorted, distinct ranks.
    Listed(Vec<u32>),
    /// Ranks with this role; the list is known once every rank of the world has connected.
    Role { name: String, world_size: u32, resolved: Option<Vec<u32>> },
}

impl MemberSet {
    /// Number of members, if known yet.
    pub fn count(&self) -> Option<usize> {
        match self {
            MemberSet::World(w) => Some(*w as usize),
            MemberSet::Listed(list) => Some(list.len()),
            MemberSet::Role { resolved, .. } => resolved.as_ref().map(Vec::len),
        }
    }

    pub fn contains(&self, rank: u32, ranks: &Ranks) -> bool {
        match self {
            MemberSet::World(w) => rank < *w,
            MemberSet::Listed(list) => list.binary_search(&rank).is_ok(),
            MemberSet::Role { resolved: Some(list), .. } => list.binary_search(&rank).is_ok(),
            MemberSet::Role { name, world_size, resolved: None } => {
                rank < *world_size && (ranks.role(rank) == Some(name.as_str()) || !ranks.has_connected(rank))
            }
        }
    }

    /// Fixes a role's member list once every rank of the world has connected (so every
    /// rank's role is known). Returns whether the set is now known.
    pub fn resolve(&mut self, ranks: &Ranks) -> bool {
        let MemberSet::Role { name, world_size, resolved } = self else { return true };
        if resolved.is_some() {
            return true;
        }
        if !(0..*world_size).all(|r| ranks.has_connected(r)) {
            return false;
        }
        *resolved = Some((0..*world_size).filter(|&r| ranks.role(r) == Some(name.as_str())).collect());
        true
    }

    /// Members that have not arrived, in rank order. For a role not yet resolved: the
    /// ranks known to hold it plus every rank never seen (its role is unknown).
    pub fn missing(&self, arrivals: &Arrivals, ranks: &Ranks) -> Vec<u32> {
        let absent = |r: &u32| !arrivals.contains(*r);
        match self {
            MemberSet::World(w) => (0..*w).filter(absent).collect(),
            MemberSet::Listed(list) | MemberSet::Role { resolved: Some(list), .. } => {
                list.iter().copied().filter(absent).collect()
            }
            MemberSet::Role { world_size, .. } => {
                (0..*world_size).filter(|r| absent(r) && self.contains(*r, ranks)).collect()
            }
        }
    }

    /// Members in rank order (only once known).
    pub fn in_order(&self) -> Box<dyn Iterator<Item = u32> + '_> {
        match self {
            MemberSet::World(w) => Box::new(0..*w),
            MemberSet::Listed(list) | MemberSet::Role { resolved: Some(list), .. } => Box::new(list.iter().copied()),
            MemberSet::Role { resolved: None, .. } => Box::new(std::iter::empty()),
        }
    }
}

/// Values of the members that arrived. Dense for whole-world generations (the large
/// ones), sparse for subgroups so that a 2-rank group in a 100,000-rank world stays small.
#[derive(Debug)]
pub(crate) enum Arrivals {
    Dense { values: Vec<Option<Bytes>>, count: usize },
    Sparse(BTreeMap<u32, Bytes>),
}

impl Arrivals {
    pub fn for_members(members: &MemberSet) -> Self {
        match members {
            MemberSet::World(w) => Arrivals::Dense { values: vec![None; *w as usize], count: 0 },
            _ => Arrivals::Sparse(BTreeMap::new()),
        }
    }

    pub fn count(&self) -> usize {
        match self {
            Arrivals::Dense { count, .. } => *count,
            Arrivals::Sparse(map) => map.len(),
        }
    }

    pub fn contains(&self, rank: u32) -> bool {
        self.get(rank).is_some()
    }

    pub fn get(&self, rank: u32) -> Option<&Bytes> {
        match self {
            Arrivals::Dense { values, .. } => values.get(rank as usize).and_then(Option::as_ref),
            Arrivals::Sparse(map) => map.get(&rank),
        }
    }

    pub fn insert(&mut self, rank: u32, value: Bytes) {
        match self {
            Arrivals::Dense { values, count } => {
                if let Some(slot) = values.get_mut(rank as usize) {
                    if slot.replace(value).is_none() {
                        *count += 1;
                    }
                }
            }
            Arrivals::Sparse(map) => {
                map.insert(rank, value);
            }
        }
    }
}
