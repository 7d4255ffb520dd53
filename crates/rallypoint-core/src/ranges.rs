//! Sets of ranks as ranges, so that what the engine computes and says about a
//! world costs what it knows (the ranks that connected, arrived or were listed),
//! never the world size a client claimed: the ranks of a world missing from a
//! barrier are the gaps between those that arrived.

use std::fmt;

use crate::{Missing, RankRanges};

/// Ranges `(first, last)` of consecutive ranks of `ranks`, which come in rank order.
pub(crate) fn runs(ranks: impl IntoIterator<Item = u32>) -> impl Iterator<Item = (u32, u32)> {
    let mut ranks = ranks.into_iter().peekable();
    std::iter::from_fn(move || {
        let first = ranks.next()?;
        let mut last = first;
        while let Some(&next) = ranks.peek() {
            if last.checked_add(1) != Some(next) {
                break;
            }
            last = next;
            ranks.next();
        }
        Some((first, last))
    })
}

/// Ranges of the ranks `0..world` not in `excluded`, which come in rank order
/// (repeats and ranks past the world are ignored).
pub(crate) fn gaps(world: u32, excluded: impl IntoIterator<Item = u32>) -> impl Iterator<Item = (u32, u32)> {
    let mut excluded = excluded.into_iter().take_while(move |&r| r < world);
    // The first rank not yet known to be excluded or reported.
    let mut next = Some(0u32).filter(|_| world > 0);
    std::iter::from_fn(move || loop {
        let from = next?;
        match excluded.next() {
            Some(r) if r < from => continue,
            Some(r) if r == from => next = r.checked_add(1).filter(|&n| n < world),
            Some(r) => {
                next = r.checked_add(1).filter(|&n| n < world);
                return Some((from, r - 1));
            }
            None => {
                next = None;
                return Some((from, world - 1));
            }
        }
    })
}

/// Splits a set given as ranges in rank order into its first `named` ranks and
/// the ranges of the rest (bounded, see [`RankRanges`]).
pub(crate) fn split(ranges: impl IntoIterator<Item = (u32, u32)>, named: usize) -> (Vec<u32>, RankRanges) {
    let mut first = Vec::new();
    let mut ranges = ranges.into_iter();
    let mut partial = None;
    for (from, to) in ranges.by_ref() {
        let mut rank = from;
        loop {
            if first.len() == named {
                partial = Some((rank, to));
                break;
            }
            first.push(rank);
            if rank >= to {
                break;
            }
            rank += 1;
        }
        if partial.is_some() {
            break;
        }
    }
    (first, RankRanges::collect(partial.into_iter().chain(ranges)))
}

/// Ranks given as ranges in rank order, as text: the first [`Missing::NAMED`] one
/// by one joined by `sep`, then the rest as ranges ("0, 1, 2 and 997 more: 3-999").
pub(crate) struct RankList {
    named: Vec<u32>,
    rest: RankRanges,
    sep: &'static str,
}

impl RankList {
    pub fn new(ranges: impl IntoIterator<Item = (u32, u32)>, sep: &'static str) -> Self {
        let (named, rest) = split(ranges, Missing::NAMED);
        RankList { named, rest, sep }
    }
}

impl fmt::Display for RankList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, rank) in self.named.iter().enumerate() {
            if i > 0 {
                f.write_str(self.sep)?;
            }
            write!(f, "{rank}")?;
        }
        if !self.rest.is_empty() {
            write!(f, " and {} more: {}", self.rest.count, self.rest)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;

    /// The ranges of a set, the plain way: one rank at a time.
    fn ranges_of(set: &BTreeSet<u32>) -> Vec<(u32, u32)> {
        let mut out: Vec<(u32, u32)> = Vec::new();
        for &r in set {
            match out.last_mut() {
                Some((_, last)) if *last + 1 == r => *last = r,
                _ => out.push((r, r)),
            }
        }
        out
    }

    proptest! {
        #[test]
        fn runs_and_gaps_match_the_plain_way(
            world in 0u32..300,
            excluded in proptest::collection::btree_set(0u32..320, 0..200),
        ) {
            prop_assert_eq!(runs(excluded.iter().copied()).collect::<Vec<_>>(), ranges_of(&excluded));
            let missing: BTreeSet<u32> = (0..world).filter(|r| !excluded.contains(r)).collect();
            prop_assert_eq!(gaps(world, excluded.iter().copied()).collect::<Vec<_>>(), ranges_of(&missing));
        }

        #[test]
        fn split_names_the_first_and_ranges_the_rest(
            set in proptest::collection::btree_set(0u32..400, 0..300),
            named in 0usize..80,
        ) {
            let (first, rest) = split(ranges_of(&set), named);
            let all: Vec<u32> = set.iter().copied().collect();
            let cut = named.min(all.len());
            prop_assert_eq!(&first[..], &all[..cut]);
            let tail: BTreeSet<u32> = all[cut..].iter().copied().collect();
            let mut expected = ranges_of(&tail);
            expected.truncate(RankRanges::SHOWN);
            prop_assert_eq!(rest.count, tail.len() as u64);
            prop_assert_eq!(rest.ranges, expected);
        }
    }

    #[test]
    fn gaps_at_the_ends_of_the_rank_space() {
        assert_eq!(gaps(u32::MAX, [0, 1, u32::MAX - 1]).collect::<Vec<_>>(), vec![(2, u32::MAX - 2)]);
        assert_eq!(gaps(u32::MAX, [5, 5, 6]).collect::<Vec<_>>(), vec![(0, 4), (7, u32::MAX - 1)]);
        assert_eq!(gaps(3, [0, 1, 2, 7]).count(), 0);
        assert_eq!(gaps(0, []).count(), 0);
        assert_eq!(runs([u32::MAX - 1, u32::MAX]).collect::<Vec<_>>(), vec![(u32::MAX - 1, u32::MAX)]);
    }

    #[test]
    fn rank_lists_name_the_first_and_range_the_rest() {
        let short = BTreeSet::from([0, 1, 2, 5]);
        assert_eq!(RankList::new(runs(short.iter().copied()), ", ").to_string(), "0, 1, 2, 5");
        let text = RankList::new([(0, 999)], ",").to_string();
        let first: Vec<String> = (0..64).map(|r| r.to_string()).collect();
        assert_eq!(text, format!("{} and 936 more: 64-999", first.join(",")));
        let many_gaps: Vec<(u32, u32)> = (0..200).map(|i| (10 * i, 10 * i + 1)).collect();
        let text = RankList::new(many_gaps, ", ").to_string();
        // 64 ranks named (32 pairs), 64 more pairs listed, 104 pairs only counted.
        assert!(text.contains(", 311 and 336 more: 320-321, 330-331,"), "{text}");
        assert!(text.ends_with(", 950-951 and 208 more above 951"), "{text}");
    }
}
