//! Slurm's compressed host lists (`SLURM_JOB_NODELIST`, `SLURM_STEP_NODELIST`), such
//! as `node[01-03,07],gpu5`, expanded into host names: what `scontrol show hostnames`
//! prints, without needing Slurm's tools on the node. A launcher under `srun` takes
//! its nodes and the coordinator's host (the first one) from it.
//!
//! The syntax: host entries separated by commas; in an entry, each `[...]` holds
//! numbers and `LO-HI` ranges separated by commas, and stands for each of them in
//! turn. A range keeps the width of its low bound (`[08-10]` is `08 09 10`, `[8-10]`
//! is `8 9 10`). Several brackets in one entry multiply (`r[1-2]n[1-2]` is
//! `r1n1 r1n2 r2n1 r2n2`, the last varying fastest). Hosts come out in the order
//! written, duplicates kept.

use std::ops::RangeInclusive;

/// The most hosts [`expand_nodelist`] returns: far beyond any cluster, yet it keeps
/// a typo such as `n[0-99999999999]` from exhausting memory.
pub const MAX_NODELIST_HOSTS: usize = 1 << 20;

/// A host list that is not valid: the list, and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad Slurm host list '{list}': {problem}")]
pub struct NodelistError {
    pub list: String,
    pub problem: NodelistProblem,
}

/// What is wrong with a host list; positions are byte offsets into it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NodelistProblem {
    #[error("it names no host")]
    Empty,
    #[error("empty host name at byte {at}")]
    EmptyHost { at: usize },
    #[error("'[' at byte {at} is never closed")]
    Unclosed { at: usize },
    #[error("']' at byte {at} closes no '['")]
    Unopened { at: usize },
    #[error("'[' at byte {at} inside another '['")]
    Nested { at: usize },
    #[error("'{item}' in brackets is not a number or a range LO-HI of numbers")]
    BadRange { item: String },
    #[error("range '{item}' runs backwards")]
    Backwards { item: String },
    #[error("it names more than {} hosts", MAX_NODELIST_HOSTS)]
    TooMany,
}

/// The host names of a Slurm host list, in order: `node[01-03,07],gpu5` gives
/// `node01 node02 node03 node07 gpu5`. Surrounding whitespace is ignored.
pub fn expand_nodelist(list: &str) -> Result<Vec<String>, NodelistError> {
    let fail = |problem| NodelistError { list: list.to_owned(), problem };
    let trimmed = list.trim();
    let offset = list.len() - list.trim_start().len();
    if trimmed.is_empty() {
        return Err(fail(NodelistProblem::Empty));
    }
    let mut hosts = Vec::new();
    for (start, entry) in entries(trimmed).map_err(|p| fail(shift(p, offset)))? {
        let parts = parse_entry(entry, offset + start).map_err(fail)?;
        expand_entry(&parts, &mut hosts).map_err(fail)?;
    }
    Ok(hosts)
}

/// One piece of an entry: literal text, or the numbers of one `[...]`.
enum Part<'a> {
    Text(&'a str),
    Numbers(Vec<Numbers>),
}

/// Numbers `LO..=HI` printed zero-padded to `width` digits.
struct Numbers {
    range: RangeInclusive<u64>,
    width: usize,
}

impl Numbers {
    fn count(&self) -> u64 {
        self.range.end() - self.range.start() + 1
    }
}

/// The entries of a list (split at commas outside brackets) with their byte offsets;
/// checks that brackets pair up, without nesting.
fn entries(list: &str) -> Result<Vec<(usize, &str)>, NodelistProblem> {
    let mut found = Vec::new();
    let (mut start, mut open) = (0, None);
    for (at, c) in list.char_indices() {
        match (c, open) {
            ('[', None) => open = Some(at),
            ('[', Some(_)) => return Err(NodelistProblem::Nested { at }),
            (']', Some(_)) => open = None,
            (']', None) => return Err(NodelistProblem::Unopened { at }),
            (',', None) => {
                found.push((start, &list[start..at]));
                start = at + 1;
            }
            _ => {}
        }
    }
    if let Some(at) = open {
        return Err(NodelistProblem::Unclosed { at });
    }
    found.push((start, &list[start..]));
    match found.iter().find(|(_, entry)| entry.is_empty()) {
        Some(&(at, _)) => Err(NodelistProblem::EmptyHost { at }),
        None => Ok(found),
    }
}

fn shift(problem: NodelistProblem, by: usize) -> NodelistProblem {
    match problem {
        NodelistProblem::EmptyHost { at } => NodelistProblem::EmptyHost { at: at + by },
        NodelistProblem::Unclosed { at } => NodelistProblem::Unclosed { at: at + by },
        NodelistProblem::Unopened { at } => NodelistProblem::Unopened { at: at + by },
        NodelistProblem::Nested { at } => NodelistProblem::Nested { at: at + by },
        other => other,
    }
}

/// The parts of one entry (brackets already known to pair up); `at` is its offset.
fn parse_entry(entry: &str, at: usize) -> Result<Vec<Part<'_>>, NodelistProblem> {
    let mut parts = Vec::new();
    let mut rest = entry;
    while let Some(open) = rest.find('[') {
        if open > 0 {
            parts.push(Part::Text(&rest[..open]));
        }
        let close = open + rest[open..].find(']').ok_or(NodelistProblem::Unclosed { at })?;
        let inner = &rest[open + 1..close];
        parts.push(Part::Numbers(inner.split(',').map(parse_numbers).collect::<Result<_, _>>()?));
        rest = &rest[close + 1..];
    }
    if !rest.is_empty() {
        parts.push(Part::Text(rest));
    }
    Ok(parts)
}

fn parse_numbers(item: &str) -> Result<Numbers, NodelistProblem> {
    let bad = || NodelistProblem::BadRange { item: item.to_owned() };
    let number = |digits: &str| -> Result<u64, NodelistProblem> {
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        digits.parse().map_err(|_| bad())
    };
    let (lo, hi) = item.split_once('-').unwrap_or((item, item));
    let (low, high) = (number(lo)?, number(hi)?);
    if low > high {
        return Err(NodelistProblem::Backwards { item: item.to_owned() });
    }
    Ok(Numbers { range: low..=high, width: lo.len() })
}

/// Appends the hosts of one entry: the product of its bracketed sets, the last fastest.
fn expand_entry(parts: &[Part<'_>], hosts: &mut Vec<String>) -> Result<(), NodelistProblem> {
    let total = parts.iter().try_fold(1u64, |total, part| match part {
        Part::Text(_) => Some(total),
        Part::Numbers(sets) => sets.iter().try_fold(0u64, |n, set| n.checked_add(set.count()))?.checked_mul(total),
    });
    match total {
        Some(total) if total <= (MAX_NODELIST_HOSTS - hosts.len()) as u64 => {}
        _ => return Err(NodelistProblem::TooMany),
    }
    let mut names = vec![String::new()];
    for part in parts {
        names = match part {
            Part::Text(text) => names.into_iter().map(|name| name + text).collect(),
            Part::Numbers(sets) => names
                .iter()
                .flat_map(|name| {
                    sets.iter().flat_map(move |set| {
                        set.range.clone().map(move |n| format!("{name}{n:0width$}", width = set.width))
                    })
                })
                .collect(),
        };
    }
    hosts.extend(names);
    Ok(())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn hosts(list: &str) -> Vec<String> {
        expand_nodelist(list).unwrap_or_else(|e| panic!("{e}"))
    }

    fn problem(list: &str) -> NodelistProblem {
        match expand_nodelist(list) {
            Err(e) => {
                assert_eq!(e.list, list);
                e.problem
            }
            Ok(hosts) => panic!("'{list}' expanded to {hosts:?}"),
        }
    }

    #[test]
    fn single_hosts_and_plain_lists() {
        assert_eq!(hosts("gpu5"), ["gpu5"]);
        assert_eq!(hosts("a,b.example.org,c-1"), ["a", "b.example.org", "c-1"]);
        assert_eq!(hosts("  node7\n"), ["node7"]);
    }

    #[test]
    fn ranges_and_numbers_in_brackets() {
        assert_eq!(hosts("node[01-03,07],gpu5"), ["node01", "node02", "node03", "node07", "gpu5"]);
        assert_eq!(hosts("n[3]"), ["n3"]);
        assert_eq!(hosts("n[5,1,3-4]"), ["n5", "n1", "n3", "n4"]);
        assert_eq!(hosts("[1-2]n"), ["1n", "2n"]);
    }

    #[test]
    fn width_is_the_low_bounds() {
        assert_eq!(hosts("n[8-10]"), ["n8", "n9", "n10"]);
        assert_eq!(hosts("n[08-10]"), ["n08", "n09", "n10"]);
        assert_eq!(hosts("n[098-101]"), ["n098", "n099", "n100", "n101"]);
        assert_eq!(hosts("n[0-1]"), ["n0", "n1"]);
    }

    #[test]
    fn several_brackets_multiply_with_the_last_fastest() {
        assert_eq!(hosts("r[1-2]n[1-2]"), ["r1n1", "r1n2", "r2n1", "r2n2"]);
        assert_eq!(hosts("r[1-2]-n[7]x,z"), ["r1-n7x", "r2-n7x", "z"]);
    }

    #[test]
    fn bad_lists_say_what_and_where() {
        assert_eq!(problem(""), NodelistProblem::Empty);
        assert_eq!(problem("  "), NodelistProblem::Empty);
        assert_eq!(problem("a,,b"), NodelistProblem::EmptyHost { at: 2 });
        assert_eq!(problem("a,"), NodelistProblem::EmptyHost { at: 2 });
        assert_eq!(problem(" n[1-2"), NodelistProblem::Unclosed { at: 2 });
        assert_eq!(problem("n1-2]"), NodelistProblem::Unopened { at: 4 });
        assert_eq!(problem("n[1[2]]"), NodelistProblem::Nested { at: 3 });
        assert_eq!(problem("n[]"), NodelistProblem::BadRange { item: String::new() });
        assert_eq!(problem("n[1,,2]"), NodelistProblem::BadRange { item: String::new() });
        assert_eq!(problem("n[a-3]"), NodelistProblem::BadRange { item: "a-3".into() });
        assert_eq!(problem("n[1-2-3]"), NodelistProblem::BadRange { item: "1-2-3".into() });
        assert_eq!(problem("n[+1]"), NodelistProblem::BadRange { item: "+1".into() });
        assert_eq!(
            problem("n[99999999999999999999]"),
            NodelistProblem::BadRange { item: "99999999999999999999".into() }
        );
        assert_eq!(problem("n[5-3]"), NodelistProblem::Backwards { item: "5-3".into() });
        assert_eq!(problem("n[0-99999999999]"), NodelistProblem::TooMany);
        assert_eq!(problem("a[0-1023]b[0-1023]c[0-1]"), NodelistProblem::TooMany);
        assert_eq!(
            expand_nodelist("n[5-3]").unwrap_err().to_string(),
            "bad Slurm host list 'n[5-3]': range '5-3' runs backwards"
        );
    }

    #[test]
    fn the_limit_counts_the_whole_list() {
        assert_eq!(hosts("a[0-1023]b[0-1023]").len(), MAX_NODELIST_HOSTS);
        assert_eq!(problem("a[0-1023]b[0-1023],c"), NodelistProblem::TooMany);
    }

    /// A list written the long way back from hosts, for the round trip below.
    fn compress(prefix: &str, numbers: &[u64], width: usize) -> String {
        let items: Vec<String> = numbers.iter().map(|n| format!("{n:0width$}")).collect();
        format!("{prefix}[{}]", items.join(","))
    }

    proptest! {
        #[test]
        fn expands_what_compress_wrote(
            prefix in "[a-z][a-z0-9-]{0,6}[a-z]",
            numbers in proptest::collection::vec(0u64..5000, 1..20),
            width in 1usize..6,
            lo in 0u64..1000,
            len in 0u64..50,
        ) {
            let list = format!("{},{prefix}[{lo}-{}]", compress(&prefix, &numbers, width), lo + len);
            let mut want: Vec<String> = numbers.iter().map(|n| format!("{prefix}{n:0width$}")).collect();
            want.extend((lo..=lo + len).map(|n| format!("{prefix}{n}")));
            prop_assert_eq!(hosts(&list), want);
        }

        #[test]
        fn never_panics(list in "[a-c0-9,\\[\\]-]{0,24}") {
            let _ = expand_nodelist(&list);
        }
    }
}
