//! Values kept per rank of a job, looked up at every call of the rank: in a
//! vector indexed by rank while the ranks held are dense (a job's ranks are
//! 0..world), so that a lookup is one indexed load and no hashing; in a map for a
//! rank far past those held, so that a huge rank number costs one entry, not a
//! vector that long. Nothing is ever removed: a rank stays known once it connected.

use std::collections::hash_map::Entry;

use super::HashMap;
use crate::session_table::grow_to_take;

#[derive(Debug)]
pub(crate) struct ByRank<T> {
    dense: Vec<Option<T>>,
    /// Ranks at or past `dense.len()`.
    sparse: HashMap<u32, T>,
    /// Values held, in either.
    len: usize,
}

impl<T> Default for ByRank<T> {
    fn default() -> Self {
        ByRank { dense: Vec::new(), sparse: HashMap::default(), len: 0 }
    }
}

impl<T> ByRank<T> {
    pub fn get(&self, rank: u32) -> Option<&T> {
        match self.dense.get(rank as usize) {
            Some(slot) => slot.as_ref(),
            None => self.sparse.get(&rank),
        }
    }

    pub fn get_mut(&mut self, rank: u32) -> Option<&mut T> {
        match self.dense.get_mut(rank as usize) {
            Some(slot) => slot.as_mut(),
            None => self.sparse.get_mut(&rank),
        }
    }

    /// `rank`'s value, made with `make` if it has none.
    pub fn get_or_insert_with(&mut self, rank: u32, make: impl FnOnce() -> T) -> &mut T {
        self.get_or_make(rank, make).0
    }

    /// [`ByRank::get_or_insert_with`], saying whether the value was made now.
    /// Inlined: a collective's call counter is taken this way at every call.
    #[inline]
    pub fn get_or_make(&mut self, rank: u32, make: impl FnOnce() -> T) -> (&mut T, bool) {
        let at = rank as usize;
        // The ranks the map held that the vector now reaches move into it.
        if grow_to_take(&mut self.dense, at, self.len) {
            let len = self.dense.len();
            for (r, value) in self.sparse.extract_if(|&r, _| (r as usize) < len) {
                self.dense[r as usize] = Some(value);
            }
        }
        match self.dense.get_mut(at) {
            Some(slot) => {
                let made = slot.is_none();
                if made {
                    self.len += 1;
                }
                (slot.get_or_insert_with(make), made)
            }
            None => match self.sparse.entry(rank) {
                Entry::Occupied(held) => (held.into_mut(), false),
                Entry::Vacant(new) => {
                    self.len += 1;
                    (new.insert(make()), true)
                }
            },
        }
    }

    pub fn contains(&self, rank: u32) -> bool {
        self.get(rank).is_some()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// The vector's length, for tests of when it grows.
    #[cfg(test)]
    pub fn dense_len(&self) -> usize {
        self.dense.len()
    }

    /// Values kept in the map, for tests of when they move.
    #[cfg(test)]
    pub fn sparse_len(&self) -> usize {
        self.sparse.len()
    }

    /// Every rank held with its value: the vector's in rank order, then the map's.
    pub fn iter(&self) -> impl Iterator<Item = (u32, &T)> {
        let dense = (0..).zip(&self.dense).filter_map(|(rank, slot): (u32, _)| Some((rank, slot.as_ref()?)));
        dense.chain(self.sparse.iter().map(|(rank, value)| (*rank, value)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ranks as they come, dense or far apart, are found wherever they are kept,
    /// and a far rank moves into the vector once the vector reaches it.
    #[test]
    fn values_are_found_where_kept() {
        let mut by_rank: ByRank<u32> = ByRank::default();
        assert_eq!((by_rank.len(), by_rank.get(0)), (0, None));
        *by_rank.get_or_insert_with(1_000_000, || 7) += 1;
        *by_rank.get_or_insert_with(100, || 5) += 1;
        assert_eq!(by_rank.sparse.len(), 2, "both past the vector's room");
        for rank in 0..40 {
            by_rank.get_or_insert_with(rank, || rank);
        }
        assert_eq!(by_rank.len(), 42);
        assert!(by_rank.dense.len() < 100 && by_rank.sparse.contains_key(&100));
        // A rank past the vector, within twice the ranks held: the vector grows to take
        // it, by half at least and exactly (no room left to double); a rank the map held
        // moves into it once it reaches that rank; 1,000,000 stays in the map.
        let before = by_rank.dense.len();
        by_rank.get_or_insert_with(70, || 70);
        assert_eq!(by_rank.dense.len(), 71.max(before + before / 2));
        assert_eq!(by_rank.dense.capacity(), by_rank.dense.len());
        assert_eq!(by_rank.get_or_insert_with(100, || 0), &mut 6, "moved from the map, not made again");
        assert!(by_rank.dense.len() > 100 && !by_rank.sparse.contains_key(&100));
        assert!(by_rank.sparse.contains_key(&1_000_000));
        assert_eq!(by_rank.get(100), Some(&6));
        assert_eq!(by_rank.get(1_000_000), Some(&8));
        assert_eq!(by_rank.get_or_insert_with(39, || 0), &mut 39, "kept, not made again");
        if let Some(value) = by_rank.get_mut(1_000_000) {
            *value = 9;
        }
        assert!(by_rank.contains(1_000_000) && !by_rank.contains(40) && !by_rank.contains(99));
        assert_eq!(by_rank.len(), 43);
        let ranks: Vec<u32> = by_rank.iter().map(|(rank, _)| rank).collect();
        let mut expected: Vec<u32> = (0..40).chain([70, 100, 1_000_000]).collect();
        expected.sort_unstable();
        assert_eq!(ranks, expected);
        assert_eq!(by_rank.iter().map(|(_, v)| *v).max(), Some(70));
    }
}
