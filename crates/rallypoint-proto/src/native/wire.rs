//! Primitive field encoding shared by every message: little-endian integers,
//! u32-length-prefixed byte strings, flag-prefixed options and count-prefixed
//! lists. Every read is bounds-checked: peer bytes can make decoding fail, never panic.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use rallypoint_core::Name;

/// What was wrong with a frame body; becomes the message of a `BadRequest`/`BadReply`.
#[derive(Debug)]
pub(crate) struct DecodeError(pub(crate) String);

pub(crate) type DecodeResult<T> = Result<T, DecodeError>;

impl DecodeError {
    pub(crate) fn unknown(what: &str, tag: u8) -> Self {
        DecodeError(format!("unknown {what} 0x{tag:02x}"))
    }

    pub(crate) fn out_of_range(field: &str, value: impl std::fmt::Display) -> Self {
        DecodeError(format!("field '{field}' is out of range: {value}"))
    }
}

/// Cursor over one frame body. Byte strings are split off the body without copying.
pub(crate) struct Reader {
    buf: Bytes,
}

impl Reader {
    pub(crate) fn new(body: Bytes) -> Self {
        Reader { buf: body }
    }

    fn need(&self, n: usize, field: &str) -> DecodeResult<()> {
        if self.buf.remaining() < n {
            return Err(DecodeError(format!(
                "truncated field '{field}': needs {n} bytes, {} left",
                self.buf.remaining()
            )));
        }
        Ok(())
    }

    pub(crate) fn u8(&mut self, field: &str) -> DecodeResult<u8> {
        self.need(1, field)?;
        Ok(self.buf.get_u8())
    }

    pub(crate) fn u32(&mut self, field: &str) -> DecodeResult<u32> {
        self.need(4, field)?;
        Ok(self.buf.get_u32_le())
    }

    pub(crate) fn u64(&mut self, field: &str) -> DecodeResult<u64> {
        self.need(8, field)?;
        Ok(self.buf.get_u64_le())
    }

    pub(crate) fn i64(&mut self, field: &str) -> DecodeResult<i64> {
        self.need(8, field)?;
        Ok(self.buf.get_i64_le())
    }

    pub(crate) fn bool(&mut self, field: &str) -> DecodeResult<bool> {
        match self.u8(field)? {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(DecodeError(format!("field '{field}': invalid bool 0x{b:02x}"))),
        }
    }

    /// `N` raw bytes (a fixed-size field: a nonce, a proof).
    pub(crate) fn array<const N: usize>(&mut self, field: &str) -> DecodeResult<[u8; N]> {
        self.need(N, field)?;
        let mut out = [0u8; N];
        self.buf.copy_to_slice(&mut out);
        Ok(out)
    }

    pub(crate) fn bytes(&mut self, field: &str) -> DecodeResult<Bytes> {
        let len = self.u32(field)? as usize;
        self.need(len, field)?;
        Ok(self.buf.split_to(len))
    }

    pub(crate) fn string(&mut self, field: &str) -> DecodeResult<String> {
        self.text(field, str::to_owned)
    }

    /// A collective's or a role's name: copied out of the body, as a [`Name`] owns
    /// its bytes (inline when short).
    pub(crate) fn name(&mut self, field: &str) -> DecodeResult<Name> {
        self.text(field, |text| Name::from(text))
    }

    /// A UTF-8 byte string, made into `T` by `own` from the body in place.
    fn text<T>(&mut self, field: &str, own: impl FnOnce(&str) -> T) -> DecodeResult<T> {
        let len = self.u32(field)? as usize;
        self.need(len, field)?;
        let text = std::str::from_utf8(&self.buf[..len])
            .map(own)
            .map_err(|_| DecodeError(format!("field '{field}' is not valid UTF-8")))?;
        self.buf.advance(len);
        Ok(text)
    }

    /// A flag byte (0 = absent, 1 = present) followed by the value if present.
    pub(crate) fn option<T>(
        &mut self,
        field: &str,
        read: impl FnOnce(&mut Self) -> DecodeResult<T>,
    ) -> DecodeResult<Option<T>> {
        match self.u8(field)? {
            0 => Ok(None),
            1 => read(self).map(Some),
            b => Err(DecodeError(format!("field '{field}': invalid option flag 0x{b:02x}"))),
        }
    }

    /// A u32 item count followed by the items. `min_item_len` (≥ 1) is the fewest
    /// bytes one item can take: a count that cannot fit in what is left of the body
    /// is refused before anything is allocated for it.
    pub(crate) fn list<T>(
        &mut self,
        field: &str,
        min_item_len: usize,
        mut read: impl FnMut(&mut Self) -> DecodeResult<T>,
    ) -> DecodeResult<Vec<T>> {
        let count = self.u32(field)? as usize;
        let left = self.buf.remaining();
        if count > left / min_item_len.max(1) {
            return Err(DecodeError(format!("field '{field}': {count} items cannot fit in the {left} bytes left")));
        }
        let mut items = Vec::with_capacity(count);
        for _ in 0..count {
            items.push(read(self)?);
        }
        Ok(items)
    }

    /// A field read by `decode`, which splits it off the front of what is left of the
    /// body: for a type that reads its own layout (an all-gather's result, which keeps
    /// the bytes it was read from).
    pub(crate) fn split<T, E: std::fmt::Display>(
        &mut self,
        field: &str,
        decode: impl FnOnce(&mut Bytes) -> Result<T, E>,
    ) -> DecodeResult<T> {
        decode(&mut self.buf).map_err(|e| DecodeError(format!("field '{field}': {e}")))
    }

    /// Succeeds if the whole body was consumed.
    pub(crate) fn finish(&self, what: &str) -> DecodeResult<()> {
        match self.buf.remaining() {
            0 => Ok(()),
            n => Err(DecodeError(format!("{n} unexpected trailing bytes after {what}"))),
        }
    }
}

/// The encoding side of [`Reader`].
pub(crate) trait WireWrite {
    fn put_bool(&mut self, b: bool);
    /// Lengths and counts are u32. A longer one saturates; the frame it belongs to
    /// then exceeds [`super::MAX_FRAME_LEN`] and every receiver rejects it whole.
    fn put_count(&mut self, n: usize);
    fn put_blob(&mut self, b: &[u8]);
    fn put_str(&mut self, s: &str) {
        self.put_blob(s.as_bytes());
    }
    fn put_option<T>(&mut self, v: Option<T>, write: impl FnOnce(&mut Self, T));
    fn put_list<T>(&mut self, items: &[T], write: impl FnMut(&mut Self, &T));
}

impl WireWrite for BytesMut {
    fn put_bool(&mut self, b: bool) {
        self.put_u8(u8::from(b));
    }

    fn put_count(&mut self, n: usize) {
        self.put_u32_le(u32::try_from(n).unwrap_or(u32::MAX));
    }

    fn put_blob(&mut self, b: &[u8]) {
        self.put_count(b.len());
        self.put_slice(b);
    }

    fn put_option<T>(&mut self, v: Option<T>, write: impl FnOnce(&mut Self, T)) {
        match v {
            None => self.put_u8(0),
            Some(v) => {
                self.put_u8(1);
                write(self, v);
            }
        }
    }

    fn put_list<T>(&mut self, items: &[T], mut write: impl FnMut(&mut Self, &T)) {
        self.put_count(items.len());
        for item in items {
            write(self, item);
        }
    }
}
