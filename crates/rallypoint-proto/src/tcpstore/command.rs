//! Client requests: the incremental decoder and (for tests and tools) the encoder.
//!
//! A request has no length prefix, so whether it is whole is only known by parsing it
//! field by field. [`CommandDecoder`] remembers how far it got: each field is
//! *announced* once (an integer by its position, a key or value by its length
//! prefix), checked against the limits at that moment, and recorded as the span of
//! its bytes in the caller's buffer. A later call replays the few fixed fields
//! (at most three) from those spans and resumes a list where it stopped, so a
//! request fed in pieces costs work proportional to its length, however small the
//! pieces; the bytes of keys and values are never read, only sliced.
//!
//! [`command`] is the one table of query types and their fields in wire order. It
//! runs over the buffer to find where the request ends (keys and values come out
//! empty) and, once it is whole, over the frozen request to build it.

use bytes::{BufMut, Bytes, BytesMut};
use rallypoint_core::Limits;

use super::query;

/// Size limits enforced while decoding. Defaults are those of torch's libuv server,
/// plus [`TcpLimits::max_request_len`], which torch does not have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpLimits {
    pub max_key_len: usize,
    pub max_value_len: usize,
    /// Most keys in one CHECK, WAIT, MULTI_GET or MULTI_SET.
    pub max_keys: usize,
    /// Largest sum of the keys and values of one request (a MULTI_SET's entries, a
    /// WAIT's keys), checked against the running total as each length arrives.
    pub max_request_len: usize,
}

impl Default for TcpLimits {
    fn default() -> Self {
        TcpLimits::from_limits(&Limits::default())
    }
}

impl TcpLimits {
    /// The engine's limits, so that the codec never accepts what the engine refuses.
    pub fn from_limits(limits: &Limits) -> Self {
        TcpLimits {
            max_key_len: limits.max_key_len,
            max_value_len: limits.max_value_len,
            max_keys: limits.max_keys_per_op,
            max_request_len: crate::max_request_len(limits),
        }
    }
}

/// One request of a TCPStore client. Keys and values are views into the read buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    Validate { magic: u32 },
    Set { key: Bytes, value: Bytes },
    CompareSet { key: Bytes, expected: Bytes, desired: Bytes },
    Get { key: Bytes },
    Add { key: Bytes, delta: i64 },
    Check { keys: Vec<Bytes> },
    Wait { keys: Vec<Bytes> },
    NumKeys,
    DeleteKey { key: Bytes },
    Append { key: Bytes, value: Bytes },
    MultiGet { keys: Vec<Bytes> },
    MultiSet { entries: Vec<(Bytes, Bytes)> },
    CancelWait,
    Ping { nonce: u32 },
    QueuePush { key: Bytes, value: Bytes },
    QueuePop { key: Bytes },
    QueueLen { key: Bytes },
    ListKeys,
    Barrier { key: Bytes, world_size: i64 },
}

impl Command {
    /// The query type: the first byte of the request on the wire.
    pub fn query_type(&self) -> u8 {
        match self {
            Command::Validate { .. } => query::VALIDATE,
            Command::Set { .. } => query::SET,
            Command::CompareSet { .. } => query::COMPARE_SET,
            Command::Get { .. } => query::GET,
            Command::Add { .. } => query::ADD,
            Command::Check { .. } => query::CHECK,
            Command::Wait { .. } => query::WAIT,
            Command::NumKeys => query::GETNUMKEYS,
            Command::DeleteKey { .. } => query::DELETE_KEY,
            Command::Append { .. } => query::APPEND,
            Command::MultiGet { .. } => query::MULTI_GET,
            Command::MultiSet { .. } => query::MULTI_SET,
            Command::CancelWait => query::CANCEL_WAIT,
            Command::Ping { .. } => query::PING,
            Command::QueuePush { .. } => query::QUEUE_PUSH,
            Command::QueuePop { .. } => query::QUEUE_POP,
            Command::QueueLen { .. } => query::QUEUE_LEN,
            Command::ListKeys => query::LIST_KEYS,
            Command::Barrier { .. } => query::BARRIER,
        }
    }

    /// torch's name of the query type, for logs.
    pub fn name(&self) -> &'static str {
        query::name(self.query_type())
    }
}

/// Input that ends a TCPStore connection: after it the stream cannot be trusted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TcpError {
    #[error("unknown TCPStore query type {0}")]
    UnknownType(u8),
    #[error("TCPStore {what} of {len} exceeds the limit of {limit}")]
    TooLarge { what: &'static str, len: u64, limit: u64 },
    /// The keys and values a request announced so far add up to more than
    /// [`TcpLimits::max_request_len`]; refused before the rest of it is buffered.
    #[error(
        "TCPStore {query} request carries at least {len} bytes of keys and values, over max_request_len ({limit})"
    )]
    RequestTooLarge { query: &'static str, len: u64, limit: u64 },
}

/// Decodes one whole request from the front of `src` and consumes it; `Ok(None)`
/// (nothing consumed) while the request is incomplete.
///
/// Starts from scratch on every call, so a request that arrives in many pieces is
/// parsed again from its start each time: a connection uses a [`CommandDecoder`].
pub fn decode_command(src: &mut BytesMut, limits: &TcpLimits) -> Result<Option<Command>, TcpError> {
    CommandDecoder::new(*limits).decode(src)
}

/// `Ok(None)` = need more bytes.
type Step<T> = Result<Option<T>, TcpError>;

/// Unwraps a step: returns `Ok(None)` from the caller when bytes are missing.
macro_rules! need {
    ($e:expr) => {
        match $e? {
            Some(v) => v,
            None => return Ok(None),
        }
    };
}

/// A byte range of the caller's buffer, from the start of the request in progress.
type Span = (usize, usize);

/// The incremental decoder of one connection's requests (sans-I/O).
///
/// The caller appends what it reads to its buffer and calls [`CommandDecoder::decode`]
/// until it returns `Ok(None)`. Between calls the caller only appends to the buffer:
/// the decoder consumes a request from its front when it returns it, and remembers
/// where it stopped in the bytes before. (If the buffer shrank anyway, the decoder
/// starts over from its front.) After an error the stream cannot be trusted; every
/// later call returns the same error.
///
/// The bytes of a request in progress stay in the caller's buffer (its length is
/// what an unfinished request holds); the decoder keeps 16 bytes per field announced,
/// at most two per key a request may carry, plus three.
#[derive(Debug)]
pub struct CommandDecoder {
    limits: TcpLimits,
    /// The query type of the request in progress, once its first byte has arrived.
    kind: Option<u8>,
    /// Every field of the request in progress announced so far, in wire order (the
    /// contents of a key or value, without its length). Only the last one may
    /// still be incomplete.
    fields: Vec<Span>,
    /// Where the next field starts: the end of the last announced one.
    end: usize,
    /// Sum of the key and value lengths announced so far.
    carried: u64,
    /// The buffer's length when the last call returned.
    seen: usize,
    examined: u64,
}

/// Spans kept between requests; a list longer than this is freed once decoded, so
/// that one large request does not pin its bookkeeping for the connection's life.
const KEEP_FIELDS: usize = 64;

impl CommandDecoder {
    pub fn new(limits: TcpLimits) -> Self {
        CommandDecoder { limits, kind: None, fields: Vec::new(), end: 0, carried: 0, seen: 0, examined: 0 }
    }

    pub fn limits(&self) -> &TcpLimits {
        &self.limits
    }

    /// Decodes the next whole request at the front of `src` and consumes it; `Ok(None)`
    /// (nothing consumed) while it is incomplete. A call costs a constant plus work in
    /// proportion to the lengths and integers that arrived since the last one, never
    /// in proportion to what is buffered; the call that completes a request builds it.
    pub fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Command>, TcpError> {
        if src.len() < self.seen {
            self.reset();
        }
        self.seen = src.len();
        let kind = match self.kind {
            Some(kind) => kind,
            None => {
                let Some(&kind) = src.first() else { return Ok(None) };
                self.examined += 1;
                self.kind = Some(kind);
                self.end = 1;
                kind
            }
        };
        if command(kind, &mut Pass { dec: self, buf: src, whole: None, next: 0 })?.is_none() {
            return Ok(None);
        }
        let whole = src.split_to(self.end).freeze();
        let built = command(kind, &mut Pass { dec: self, buf: &whole, whole: Some(&whole), next: 0 });
        self.reset();
        self.seen = src.len();
        built
    }

    /// True while part of a request has been decoded and the rest is awaited.
    pub fn is_mid_request(&self) -> bool {
        self.kind.is_some()
    }

    /// Bytes of input this decoder has read so far (query types, lengths, counts and
    /// integers; keys and values are sliced, never read), re-reads included: a
    /// measure of its work, which stays proportional to the bytes decoded.
    pub fn bytes_examined(&self) -> u64 {
        self.examined
    }

    fn reset(&mut self) {
        self.kind = None;
        self.end = 0;
        self.carried = 0;
        self.seen = 0;
        if self.fields.capacity() > KEEP_FIELDS {
            self.fields = Vec::new();
        } else {
            self.fields.clear();
        }
    }
}

/// Every query type and its fields, in wire order (struct literal fields are
/// evaluated in source order). `Ok(None)`: the request is not whole yet.
fn command(kind: u8, r: &mut Pass<'_>) -> Step<Command> {
    Ok(Some(match kind {
        query::VALIDATE => Command::Validate { magic: need!(r.u32()) },
        query::SET => Command::Set { key: need!(r.key()), value: need!(r.value()) },
        query::COMPARE_SET => {
            Command::CompareSet { key: need!(r.key()), expected: need!(r.value()), desired: need!(r.value()) }
        }
        query::GET => Command::Get { key: need!(r.key()) },
        query::ADD => Command::Add { key: need!(r.key()), delta: need!(r.i64()) },
        query::CHECK => Command::Check { keys: need!(r.keys()) },
        query::WAIT => Command::Wait { keys: need!(r.keys()) },
        query::GETNUMKEYS => Command::NumKeys,
        query::DELETE_KEY => Command::DeleteKey { key: need!(r.key()) },
        query::APPEND => Command::Append { key: need!(r.key()), value: need!(r.value()) },
        query::MULTI_GET => Command::MultiGet { keys: need!(r.keys()) },
        query::MULTI_SET => Command::MultiSet { entries: need!(r.entries()) },
        query::CANCEL_WAIT => Command::CancelWait,
        query::PING => Command::Ping { nonce: need!(r.u32()) },
        query::QUEUE_PUSH => Command::QueuePush { key: need!(r.key()), value: need!(r.value()) },
        query::QUEUE_POP => Command::QueuePop { key: need!(r.key()) },
        query::QUEUE_LEN => Command::QueueLen { key: need!(r.key()) },
        query::LIST_KEYS => Command::ListKeys,
        query::BARRIER => Command::Barrier { key: need!(r.key()), world_size: need!(r.i64()) },
        other => return Err(TcpError::UnknownType(other)),
    }))
}

/// What announces a field, and what it is checked against.
#[derive(Clone, Copy)]
enum Shape {
    /// A fixed-size integer.
    Int(usize),
    /// A u64 length, then that many bytes.
    Blob { what: &'static str, limit: fn(&TcpLimits) -> usize },
}

const KEY: Shape = Shape::Blob { what: "key length", limit: |l| l.max_key_len };
const VALUE: Shape = Shape::Blob { what: "value length", limit: |l| l.max_value_len };

/// One run of [`command`] over the request in progress: over the caller's buffer to
/// learn whether it is whole (`whole` is `None`: keys and values come out empty),
/// or over the whole request, frozen, to build it.
struct Pass<'a> {
    dec: &'a mut CommandDecoder,
    buf: &'a [u8],
    whole: Option<&'a Bytes>,
    /// Index in `dec.fields` of the next field the arm reads.
    next: usize,
}

impl Pass<'_> {
    /// The next field's span once all its bytes are here. A field announced by an
    /// earlier call is replayed; a new one is announced (and checked) first.
    fn field(&mut self, shape: Shape) -> Step<Span> {
        if self.next == self.dec.fields.len() {
            let span = need!(self.announce(shape));
            self.dec.fields.push(span);
            self.dec.end = span.1;
        }
        match self.dec.fields.get(self.next) {
            Some(&span) if span.1 <= self.buf.len() => {
                self.next += 1;
                Ok(Some(span))
            }
            _ => Ok(None),
        }
    }

    /// Reads what announces a field starting at `dec.end`: nothing for an integer,
    /// the length (checked at once) for a key or value.
    fn announce(&mut self, shape: Shape) -> Step<Span> {
        let start = self.dec.end;
        let (start, len) = match shape {
            Shape::Int(n) => (start, n),
            Shape::Blob { what, limit } => {
                let Some(len) = self.int::<8>(start).map(u64::from_le_bytes) else { return Ok(None) };
                let limits = &self.dec.limits;
                let limit = limit(limits) as u64;
                if len > limit {
                    return Err(TcpError::TooLarge { what, len, limit });
                }
                let carried = self.dec.carried.saturating_add(len);
                if carried > limits.max_request_len as u64 {
                    let query = query::name(self.dec.kind.unwrap_or_default());
                    return Err(TcpError::RequestTooLarge {
                        query,
                        len: carried,
                        limit: limits.max_request_len as u64,
                    });
                }
                self.dec.carried = carried;
                // Fits in usize: at most `limit`.
                (start + 8, len as usize)
            }
        };
        // Saturates only under limits near usize::MAX: such a field never arrives.
        Ok(Some((start, start.saturating_add(len))))
    }

    /// The `N` bytes at `at`, if they have arrived.
    fn int<const N: usize>(&mut self, at: usize) -> Option<[u8; N]> {
        self.dec.examined += N as u64;
        self.buf.get(at..at.checked_add(N)?)?.try_into().ok()
    }

    fn fixed<const N: usize>(&mut self) -> Step<[u8; N]> {
        let (start, _) = need!(self.field(Shape::Int(N)));
        Ok(self.int(start))
    }

    fn u32(&mut self) -> Step<u32> {
        Ok(Some(u32::from_le_bytes(need!(self.fixed()))))
    }

    fn i64(&mut self) -> Step<i64> {
        Ok(Some(i64::from_le_bytes(need!(self.fixed()))))
    }

    fn bytes(&self, (start, end): Span) -> Bytes {
        self.whole.map_or_else(Bytes::new, |whole| whole.slice(start..end))
    }

    fn blob(&mut self, shape: Shape) -> Step<Bytes> {
        let span = need!(self.field(shape));
        Ok(Some(self.bytes(span)))
    }

    fn key(&mut self) -> Step<Bytes> {
        self.blob(KEY)
    }

    fn value(&mut self) -> Step<Bytes> {
        self.blob(VALUE)
    }

    /// A u64 count (checked against `max_keys`), then that many items, each of the
    /// fields `item`. Resumes at the list's last announced field: the ones before it
    /// are whole. Returns the indices in `dec.fields` of the items' fields.
    fn list(&mut self, item: &[Shape]) -> Step<std::ops::Range<usize>> {
        let count = u64::from_le_bytes(need!(self.fixed()));
        let limit = self.dec.limits.max_keys as u64;
        if count > limit {
            return Err(TcpError::TooLarge { what: "number of keys", len: count, limit });
        }
        // Fits in usize: at most `max_keys`.
        let first = self.next;
        let end = first.saturating_add((count as usize).saturating_mul(item.len()));
        self.next = first.max(self.dec.fields.len().saturating_sub(1));
        while self.next < end {
            need!(self.field(item[(self.next - first) % item.len()]));
        }
        Ok(Some(first..end))
    }

    /// Keys and values come out only when the request is whole (see [`Pass`]).
    fn keys(&mut self) -> Step<Vec<Bytes>> {
        let items = need!(self.list(&[KEY]));
        if self.whole.is_none() {
            return Ok(Some(Vec::new()));
        }
        Ok(Some(self.dec.fields.get(items).unwrap_or_default().iter().map(|&span| self.bytes(span)).collect()))
    }

    fn entries(&mut self) -> Step<Vec<(Bytes, Bytes)>> {
        let items = need!(self.list(&[KEY, VALUE]));
        if self.whole.is_none() {
            return Ok(Some(Vec::new()));
        }
        let entries = self.dec.fields.get(items).unwrap_or_default().chunks_exact(2);
        Ok(Some(entries.map(|pair| (self.bytes(pair[0]), self.bytes(pair[1]))).collect()))
    }
}

/// Appends fields after the query type, chained in wire order.
struct Fields<'a>(&'a mut BytesMut);

impl Fields<'_> {
    fn u32(self, n: u32) -> Self {
        self.0.put_u32_le(n);
        self
    }

    fn i64(self, n: i64) -> Self {
        self.0.put_i64_le(n);
        self
    }

    fn blob(self, b: &[u8]) -> Self {
        self.0.put_u64_le(b.len() as u64);
        self.0.put_slice(b);
        self
    }

    fn count(self, n: usize) -> Self {
        self.0.put_u64_le(n as u64);
        self
    }

    fn keys(self, keys: &[Bytes]) -> Self {
        keys.iter().fold(self.count(keys.len()), |w, key| w.blob(key))
    }

    fn entries(self, entries: &[(Bytes, Bytes)]) -> Self {
        entries.iter().fold(self.count(entries.len()), |w, (key, value)| w.blob(key).blob(value))
    }
}

/// Appends `command` as a torch client sends it.
pub fn encode_command(command: &Command, dst: &mut BytesMut) {
    dst.put_u8(command.query_type());
    let w = Fields(dst);
    match command {
        Command::Validate { magic } => w.u32(*magic),
        Command::Set { key, value } => w.blob(key).blob(value),
        Command::CompareSet { key, expected, desired } => w.blob(key).blob(expected).blob(desired),
        Command::Get { key } => w.blob(key),
        Command::Add { key, delta } => w.blob(key).i64(*delta),
        Command::Check { keys } => w.keys(keys),
        Command::Wait { keys } => w.keys(keys),
        Command::NumKeys => w,
        Command::DeleteKey { key } => w.blob(key),
        Command::Append { key, value } => w.blob(key).blob(value),
        Command::MultiGet { keys } => w.keys(keys),
        Command::MultiSet { entries } => w.entries(entries),
        Command::CancelWait => w,
        Command::Ping { nonce } => w.u32(*nonce),
        Command::QueuePush { key, value } => w.blob(key).blob(value),
        Command::QueuePop { key } => w.blob(key),
        Command::QueueLen { key } => w.blob(key),
        Command::ListKeys => w,
        Command::Barrier { key, world_size } => w.blob(key).i64(*world_size),
    };
}
