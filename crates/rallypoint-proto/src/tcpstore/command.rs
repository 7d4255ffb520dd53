//! Client requests: the incremental decoder and (for tests and tools) the encoder.

use bytes::{BufMut, Bytes, BytesMut};
use rallypoint_core::Limits;

use super::query;

/// Size limits enforced while decoding. Defaults are those of torch's libuv server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpLimits {
    pub max_key_len: usize,
    pub max_value_len: usize,
    /// Most keys in one CHECK, WAIT, MULTI_GET or MULTI_SET.
    pub max_keys: usize,
}

impl Default for TcpLimits {
    fn default() -> Self {
        TcpLimits { max_key_len: 8192, max_value_len: 8 << 20, max_keys: 131_072 }
    }
}

impl TcpLimits {
    /// The engine's limits, so that the codec never accepts what the engine refuses.
    pub fn from_limits(limits: &Limits) -> Self {
        TcpLimits {
            max_key_len: limits.max_key_len,
            max_value_len: limits.max_value_len,
            max_keys: limits.max_keys_per_op,
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
    /// torch's name of the query type, for logs.
    pub fn name(&self) -> &'static str {
        match self {
            Command::Validate { .. } => "VALIDATE",
            Command::Set { .. } => "SET",
            Command::CompareSet { .. } => "COMPARE_SET",
            Command::Get { .. } => "GET",
            Command::Add { .. } => "ADD",
            Command::Check { .. } => "CHECK",
            Command::Wait { .. } => "WAIT",
            Command::NumKeys => "GETNUMKEYS",
            Command::DeleteKey { .. } => "DELETE_KEY",
            Command::Append { .. } => "APPEND",
            Command::MultiGet { .. } => "MULTI_GET",
            Command::MultiSet { .. } => "MULTI_SET",
            Command::CancelWait => "CANCEL_WAIT",
            Command::Ping { .. } => "PING",
            Command::QueuePush { .. } => "QUEUE_PUSH",
            Command::QueuePop { .. } => "QUEUE_POP",
            Command::QueueLen { .. } => "QUEUE_LEN",
            Command::ListKeys => "LIST_KEYS",
            Command::Barrier { .. } => "BARRIER",
        }
    }
}

/// Input that ends a TCPStore connection: after it the stream cannot be trusted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TcpError {
    #[error("unknown TCPStore query type {0}")]
    UnknownType(u8),
    #[error("TCPStore {what} of {len} exceeds the limit of {limit}")]
    TooLarge { what: &'static str, len: u64, limit: u64 },
}

/// Decodes one whole request from the front of `src` and consumes it; `Ok(None)`
/// (nothing consumed) while the request is incomplete.
pub fn decode_command(src: &mut BytesMut, limits: &TcpLimits) -> Result<Option<Command>, TcpError> {
    CommandDecoder::new(*limits).decode(src)
}

/// The decoder of one connection's requests.
#[derive(Debug)]
pub struct CommandDecoder {
    limits: TcpLimits,
    examined: u64,
}

impl CommandDecoder {
    pub fn new(limits: TcpLimits) -> Self {
        CommandDecoder { limits, examined: 0 }
    }

    /// Decodes one whole request from the front of `src` and consumes it; `Ok(None)`
    /// (nothing consumed) while the request is incomplete.
    pub fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Command>, TcpError> {
        let mut cur = Cursor { buf: src, pos: 0, limits: &self.limits, examined: &mut self.examined };
        let Some(parsed) = cur.command()? else { return Ok(None) };
        let used = cur.pos;
        let frozen = src.split_to(used).freeze();
        Ok(Some(parsed.resolve(&frozen)))
    }

    /// Bytes of input this decoder has read so far, re-reads included.
    pub fn bytes_examined(&self) -> u64 {
        self.examined
    }
}

/// A byte range of the request being parsed; turned into `Bytes` once it is whole.
type Span = (usize, usize);

/// A request parsed as spans, so that an incomplete one costs no copy and no `Bytes`.
enum Parsed {
    Validate(u32),
    Ping(u32),
    NoArgs(u8),
    Key(u8, Span),
    KeyValue(u8, Span, Span),
    CompareSet(Span, Span, Span),
    KeyInt(u8, Span, i64),
    Keys(u8, Vec<Span>),
    MultiSet(Vec<(Span, Span)>),
}

impl Parsed {
    fn resolve(self, buf: &Bytes) -> Command {
        let b = |(start, end): Span| buf.slice(start..end);
        let keys = |spans: Vec<Span>| spans.into_iter().map(b).collect::<Vec<_>>();
        match self {
            Parsed::Validate(magic) => Command::Validate { magic },
            Parsed::Ping(nonce) => Command::Ping { nonce },
            Parsed::NoArgs(query::GETNUMKEYS) => Command::NumKeys,
            Parsed::NoArgs(query::CANCEL_WAIT) => Command::CancelWait,
            Parsed::NoArgs(_) => Command::ListKeys,
            Parsed::Key(query::GET, key) => Command::Get { key: b(key) },
            Parsed::Key(query::DELETE_KEY, key) => Command::DeleteKey { key: b(key) },
            Parsed::Key(query::QUEUE_POP, key) => Command::QueuePop { key: b(key) },
            Parsed::Key(_, key) => Command::QueueLen { key: b(key) },
            Parsed::KeyValue(query::SET, key, value) => Command::Set { key: b(key), value: b(value) },
            Parsed::KeyValue(query::APPEND, key, value) => Command::Append { key: b(key), value: b(value) },
            Parsed::KeyValue(_, key, value) => Command::QueuePush { key: b(key), value: b(value) },
            Parsed::CompareSet(key, expected, desired) => {
                Command::CompareSet { key: b(key), expected: b(expected), desired: b(desired) }
            }
            Parsed::KeyInt(query::ADD, key, delta) => Command::Add { key: b(key), delta },
            Parsed::KeyInt(_, key, world_size) => Command::Barrier { key: b(key), world_size },
            Parsed::Keys(query::CHECK, spans) => Command::Check { keys: keys(spans) },
            Parsed::Keys(query::WAIT, spans) => Command::Wait { keys: keys(spans) },
            Parsed::Keys(_, spans) => Command::MultiGet { keys: keys(spans) },
            Parsed::MultiSet(spans) => {
                Command::MultiSet { entries: spans.into_iter().map(|(k, v)| (b(k), b(v))).collect() }
            }
        }
    }
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    limits: &'a TcpLimits,
    examined: &'a mut u64,
}

/// `Ok(None)` = need more bytes.
type Step<T> = Result<Option<T>, TcpError>;

/// A read that cannot fail, only be incomplete.
fn ready<T>(value: Option<T>) -> Step<T> {
    Ok(value)
}

/// Unwraps a step: returns `Ok(None)` from the caller when bytes are missing.
macro_rules! need {
    ($e:expr) => {
        match $e? {
            Some(v) => v,
            None => return Ok(None),
        }
    };
}

impl Cursor<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        let end = self.pos.checked_add(n)?;
        let slice = self.buf.get(self.pos..end)?;
        self.pos = end;
        Some(slice)
    }

    /// The only bytes a decoder reads: lengths, counts and integers (keys and values are sliced, not read).
    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        *self.examined += N as u64;
        self.take(N).and_then(|s| s.try_into().ok())
    }

    fn u8(&mut self) -> Option<u8> {
        self.array::<1>().map(|[b]| b)
    }

    fn u32(&mut self) -> Option<u32> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Option<u64> {
        self.array().map(u64::from_le_bytes)
    }

    fn i64(&mut self) -> Option<i64> {
        self.array().map(i64::from_le_bytes)
    }

    /// A u64 length (checked against `limit` before waiting for the bytes) and the bytes.
    fn blob(&mut self, what: &'static str, limit: usize) -> Step<Span> {
        let Some(len) = self.u64() else { return Ok(None) };
        if len > limit as u64 {
            return Err(TcpError::TooLarge { what, len, limit: limit as u64 });
        }
        // Fits in usize: it is at most `limit`.
        let len = len as usize;
        let start = self.pos;
        Ok(self.take(len).map(|_| (start, start + len)))
    }

    fn key(&mut self) -> Step<Span> {
        self.blob("key length", self.limits.max_key_len)
    }

    fn value(&mut self) -> Step<Span> {
        self.blob("value length", self.limits.max_value_len)
    }

    fn count(&mut self) -> Step<usize> {
        let Some(n) = self.u64() else { return Ok(None) };
        let limit = self.limits.max_keys;
        if n > limit as u64 {
            return Err(TcpError::TooLarge { what: "number of keys", len: n, limit: limit as u64 });
        }
        Ok(Some(n as usize))
    }

    /// Room for `n` items of at least `min_len` bytes each, but never more than the
    /// bytes buffered can hold: the count is the peer's word until the items arrive.
    fn capacity(&self, n: usize, min_len: usize) -> usize {
        n.min(self.buf.len().saturating_sub(self.pos) / min_len)
    }

    fn command(&mut self) -> Step<Parsed> {
        let Some(kind) = self.u8() else { return Ok(None) };
        Ok(Some(match kind {
            query::VALIDATE => Parsed::Validate(need!(ready(self.u32()))),
            query::PING => Parsed::Ping(need!(ready(self.u32()))),
            query::GETNUMKEYS | query::CANCEL_WAIT | query::LIST_KEYS => Parsed::NoArgs(kind),
            query::GET | query::DELETE_KEY | query::QUEUE_POP | query::QUEUE_LEN => {
                Parsed::Key(kind, need!(self.key()))
            }
            query::SET | query::APPEND | query::QUEUE_PUSH => {
                let key = need!(self.key());
                Parsed::KeyValue(kind, key, need!(self.value()))
            }
            query::COMPARE_SET => {
                let key = need!(self.key());
                let expected = need!(self.value());
                Parsed::CompareSet(key, expected, need!(self.value()))
            }
            query::ADD | query::BARRIER => {
                let key = need!(self.key());
                Parsed::KeyInt(kind, key, need!(ready(self.i64())))
            }
            query::CHECK | query::WAIT | query::MULTI_GET => {
                let n = need!(self.count());
                let mut keys = Vec::with_capacity(self.capacity(n, 8));
                for _ in 0..n {
                    keys.push(need!(self.key()));
                }
                Parsed::Keys(kind, keys)
            }
            query::MULTI_SET => {
                let n = need!(self.count());
                let mut entries = Vec::with_capacity(self.capacity(n, 16));
                for _ in 0..n {
                    let key = need!(self.key());
                    entries.push((key, need!(self.value())));
                }
                Parsed::MultiSet(entries)
            }
            other => return Err(TcpError::UnknownType(other)),
        }))
    }
}

/// Appends `command` as a torch client sends it.
pub fn encode_command(command: &Command, dst: &mut BytesMut) {
    let blob = |dst: &mut BytesMut, b: &[u8]| {
        dst.put_u64_le(b.len() as u64);
        dst.put_slice(b);
    };
    let keys = |dst: &mut BytesMut, kind: u8, keys: &[Bytes]| {
        dst.put_u8(kind);
        dst.put_u64_le(keys.len() as u64);
        for key in keys {
            blob(dst, key);
        }
    };
    match command {
        Command::Validate { magic } => {
            dst.put_u8(query::VALIDATE);
            dst.put_u32_le(*magic);
        }
        Command::Ping { nonce } => {
            dst.put_u8(query::PING);
            dst.put_u32_le(*nonce);
        }
        Command::Set { key, value } | Command::Append { key, value } | Command::QueuePush { key, value } => {
            dst.put_u8(match command {
                Command::Set { .. } => query::SET,
                Command::Append { .. } => query::APPEND,
                _ => query::QUEUE_PUSH,
            });
            blob(dst, key);
            blob(dst, value);
        }
        Command::CompareSet { key, expected, desired } => {
            dst.put_u8(query::COMPARE_SET);
            blob(dst, key);
            blob(dst, expected);
            blob(dst, desired);
        }
        Command::Get { key } | Command::DeleteKey { key } | Command::QueuePop { key } | Command::QueueLen { key } => {
            dst.put_u8(match command {
                Command::Get { .. } => query::GET,
                Command::DeleteKey { .. } => query::DELETE_KEY,
                Command::QueuePop { .. } => query::QUEUE_POP,
                _ => query::QUEUE_LEN,
            });
            blob(dst, key);
        }
        Command::Add { key, delta: n } | Command::Barrier { key, world_size: n } => {
            dst.put_u8(if matches!(command, Command::Add { .. }) { query::ADD } else { query::BARRIER });
            blob(dst, key);
            dst.put_i64_le(*n);
        }
        Command::Check { keys: k } => keys(dst, query::CHECK, k),
        Command::Wait { keys: k } => keys(dst, query::WAIT, k),
        Command::MultiGet { keys: k } => keys(dst, query::MULTI_GET, k),
        Command::MultiSet { entries } => {
            dst.put_u8(query::MULTI_SET);
            dst.put_u64_le(entries.len() as u64);
            for (key, value) in entries {
                blob(dst, key);
                blob(dst, value);
            }
        }
        Command::NumKeys => dst.put_u8(query::GETNUMKEYS),
        Command::CancelWait => dst.put_u8(query::CANCEL_WAIT),
        Command::ListKeys => dst.put_u8(query::LIST_KEYS),
    }
}
