//! The member set of one generation, and which of them have arrived.

use bytes::Bytes;

use crate::ranges::{gaps, runs};

use super::ranks::Ranks;
use super::HashMap;

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
        // Fewer ranks ever connected than the world holds: some never did. Checked
        // first, so that this costs nothing at each connection while a world fills.
        if ranks.ever_connected() < *world_size as usize || !(0..*world_size).all(|r| ranks.has_connected(r)) {
            return false;
        }
        *resolved = Some((0..*world_size).filter(|&r| ranks.role(r) == Some(name.as_str())).collect());
        true
    }

    /// Members that have not arrived, as ranges in rank order. For a role not yet
    /// resolved: the ranks known to hold it plus every rank never seen (its role is
    /// unknown). Costs what arrived, connected or was listed, never the world size.
    pub fn missing<'a>(&'a self, arrivals: &'a Arrivals, ranks: &Ranks) -> Box<dyn Iterator<Item = (u32, u32)> + 'a> {
        match self {
            MemberSet::World(w) => Box::new(gaps(*w, arrivals.ranks())),
            MemberSet::Listed(list) | MemberSet::Role { resolved: Some(list), .. } => {
                Box::new(runs(list.iter().copied().filter(|&r| !arrivals.contains(r))))
            }
            MemberSet::Role { name, world_size, resolved: None } => {
                // Not members: the ranks seen with another role (or none); not missing:
                // the members that arrived.
                let mut excluded: Vec<u32> = ranks.with_other_role(name).chain(arrivals.ranks()).collect();
                excluded.sort_unstable();
                Box::new(gaps(*world_size, excluded))
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

/// Values of the members that arrived. Its size follows the ranks that connected,
/// never a claimed world size: a whole world no larger than the ranks that ever
/// connected is a bit per rank (the fast case of a job whose ranks all came), with
/// a value per rank only once one is not empty (a barrier's never are); anything else
/// is a map of the ranks that arrive.
#[derive(Debug)]
pub(crate) enum Arrivals {
    Dense { arrived: Vec<u64>, count: usize, values: Vec<Option<Bytes>>, world: usize },
    Sparse(HashMap<u32, Bytes>),
}

/// The value of a member that arrived with none.
static NO_VALUE: Bytes = Bytes::new();

impl Arrivals {
    pub fn for_members(members: &MemberSet, ranks: &Ranks) -> Self {
        let connected = ranks.ever_connected();
        match members {
            MemberSet::World(w) if *w as usize <= connected => {
                let world = *w as usize;
                Arrivals::Dense { arrived: vec![0; world.div_ceil(64)], count: 0, values: Vec::new(), world }
            }
            _ => {
                let expected = members.count().unwrap_or(connected).min(connected);
                Arrivals::Sparse(HashMap::with_capacity_and_hasher(expected, Default::default()))
            }
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
            Arrivals::Dense { arrived, values, .. } => {
                let rank = rank as usize;
                let bit = arrived.get(rank / 64)? & (1 << (rank % 64));
                if bit == 0 {
                    return None;
                }
                Some(values.get(rank).and_then(Option::as_ref).unwrap_or(&NO_VALUE))
            }
            Arrivals::Sparse(map) => map.get(&rank),
        }
    }

    /// [`Arrivals::insert`] of a call that brings no value (a barrier's).
    #[inline]
    pub fn insert_empty(&mut self, rank: u32) {
        match self {
            Arrivals::Dense { arrived, count, values, world } => {
                let at = rank as usize;
                if mark(arrived, count, *world, at) {
                    if let Some(slot) = values.get_mut(at) {
                        *slot = None;
                    }
                }
            }
            Arrivals::Sparse(map) => {
                map.insert(rank, Bytes::new());
            }
        }
    }

    pub fn insert(&mut self, rank: u32, value: Bytes) {
        match self {
            Arrivals::Dense { arrived, count, values, world } => {
                let rank = rank as usize;
                if !mark(arrived, count, *world, rank) {
                    return;
                }
                if !value.is_empty() && values.is_empty() {
                    *values = vec![None; *world];
                }
                if let Some(slot) = values.get_mut(rank) {
                    *slot = (!value.is_empty()).then_some(value);
                }
            }
            Arrivals::Sparse(map) => {
                map.insert(rank, value);
            }
        }
    }

    /// The ranks that arrived, in rank order.
    pub fn ranks(&self) -> Vec<u32> {
        match self {
            Arrivals::Dense { arrived, .. } => (0..)
                .zip(arrived)
                .flat_map(|(word_at, &word): (u32, &u64)| {
                    (0..64).filter(move |bit| word & (1 << bit) != 0).map(move |bit| word_at * 64 + bit)
                })
                .collect(),
            Arrivals::Sparse(map) => {
                let mut ranks: Vec<u32> = map.keys().copied().collect();
                ranks.sort_unstable();
                ranks
            }
        }
    }
}

/// Marks rank `at` arrived in a dense set of `world` ranks, counting it once;
/// false (nothing marked) past the world.
fn mark(arrived: &mut [u64], count: &mut usize, world: usize, at: usize) -> bool {
    let Some(word) = arrived.get_mut(at / 64).filter(|_| at < world) else { return false };
    let bit = 1 << (at % 64);
    if *word & bit == 0 {
        *word |= bit;
        *count += 1;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Arrivals of a whole world of `world` ranks that all connected (the dense case).
    fn dense(world: u32) -> Arrivals {
        let mut ranks = Ranks::default();
        for rank in 0..world {
            ranks.connect(rank, "host", 1, None, 0, 0, None);
        }
        let arrivals = Arrivals::for_members(&MemberSet::World(world), &ranks);
        assert!(matches!(arrivals, Arrivals::Dense { .. }));
        arrivals
    }

    #[test]
    fn dense_arrivals_hold_a_bit_per_rank_and_values_only_once_one_is_not_empty() {
        let mut barrier = dense(130);
        for rank in [129, 0, 64, 63, 64] {
            barrier.insert(rank, Bytes::new());
        }
        barrier.insert(130, Bytes::new());
        assert_eq!(barrier.count(), 4, "a rank arriving twice counts once; one past the world not at all");
        assert_eq!(barrier.ranks(), [0, 63, 64, 129]);
        assert_eq!(barrier.get(63), Some(&Bytes::new()));
        assert_eq!((barrier.get(1), barrier.get(130), barrier.get(u32::MAX)), (None, None, None));
        assert!(matches!(&barrier, Arrivals::Dense { values, .. } if values.is_empty()));

        let mut gather = dense(3);
        gather.insert(2, Bytes::from_static(b"two"));
        gather.insert(0, Bytes::new());
        assert_eq!(gather.get(2), Some(&Bytes::from_static(b"two")));
        assert_eq!((gather.get(0), gather.get(1)), (Some(&Bytes::new()), None));
        assert_eq!((gather.count(), gather.ranks()), (2, vec![0, 2]));
    }
}
