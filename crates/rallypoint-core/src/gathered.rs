//! An all-gather's result, as the coordinator makes it and as a client reads it.

use std::fmt;
use std::iter::FusedIterator;
use std::ops::{Index, Range};
use std::slice;
use std::sync::{Arc, OnceLock};

use bytes::Bytes;

/// Bytes of a count or a length in the encoding: a little-endian `u32`.
const LEN_FIELD: usize = 4;

/// An all-gather's result: every member's value in rank order.
///
/// Every member gets the same result, so clones share it whole, for one reference
/// count: the values, and their wire encoding once a codec has made it. Encoding it
/// once per generation instead of once per recipient is what keeps an all-gather's
/// work on the coordinator linear in the number of ranks (each reply is N values long).
///
/// A result read from the wire ([`Gathered::decode`]) keeps the bytes it was read
/// from and where each value lies in them, and slices a value out only when asked.
/// Holding each value as a [`Bytes`] of its own would take N counts on the received
/// buffer and drop them again, for every reply of N values; many ranks in one
/// process, all reading one shared buffer, then contend for that one count.
///
/// Reading it: `g[i]` and `g.get(i)` give the `i`th member's value as `&[u8]` (rank
/// `i`'s when the whole job gathered; over ranks `[2, 3]`, `g[0]` is rank 2's), `&g`
/// and `g.iter()` go through them in rank order, and a result compares equal to a list
/// of byte strings (`assert_eq!(g, [b"a", b"b"])`). For [`Bytes`] of its own (where
/// the all-gather used to return an `Arc<[Bytes]>`): `g.value(i)`, `g.to_vec()`,
/// `Vec::<Bytes>::from(g)`, or `for value in g`. Each such `Bytes`, like a clone of
/// the result, holds the whole reply's memory while it lives (through a node agent,
/// a shared-memory slab the agent cannot reuse until then): to keep a small value
/// long, copy it (`Bytes::copy_from_slice(&g[i])`).
#[derive(Clone)]
pub struct Gathered(Arc<Inner>);

struct Inner {
    form: Form,
    /// Bytes of all the values together.
    values_len: usize,
}

enum Form {
    /// Made from the members' values; encoded by the first reply that needs it.
    Built { values: Box<[Bytes]>, encoding: OnceLock<Bytes> },
    /// Read from `encoding`. `offsets[i]` is where value `i`'s length field starts,
    /// so the value is `encoding[offsets[i] + 4..offsets[i + 1]]`; the last offset is
    /// the end of the encoding. [`Gathered::decode`] checked every one of them.
    Decoded { encoding: Bytes, offsets: Box<[u32]> },
}

impl Gathered {
    /// A result of `values`, in rank order.
    pub fn new(values: impl Into<Box<[Bytes]>>) -> Self {
        let values = values.into();
        let values_len = values.iter().map(Bytes::len).fold(0, usize::saturating_add);
        Gathered(Arc::new(Inner { form: Form::Built { values, encoding: OnceLock::new() }, values_len }))
    }

    /// Splits a result's encoding off the front of `buf` and reads it: a `u32` count,
    /// then each value as a `u32` length and its bytes, all little-endian (the native
    /// protocol's `list<bytes>`, docs/PROTOCOL.md). Every length is checked here, in
    /// one pass, so that no access can fail later; the values are not copied, and the
    /// result keeps the bytes read as its encoding. On error `buf` is left as it was.
    pub fn decode(buf: &mut Bytes) -> Result<Self, MalformedGathered> {
        Self::decode_within(buf, u32::MAX)
    }

    /// [`Gathered::decode`], refusing an encoding longer than `max_len` bytes (the
    /// offsets are `u32`s).
    fn decode_within(buf: &mut Bytes, max_len: u32) -> Result<Self, MalformedGathered> {
        let offsets = offsets(buf, max_len)?;
        let count = offsets.len() - 1;
        let end = offsets[count] as usize;
        // What is not a value is the count and one length field per value.
        let values_len = end - LEN_FIELD * (count + 1);
        let encoding = buf.split_to(end);
        Ok(Gathered(Arc::new(Inner { form: Form::Decoded { encoding, offsets: offsets.into() }, values_len })))
    }

    /// How many values: one per member.
    pub fn len(&self) -> usize {
        match &self.0.form {
            Form::Built { values, .. } => values.len(),
            Form::Decoded { offsets, .. } => offsets.len() - 1,
        }
    }

    /// No values: the all-gather had no members.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The `i`th value (the value of the `i`th member in rank order), if there are
    /// more than `i`.
    pub fn get(&self, i: usize) -> Option<&[u8]> {
        match &self.0.form {
            Form::Built { values, .. } => values.get(i).map(|value| &value[..]),
            Form::Decoded { encoding, offsets } => Some(&encoding[span(offsets, i)?]),
        }
    }

    /// The `i`th value as a [`Bytes`] of its own, sharing the result's memory (not
    /// copied): for keeping one value longer than the result. It holds all of the
    /// result's memory while it lives (see [`Gathered`]).
    pub fn value(&self, i: usize) -> Option<Bytes> {
        match &self.0.form {
            Form::Built { values, .. } => values.get(i).cloned(),
            Form::Decoded { encoding, offsets } => Some(encoding.slice(span(offsets, i)?)),
        }
    }

    /// The values in rank order.
    pub fn iter(&self) -> GatheredIter<'_> {
        GatheredIter(match &self.0.form {
            Form::Built { values, .. } => IterForm::Built(values.iter()),
            Form::Decoded { encoding, offsets } => IterForm::Decoded { encoding, offsets: offsets.windows(2) },
        })
    }

    /// The first value (rank order), if any.
    pub fn first(&self) -> Option<&[u8]> {
        self.get(0)
    }

    /// The last value (rank order), if any.
    pub fn last(&self) -> Option<&[u8]> {
        self.len().checked_sub(1).and_then(|i| self.get(i))
    }

    /// Every value as a [`Bytes`] of its own (see [`Gathered::value`]). Each holds
    /// the whole result's memory (a shared-memory reply's slab too) while it lives.
    pub fn to_vec(&self) -> Vec<Bytes> {
        match &self.0.form {
            Form::Built { values, .. } => values.to_vec(),
            Form::Decoded { encoding, offsets } => {
                offsets.windows(2).map(|pair| encoding.slice(value_span(pair[0], pair[1]))).collect()
            }
        }
    }

    /// Bytes of all the values together.
    pub fn values_len(&self) -> usize {
        self.0.values_len
    }

    /// The encoding made so far, if any (see [`Gathered::encoding`]); a decoded
    /// result's is the bytes it was read from. For codecs.
    #[doc(hidden)]
    pub fn cached_encoding(&self) -> Option<&Bytes> {
        match &self.0.form {
            Form::Built { encoding, .. } => encoding.get(),
            Form::Decoded { encoding, .. } => Some(encoding),
        }
    }

    /// The values' encoding, made by `encode` on first use and shared by every clone
    /// after that; concurrent first uses wait for one `encode` rather than each
    /// making their own. The cache holds one encoding: it belongs to the one wire
    /// format that carries all-gather results (the native protocol's), which
    /// [`Gathered::decode`] reads. A decoded result never calls `encode`. For codecs.
    #[doc(hidden)]
    pub fn encoding(&self, encode: impl FnOnce(&[Bytes]) -> Bytes) -> &Bytes {
        match &self.0.form {
            Form::Built { values, encoding } => encoding.get_or_init(|| encode(values)),
            Form::Decoded { encoding, .. } => encoding,
        }
    }
}

/// Where value `i` lies in a decoded encoding, if there are more than `i` values.
fn span(offsets: &[u32], i: usize) -> Option<Range<usize>> {
    // `i + 1` cannot overflow once `offsets[i]` exists.
    Some(value_span(*offsets.get(i)?, *offsets.get(i + 1)?))
}

/// A value's bytes, from the offset of its length field and that of the next one.
fn value_span(at: u32, next: u32) -> Range<usize> {
    at as usize + LEN_FIELD..next as usize
}

/// The offsets of a decoded result (see [`Form::Decoded`]) read from the start of
/// `buf`: the offset of each value's length field, then the end of the last value.
fn offsets(buf: &[u8], max_len: u32) -> Result<Vec<u32>, MalformedGathered> {
    let count = read_len(buf, 0).ok_or(MalformedGathered::TruncatedCount { left: buf.len() })?;
    let left = buf.len() - LEN_FIELD;
    // Each value takes at least its length field: a count that cannot fit is refused
    // before anything is allocated for it.
    if count as usize > left / LEN_FIELD {
        return Err(MalformedGathered::TooManyValues { count, left });
    }
    let offset = |at: usize| match u32::try_from(at) {
        Ok(at) if at <= max_len => Ok(at),
        _ => Err(MalformedGathered::TooLarge { max_len }),
    };
    let mut offsets = Vec::with_capacity(count as usize + 1);
    let mut at = LEN_FIELD;
    for index in 0..count as usize {
        offsets.push(offset(at)?);
        let len = read_len(buf, at).ok_or(MalformedGathered::TruncatedLength { index, left: buf.len() - at })?;
        at += LEN_FIELD;
        let left = buf.len() - at;
        if len as usize > left {
            return Err(MalformedGathered::ValueTooLong { index, len, left });
        }
        at += len as usize;
    }
    offsets.push(offset(at)?);
    Ok(offsets)
}

/// The little-endian `u32` at `at` in `buf`, if all of it is there.
fn read_len(buf: &[u8], at: usize) -> Option<u32> {
    let field = buf.get(at..at.checked_add(LEN_FIELD)?)?;
    field.try_into().ok().map(u32::from_le_bytes)
}

/// Why bytes are not the encoding of an all-gather's result ([`Gathered::decode`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MalformedGathered {
    #[error("the value count needs 4 bytes, {left} left")]
    TruncatedCount { left: usize },
    #[error("{count} values cannot fit in the {left} bytes left")]
    TooManyValues { count: u32, left: usize },
    #[error("value {index}: its length needs 4 bytes, {left} left")]
    TruncatedLength { index: usize, left: usize },
    #[error("value {index}: {len} bytes cannot fit in the {left} bytes left")]
    ValueTooLong { index: usize, len: u32, left: usize },
    #[error("the values take more than {max_len} bytes")]
    TooLarge { max_len: u32 },
}

/// The `i`th value; panics if there are not more than `i` (see [`Gathered::get`]).
impl Index<usize> for Gathered {
    type Output = [u8];

    fn index(&self, i: usize) -> &[u8] {
        match self.get(i) {
            Some(value) => value,
            None => panic!("index {i} out of range for an all-gather result of {} values", self.len()),
        }
    }
}

/// Every value as a [`Bytes`] of its own, in rank order (see [`Gathered::value`]).
impl IntoIterator for Gathered {
    type Item = Bytes;
    type IntoIter = GatheredIntoIter;

    fn into_iter(self) -> GatheredIntoIter {
        GatheredIntoIter { values: 0..self.len(), gathered: self }
    }
}

/// The values of a [`Gathered`] taken by value ([`IntoIterator`]), each a [`Bytes`].
#[derive(Clone)]
pub struct GatheredIntoIter {
    gathered: Gathered,
    values: Range<usize>,
}

impl Iterator for GatheredIntoIter {
    type Item = Bytes;

    fn next(&mut self) -> Option<Bytes> {
        self.values.next().and_then(|i| self.gathered.value(i))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.values.size_hint()
    }
}

impl DoubleEndedIterator for GatheredIntoIter {
    fn next_back(&mut self) -> Option<Bytes> {
        self.values.next_back().and_then(|i| self.gathered.value(i))
    }
}

impl ExactSizeIterator for GatheredIntoIter {}

impl FusedIterator for GatheredIntoIter {}

/// How many values are left, not the bytes behind them.
impl fmt::Debug for GatheredIntoIter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GatheredIntoIter").field("left", &self.values.len()).finish()
    }
}

impl<'a> IntoIterator for &'a Gathered {
    type Item = &'a [u8];
    type IntoIter = GatheredIter<'a>;

    fn into_iter(self) -> GatheredIter<'a> {
        self.iter()
    }
}

impl From<Gathered> for Vec<Bytes> {
    fn from(gathered: Gathered) -> Self {
        gathered.into_iter().collect()
    }
}

/// A result equals a list of the same values in the same order.
impl<B: AsRef<[u8]>> PartialEq<[B]> for Gathered {
    fn eq(&self, other: &[B]) -> bool {
        self.len() == other.len() && self.iter().zip(other).all(|(value, other)| value == other.as_ref())
    }
}

impl<B: AsRef<[u8]>> PartialEq<Vec<B>> for Gathered {
    fn eq(&self, other: &Vec<B>) -> bool {
        *self == other[..]
    }
}

impl<B: AsRef<[u8]>, const N: usize> PartialEq<[B; N]> for Gathered {
    fn eq(&self, other: &[B; N]) -> bool {
        *self == other[..]
    }
}

impl<B: AsRef<[u8]>> PartialEq<&[B]> for Gathered {
    fn eq(&self, other: &&[B]) -> bool {
        *self == other[..]
    }
}

impl<B: AsRef<[u8]>> PartialEq<Gathered> for Vec<B> {
    fn eq(&self, other: &Gathered) -> bool {
        *other == self[..]
    }
}

impl From<Gathered> for Arc<[Bytes]> {
    fn from(gathered: Gathered) -> Self {
        gathered.into_iter().collect()
    }
}

/// An empty result (no members).
impl Default for Gathered {
    fn default() -> Self {
        Gathered::new(Vec::new())
    }
}

/// As the values are: equal results hash alike, whichever form each has.
impl std::hash::Hash for Gathered {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write_usize(self.len());
        for value in self {
            value.hash(state);
        }
    }
}

/// Equal values make equal results, however each was made and whether or not
/// either is encoded yet.
impl PartialEq for Gathered {
    fn eq(&self, other: &Self) -> bool {
        // The shared result of N members is told apart from itself without comparing
        // N values each time.
        Arc::ptr_eq(&self.0, &other.0)
            || (self.len() == other.len() && self.values_len() == other.values_len() && self.iter().eq(other.iter()))
    }
}

impl Eq for Gathered {}

/// The values, as a list of byte strings.
impl fmt::Debug for Gathered {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Each as `Bytes` prints one (`b"..."`, escaped), whichever the form.
        f.debug_list().entries((0..self.len()).filter_map(|i| self.value(i))).finish()
    }
}

/// The values of a [`Gathered`] in rank order ([`Gathered::iter`]).
#[derive(Clone)]
pub struct GatheredIter<'a>(IterForm<'a>);

/// How many values are left, not the bytes behind them (a reply can be large).
impl fmt::Debug for GatheredIter<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GatheredIter").field("left", &self.len()).finish()
    }
}

#[derive(Clone)]
enum IterForm<'a> {
    Built(slice::Iter<'a, Bytes>),
    Decoded { encoding: &'a [u8], offsets: slice::Windows<'a, u32> },
}

impl<'a> Iterator for GatheredIter<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        match &mut self.0 {
            IterForm::Built(values) => values.next().map(|value| &value[..]),
            IterForm::Decoded { encoding, offsets } => {
                offsets.next().map(|pair| &encoding[value_span(pair[0], pair[1])])
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        match &self.0 {
            IterForm::Built(values) => values.size_hint(),
            IterForm::Decoded { offsets, .. } => offsets.size_hint(),
        }
    }
}

impl<'a> DoubleEndedIterator for GatheredIter<'a> {
    fn next_back(&mut self) -> Option<&'a [u8]> {
        match &mut self.0 {
            IterForm::Built(values) => values.next_back().map(|value| &value[..]),
            IterForm::Decoded { encoding, offsets } => {
                offsets.next_back().map(|pair| &encoding[value_span(pair[0], pair[1])])
            }
        }
    }
}

impl ExactSizeIterator for GatheredIter<'_> {}

impl FusedIterator for GatheredIter<'_> {}

#[cfg(test)]
mod tests {
    use super::*;

    /// `values` in the layout `decode` reads, as a codec writes it.
    fn encode(values: &[&[u8]]) -> Vec<u8> {
        let mut out = u32::try_from(values.len()).expect("a short list").to_le_bytes().to_vec();
        for value in values {
            out.extend_from_slice(&u32::try_from(value.len()).expect("a short value").to_le_bytes());
            out.extend_from_slice(value);
        }
        out
    }

    fn decoded(values: &[&[u8]]) -> Gathered {
        let mut buf = Bytes::from(encode(values));
        let gathered = Gathered::decode(&mut buf).expect("decodes");
        assert!(buf.is_empty(), "{} bytes left", buf.len());
        gathered
    }

    /// The same values made both ways.
    fn both(values: &[&[u8]]) -> [Gathered; 2] {
        [Gathered::new(values.iter().map(|v| Bytes::copy_from_slice(v)).collect::<Vec<_>>()), decoded(values)]
    }

    fn malformed(bytes: &[u8]) -> MalformedGathered {
        let mut buf = Bytes::copy_from_slice(bytes);
        let error = Gathered::decode(&mut buf).expect_err("malformed");
        assert_eq!(&buf[..], bytes, "a failed decode consumed bytes");
        error
    }

    #[test]
    fn both_forms_give_the_values_in_order() {
        let values: [&[u8]; 4] = [b"zero", b"", b"two", b"\x00\xff"];
        for gathered in both(&values) {
            assert_eq!(gathered.len(), 4);
            assert!(!gathered.is_empty());
            assert_eq!(gathered.values_len(), 4 + 3 + 2);
            for (i, value) in values.iter().enumerate() {
                assert_eq!(gathered.get(i), Some(*value));
                assert_eq!(&gathered[i], *value);
                assert_eq!(gathered.value(i).as_deref(), Some(*value));
            }
            assert_eq!(gathered.get(4), None);
            assert_eq!(gathered.get(usize::MAX), None);
            assert_eq!(gathered.value(4), None);
            assert_eq!(gathered.iter().collect::<Vec<_>>(), values);
            assert_eq!(gathered.iter().rev().collect::<Vec<_>>(), [values[3], values[2], values[1], values[0]]);
            assert_eq!((&gathered).into_iter().len(), 4);
            let mut iter = gathered.iter();
            iter.next();
            assert_eq!(iter.len(), 3);
            assert_eq!(iter.size_hint(), (3, Some(3)));
            assert_eq!(gathered.to_vec(), values.map(Bytes::copy_from_slice));
            assert_eq!(format!("{gathered:?}"), r#"[b"zero", b"", b"two", b"\0\xff"]"#);
        }
    }

    #[test]
    fn an_empty_result_in_both_forms() {
        for gathered in both(&[]) {
            assert_eq!(gathered.len(), 0);
            assert!(gathered.is_empty());
            assert_eq!(gathered.values_len(), 0);
            assert_eq!(gathered.get(0), None);
            assert_eq!(gathered.iter().next(), None);
            assert!(gathered.to_vec().is_empty());
            assert_eq!(format!("{gathered:?}"), "[]");
        }
    }

    #[test]
    #[should_panic(expected = "index 2 out of range for an all-gather result of 2 values")]
    fn indexing_past_the_end_panics() {
        let [_, gathered] = both(&[b"a", b"b"]);
        let _ = &gathered[2];
    }

    #[test]
    fn equality_is_by_value_across_forms() {
        let [built, decoded] = both(&[b"a", b"bc"]);
        assert_eq!(built, decoded);
        assert_eq!(decoded, built);
        assert_eq!(built, built.clone());
        let different: [&[&[u8]]; 5] = [&[b"a", b"bd"], &[b"a"], &[b"a", b"bc", b""], &[b"ab", b"c"], &[]];
        for values in different {
            for other in both(values) {
                assert_ne!(built, other, "{values:?}");
                assert_ne!(decoded, other, "{values:?}");
                assert_ne!(other, decoded, "{values:?}");
            }
        }
    }

    #[test]
    fn a_clone_shares_the_result_and_its_encoding() {
        let [built, _] = both(&[b"a", b"b"]);
        let copy = built.clone();
        assert!(Arc::ptr_eq(&built.0, &copy.0));
        assert_eq!(built.cached_encoding(), None);
        let encoding = built.encoding(|values| Bytes::from(encode(&values.iter().map(|v| &v[..]).collect::<Vec<_>>())));
        assert_eq!(copy.cached_encoding(), Some(encoding));
        // Made once: a second `encode` is never called.
        assert_eq!(copy.encoding(|_| unreachable!("encoded twice")).as_ptr(), encoding.as_ptr());
    }

    #[test]
    fn a_decoded_result_slices_the_bytes_it_was_read_from() {
        let mut buf = Bytes::from([encode(&[b"first", b"second"]), b"next field".to_vec()].concat());
        let received = buf.as_ptr_range();
        let gathered = Gathered::decode(&mut buf).expect("decodes");
        assert_eq!(&buf[..], b"next field", "only the result is split off");
        let encoding = gathered.cached_encoding().expect("its encoding");
        assert_eq!(&encoding[..], encode(&[b"first", b"second"]));
        assert_eq!(gathered.encoding(|_| unreachable!("re-encoded")), encoding);
        for value in gathered.iter().chain(gathered.value(1).as_deref()) {
            assert!(received.contains(&value.as_ptr()), "value {value:?} was copied");
        }
        assert_eq!(gathered.values_len(), 11);
    }

    #[test]
    fn malformed_encodings_are_refused() {
        assert_eq!(malformed(&[]), MalformedGathered::TruncatedCount { left: 0 });
        assert_eq!(malformed(&[1, 0, 0]), MalformedGathered::TruncatedCount { left: 3 });
        // Three values need at least 12 bytes.
        assert_eq!(malformed(&[3, 0, 0, 0, 0, 0, 0, 0]), MalformedGathered::TooManyValues { count: 3, left: 4 });
        assert_eq!(
            malformed(&[0xff, 0xff, 0xff, 0xff, 0, 0]),
            MalformedGathered::TooManyValues { count: u32::MAX, left: 2 }
        );
        // The second value's length field is cut short.
        let mut bytes = encode(&[b"abcdefgh", b"x"]);
        bytes.truncate(4 + 12 + 2);
        assert_eq!(malformed(&bytes), MalformedGathered::TruncatedLength { index: 1, left: 2 });
        // The second value runs past the end.
        let mut bytes = encode(&[b"a", b"bcdef"]);
        bytes.pop();
        assert_eq!(malformed(&bytes), MalformedGathered::ValueTooLong { index: 1, len: 5, left: 4 });
        let bytes = [&[1, 0, 0, 0][..], &u32::MAX.to_le_bytes()].concat();
        assert_eq!(malformed(&bytes), MalformedGathered::ValueTooLong { index: 0, len: u32::MAX, left: 0 });
        assert_eq!(
            MalformedGathered::ValueTooLong { index: 1, len: 5, left: 4 }.to_string(),
            "value 1: 5 bytes cannot fit in the 4 bytes left"
        );
    }

    #[test]
    fn first_last_and_comparison_with_a_list() {
        for gathered in both(&[b"a", b"", b"c"]) {
            assert_eq!((gathered.first(), gathered.last()), (Some(&b"a"[..]), Some(&b"c"[..])));
            assert_eq!(gathered, vec![&b"a"[..], b"", b"c"]);
            assert_ne!(gathered, vec![&b"a"[..], b"", b"d"]);
            assert_ne!(gathered, vec![&b"a"[..], b""]);
            assert_eq!(Vec::<Bytes>::from(gathered.clone()), [Bytes::from("a"), Bytes::new(), Bytes::from("c")]);
            assert_eq!(format!("{:?}", gathered.iter()), "GatheredIter { left: 3 }");
            assert_eq!(gathered, [b"a".as_slice(), b"", b"c"]);
            assert_eq!(gathered, &[b"a".as_slice(), b"", b"c"][..]);
            assert_eq!(vec![b"a".to_vec(), vec![], b"c".to_vec()], gathered);
            let shared: Arc<[Bytes]> = gathered.clone().into();
            assert_eq!(gathered, shared[..]);
            let mut owned = gathered.clone().into_iter();
            assert_eq!((owned.len(), format!("{owned:?}")), (3, "GatheredIntoIter { left: 3 }".to_owned()));
            assert_eq!((owned.next_back(), owned.next()), (Some(Bytes::from("c")), Some(Bytes::from("a"))));
            assert_eq!(owned.collect::<Vec<_>>(), [Bytes::new()]);
        }
        // Equal results hash alike across forms; a default is the empty result.
        use std::hash::BuildHasher;
        let [built, decoded] = both(&[b"a", b"", b"c"]);
        let state = std::hash::RandomState::new();
        assert_eq!(state.hash_one(&built), state.hash_one(&decoded));
        assert_ne!(state.hash_one(&built), state.hash_one(&both(&[b"a", b"c", b""])[1]));
        assert_eq!(Gathered::default(), both(&[])[1]);
        for gathered in both(&[]) {
            assert_eq!((gathered.first(), gathered.last()), (None, None));
            assert_eq!(gathered, Vec::<Bytes>::new());
        }
    }

    proptest::proptest! {
        /// Whatever the bytes, decoding never panics; what it accepts is a prefix that
        /// encodes its values again exactly, and what it refuses is left as it was.
        #[test]
        fn any_bytes_decode_to_what_they_encode_or_are_refused(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64),
            values in proptest::collection::vec(proptest::collection::vec(proptest::prelude::any::<u8>(), 0..8), 0..6),
            cut in 0usize..64,
        ) {
            // Random bytes (mostly refused), and valid encodings cut short or with
            // bytes after them (accepted only whole).
            let valid = encode(&values.iter().map(Vec::as_slice).collect::<Vec<_>>());
            let mut cut_short = valid.clone();
            cut_short.truncate(cut.min(valid.len()));
            let mut longer = valid.clone();
            longer.extend_from_slice(&bytes);
            for input in [bytes.clone(), cut_short, longer] {
                let mut buf = Bytes::from(input.clone());
                match Gathered::decode(&mut buf) {
                    Ok(gathered) => {
                        let taken = input.len() - buf.len();
                        let again = encode(&gathered.iter().collect::<Vec<_>>());
                        proptest::prop_assert_eq!(&again[..], &input[..taken]);
                        proptest::prop_assert_eq!(gathered.values_len(), gathered.iter().map(<[u8]>::len).sum::<usize>());
                    }
                    Err(_) => proptest::prop_assert_eq!(&buf[..], &input[..]),
                }
            }
            let mut buf = Bytes::from(valid.clone());
            let gathered = Gathered::decode(&mut buf).expect("a valid encoding");
            proptest::prop_assert!(buf.is_empty());
            proptest::prop_assert_eq!(gathered, values);
        }
    }

    #[test]
    fn an_encoding_longer_than_its_offsets_reach_is_refused() {
        let bytes = encode(&[b"abc", b"de"]);
        let fits = u32::try_from(bytes.len()).expect("short");
        let decoded = Gathered::decode_within(&mut Bytes::from(bytes.clone()), fits).expect("fits");
        assert_eq!(decoded.iter().collect::<Vec<_>>(), [&b"abc"[..], b"de"]);
        let mut buf = Bytes::from(bytes);
        let error = Gathered::decode_within(&mut buf, fits - 1).expect_err("too long");
        assert_eq!(error, MalformedGathered::TooLarge { max_len: fits - 1 });
        assert_eq!(buf.len(), fits as usize, "a failed decode consumed bytes");
    }
}
