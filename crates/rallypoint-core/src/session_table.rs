//! Values by session, looked up at every request and every reply: the engine's
//! sessions, the server's outboxes.
//!
//! A session id's low 32 bits are its *slot* (see [`SessionId::slot`]). The I/O
//! layer gives the sessions it holds distinct small slots, reusing those freed, and
//! changes the high bits on each reuse, so that an id is never given twice. The
//! table then keeps a session in a vector indexed by its slot: a lookup is one
//! indexed load and a compare of the id, with no hashing, and a release of
//! thousands of ranks walks a few cache lines per rank instead of a hash table's
//! probes. An id whose slot is held by another session (a session the engine still
//! keeps after its connection closed, waiting for a resume) or lies far past the
//! slots held goes to a map. Where an id is kept never changes what a lookup
//! finds, only what it costs: nothing depends on the I/O layer keeping its word.
//!
//! Other keys that are mostly small numbers given in order (a node agent's
//! sub-session numbers) are kept the same way: [`SlotTable`].

use std::collections::HashMap;
use std::hash::Hash;

use crate::SessionId;

/// A key with a slot: where a [`SlotTable`] looks for it first.
pub trait Slotted: Copy + Eq + Hash {
    fn slot(self) -> usize;
}

impl Slotted for SessionId {
    #[inline]
    fn slot(self) -> usize {
        SessionId::slot(self)
    }
}

/// A number is its own slot (one past 32 bits goes to the map).
impl Slotted for u64 {
    #[inline]
    fn slot(self) -> usize {
        usize::try_from(self).ok().filter(|&n| n <= u32::MAX as usize).unwrap_or(usize::MAX)
    }
}

/// Values by session.
pub type SessionTable<T> = SlotTable<SessionId, T>;

#[derive(Debug)]
pub struct SlotTable<K, T> {
    /// By slot: the key that holds it, and its value.
    dense: Vec<Option<(K, T)>>,
    /// Keys whose slot was taken, or far past the vector. Its hash: keys are the I/O
    /// layer's own numbers (see `engine::HashMap`).
    sparse: HashMap<K, T, foldhash::fast::RandomState>,
    /// Values held, in either.
    len: usize,
}

impl<K, T> Default for SlotTable<K, T> {
    fn default() -> Self {
        SlotTable { dense: Vec::new(), sparse: HashMap::default(), len: 0 }
    }
}

impl<K: Slotted, T> SlotTable<K, T> {
    #[inline]
    pub fn get(&self, id: &K) -> Option<&T> {
        match self.dense.get(id.slot()) {
            Some(Some((held, value))) if held == id => Some(value),
            // The common case: nothing ever overflowed.
            _ if self.sparse.is_empty() => None,
            _ => self.sparse.get(id),
        }
    }

    #[inline]
    pub fn get_mut(&mut self, id: &K) -> Option<&mut T> {
        match self.dense.get_mut(id.slot()) {
            Some(Some((held, value))) if held == id => Some(value),
            _ if self.sparse.is_empty() => None,
            _ => self.sparse.get_mut(id),
        }
    }

    /// Whether `id` is kept in its own slot (not in the map for a slot taken), for
    /// tests of where ids go.
    #[cfg(test)]
    fn holds_slot(&self, id: &K) -> bool {
        matches!(self.dense.get(id.slot()), Some(Some((held, _))) if held == id)
    }

    pub fn contains_key(&self, id: &K) -> bool {
        self.get(id).is_some()
    }

    /// Keeps `value` for `id`; returns the value it replaced, if any.
    pub fn insert(&mut self, id: K, value: T) -> Option<T> {
        if let Some(held) = self.get_mut(&id) {
            return Some(std::mem::replace(held, value));
        }
        self.len += 1;
        let at = id.slot();
        grow_to_take(&mut self.dense, at, self.len);
        match self.dense.get_mut(at) {
            Some(slot @ None) => *slot = Some((id, value)),
            _ => {
                self.sparse.insert(id, value);
            }
        }
        None
    }

    pub fn remove(&mut self, id: &K) -> Option<T> {
        let removed = match self.dense.get_mut(id.slot()) {
            Some(slot) if slot.as_ref().is_some_and(|(held, _)| held == id) => slot.take().map(|(_, value)| value),
            _ => self.sparse.remove(id),
        };
        if removed.is_some() {
            self.len -= 1;
        }
        removed
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Every session held with its value, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&K, &T)> {
        let dense = self.dense.iter().filter_map(|slot| slot.as_ref().map(|(id, value)| (id, value)));
        dense.chain(self.sparse.iter())
    }

    pub fn keys(&self) -> impl Iterator<Item = &K> {
        self.iter().map(|(id, _)| id)
    }

    pub fn values(&self) -> impl Iterator<Item = &T> {
        self.iter().map(|(_, value)| value)
    }

    /// Values kept in the map, for tests of where they go.
    #[cfg(test)]
    fn sparse_len(&self) -> usize {
        self.sparse.len()
    }
}

/// Grows a vector indexed by slot (or rank) so that it takes index `at`, if `at` is
/// within twice the `held` values (and a little): by half at a time, and exactly, as
/// a slot may be large (a rank's entry) and a vector left to double on its own would
/// hold up to four per value. Past that, the value belongs in a map. Returns whether
/// the vector grew.
#[inline]
pub(crate) fn grow_to_take<E>(dense: &mut Vec<Option<E>>, at: usize, held: usize) -> bool {
    let room = 2 * held + 64;
    if at < dense.len() || at >= room {
        return false;
    }
    let len = room.min((at + 1).max(dense.len() + dense.len() / 2));
    dense.reserve_exact(len - dense.len());
    dense.resize_with(len, || None);
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn id(slot: u32, serial: u32) -> SessionId {
        SessionId::at(slot, serial)
    }

    /// Slots reused with a new serial, taken twice, or far away: every id is found
    /// where it was put, and only there.
    #[test]
    fn ids_are_found_wherever_kept() {
        let mut table = SessionTable::default();
        for slot in 0..10 {
            assert_eq!(table.insert(id(slot, 1), slot), None);
        }
        assert_eq!(table.sparse_len(), 0);
        // The slot of a session still held, given to another: kept in the map.
        assert_eq!(table.insert(id(3, 2), 30), None);
        assert_eq!(table.insert(id(u32::MAX, 1), 99), None);
        assert_eq!(table.sparse_len(), 2);
        assert!(table.holds_slot(&id(3, 1)) && !table.holds_slot(&id(3, 2)));
        assert_eq!((table.get(&id(3, 1)), table.get(&id(3, 2))), (Some(&3), Some(&30)));
        assert_eq!(table.get(&id(3, 3)), None, "same slot, another serial");
        assert_eq!(table.get(&id(u32::MAX, 1)), Some(&99));
        assert_eq!(table.insert(id(3, 2), 31), Some(30), "replaced, not added");
        assert_eq!(table.len(), 12);
        assert_eq!(table.remove(&id(3, 1)), Some(3));
        assert_eq!(table.remove(&id(3, 1)), None);
        assert_eq!(table.get(&id(3, 2)), Some(&31), "the map's holder of slot 3 is still found");
        *table.get_mut(&id(3, 2)).unwrap() += 1;
        assert_eq!(table.remove(&id(3, 2)), Some(32));
        assert_eq!(table.len(), 10);
        let mut values: Vec<u32> = table.values().copied().collect();
        values.sort_unstable();
        assert_eq!(values, vec![0, 1, 2, 4, 5, 6, 7, 8, 9, 99]);
        assert!(table.keys().all(|k| table.contains_key(k)));
    }

    /// Numbers are their own slots; one past 32 bits is kept in the map.
    #[test]
    fn numbers_keep_to_their_slots() {
        let mut table: SlotTable<u64, u64> = SlotTable::default();
        for n in (1..=40).chain([u64::from(u32::MAX) + 1, 1 << 40]) {
            table.insert(n, n * 2);
        }
        assert_eq!(table.sparse_len(), 2);
        assert!(table.holds_slot(&40) && !table.holds_slot(&(1 << 40)));
        assert_eq!((table.get(&7), table.get(&(1 << 40)), table.get(&41)), (Some(&14), Some(&(1 << 41)), None));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u32, u32, u8),
        Remove(u32, u32),
    }

    fn op() -> impl Strategy<Value = Op> {
        // Few slots and serials, so that ids meet; now and then one far away.
        let slot = prop_oneof![0..8u32, Just(1_000_000u32)];
        prop_oneof![
            (slot.clone(), 0..3u32, any::<u8>()).prop_map(|(s, n, v)| Op::Insert(s, n, v)),
            (slot, 0..3u32).prop_map(|(s, n)| Op::Remove(s, n)),
        ]
    }

    proptest! {
        /// The table behaves as a map of ids, whatever slots the ids share.
        #[test]
        fn behaves_as_a_map(ops in proptest::collection::vec(op(), 0..200)) {
            let mut table = SessionTable::default();
            let mut model = std::collections::HashMap::new();
            for op in ops {
                match op {
                    Op::Insert(slot, serial, v) => {
                        prop_assert_eq!(table.insert(id(slot, serial), v), model.insert(id(slot, serial), v));
                    }
                    Op::Remove(slot, serial) => {
                        prop_assert_eq!(table.remove(&id(slot, serial)), model.remove(&id(slot, serial)));
                    }
                }
                prop_assert_eq!(table.len(), model.len());
                for (k, v) in &model {
                    prop_assert_eq!(table.get(k), Some(v));
                }
                prop_assert_eq!(table.iter().count(), model.len());
            }
        }
    }
}
