//! A restricted reader of Python pickles: it rebuilds the data a pickle describes
//! and never runs anything. A class or function the pickle names (`GLOBAL`,
//! `STACK_GLOBAL`) stays a name; calling it (`REDUCE`, `NEWOBJ`) records the call
//! with its arguments; `BUILD` records the state handed to the object. What the
//! caller makes of those records is its own business (module `rendezvous`).
//!
//! Why not the `serde-pickle` crate: it refuses dicts keyed by objects ("value not
//! hashable"), and torch's rendezvous state is exactly that (participants keyed by
//! node descriptors).
//!
//! Values live in an arena and the stack and memo hold indices into it, so that the
//! in-place changes a pickle makes after memoizing a value (`SETITEMS` on a memoized
//! dict, `BUILD` on a memoized object) are seen through every reference, as in
//! Python, and nothing is ever copied: the work and memory are linear in the input.
//! Opcodes that need outside help (persistent ids, the extension registry, out-of-band
//! buffers) and the text-protocol object opcodes are refused.

use std::fmt;

/// Most values one pickle may make: every opcode makes at most one, so this bounds a
/// hostile input's memory whatever it claims.
const MAX_VALUES: usize = 1 << 20;

/// Index of a value in the arena.
pub(crate) type Id = usize;

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Value {
    None,
    Bool(bool),
    Int(i64),
    /// An integer too large for an i64 (little-endian two's complement bytes).
    BigInt,
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    Tuple(Vec<Id>),
    List(Vec<Id>),
    Dict(Vec<(Id, Id)>),
    Set(Vec<Id>),
    /// A class or function, by module and name.
    Global {
        module: String,
        name: String,
    },
    /// `callable(*args)` as `REDUCE`, or `cls.__new__(cls, *args)` as `NEWOBJ`, with
    /// the state a later `BUILD` gave it.
    Call {
        callable: Id,
        args: Id,
        state: Option<Id>,
    },
}

/// Why a pickle could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Error(String);

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn err<T>(message: impl Into<String>) -> Result<T, Error> {
    Err(Error(message.into()))
}

/// A pickle's values, and the one it describes.
#[derive(Debug)]
pub(crate) struct Pickle {
    values: Vec<Value>,
    root: Id,
}

impl Pickle {
    pub fn root(&self) -> Id {
        self.root
    }

    pub fn get(&self, id: Id) -> &Value {
        // Ids come from the arena itself: always in range.
        &self.values[id]
    }

    /// The value of the string key `key` of the dict `dict`.
    pub fn field(&self, dict: Id, key: &str) -> Option<Id> {
        let Value::Dict(entries) = self.get(dict) else { return None };
        entries.iter().find(|(k, _)| matches!(self.get(*k), Value::Str(s) if s == key)).map(|(_, v)| *v)
    }

    pub fn int(&self, id: Id) -> Option<i64> {
        match self.get(id) {
            Value::Int(n) => Some(*n),
            Value::Bool(b) => Some(i64::from(*b)),
            _ => None,
        }
    }

    pub fn str(&self, id: Id) -> Option<&str> {
        match self.get(id) {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The class an object was made from (`NEWOBJ`), or the function called (`REDUCE`).
    pub fn callable(&self, id: Id) -> Option<(&str, &str)> {
        let Value::Call { callable, .. } = self.get(id) else { return None };
        match self.get(*callable) {
            Value::Global { module, name } => Some((module, name)),
            _ => None,
        }
    }
}

/// Reads a whole pickle (any protocol from 2 to 5, as `pickle.dumps` writes it).
pub(crate) fn read(data: &[u8]) -> Result<Pickle, Error> {
    let mut vm =
        Machine { input: data, pos: 0, values: Vec::new(), stack: Vec::new(), marks: Vec::new(), memo: Vec::new() };
    let root = vm.run()?;
    Ok(Pickle { values: vm.values, root })
}

struct Machine<'a> {
    input: &'a [u8],
    pos: usize,
    values: Vec<Value>,
    stack: Vec<Id>,
    /// Stack depths at each MARK.
    marks: Vec<usize>,
    memo: Vec<Option<Id>>,
}

impl Machine<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], Error> {
        let end = self.pos.checked_add(n).filter(|&end| end <= self.input.len());
        let Some(end) = end else { return err("the pickle ends in the middle of an opcode") };
        let bytes = &self.input[self.pos..end];
        self.pos = end;
        Ok(bytes)
    }

    fn u8(&mut self) -> Result<u8, Error> {
        Ok(self.take(1)?[0])
    }

    fn le(&mut self, n: usize) -> Result<u64, Error> {
        let bytes = self.take(n)?;
        Ok(bytes.iter().rev().fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
    }

    fn len(&mut self, n: usize) -> Result<usize, Error> {
        let len = self.le(n)?;
        usize::try_from(len)
            .ok()
            .filter(|&l| l <= self.input.len() - self.pos)
            .map_or_else(|| err(format!("a length of {len} bytes runs past the end of the pickle")), Ok)
    }

    fn line(&mut self) -> Result<String, Error> {
        let rest = &self.input[self.pos..];
        let Some(end) = rest.iter().position(|&b| b == b'\n') else { return err("a text argument without its end") };
        let text = String::from_utf8_lossy(&rest[..end]).into_owned();
        self.pos += end + 1;
        Ok(text)
    }

    fn alloc(&mut self, value: Value) -> Result<Id, Error> {
        if self.values.len() == MAX_VALUES {
            return err("the pickle makes too many values");
        }
        self.values.push(value);
        Ok(self.values.len() - 1)
    }

    fn push(&mut self, value: Value) -> Result<(), Error> {
        let id = self.alloc(value)?;
        self.stack.push(id);
        Ok(())
    }

    fn pop(&mut self) -> Result<Id, Error> {
        // Items above the last mark only: a mark is not a value.
        if self.marks.last().is_some_and(|&m| m >= self.stack.len()) {
            return err("an opcode takes a value past a MARK");
        }
        self.stack.pop().map_or_else(|| err("the stack is empty"), Ok)
    }

    fn top(&self) -> Result<Id, Error> {
        self.stack.last().copied().map_or_else(|| err("the stack is empty"), Ok)
    }

    /// The items pushed since the last MARK, which is removed.
    fn pop_mark(&mut self) -> Result<Vec<Id>, Error> {
        let Some(at) = self.marks.pop() else { return err("no MARK to pop to") };
        Ok(self.stack.split_off(at.min(self.stack.len())))
    }

    fn memo_put(&mut self, index: usize) -> Result<(), Error> {
        let top = self.top()?;
        if index > MAX_VALUES {
            return err("a memo index out of range");
        }
        if self.memo.len() <= index {
            self.memo.resize(index + 1, None);
        }
        self.memo[index] = Some(top);
        Ok(())
    }

    fn memo_get(&mut self, index: usize) -> Result<(), Error> {
        match self.memo.get(index).copied().flatten() {
            Some(id) => {
                self.stack.push(id);
                Ok(())
            }
            None => err(format!("memo entry {index} was never stored")),
        }
    }

    fn value_mut(&mut self, id: Id) -> &mut Value {
        &mut self.values[id]
    }

    fn set_items(&mut self, dict: Id, items: Vec<Id>) -> Result<(), Error> {
        if !items.len().is_multiple_of(2) {
            return err("SETITEMS with an odd number of items");
        }
        let pairs: Vec<(Id, Id)> = items.chunks(2).map(|p| (p[0], p[1])).collect();
        match self.value_mut(dict) {
            Value::Dict(entries) => {
                entries.extend(pairs);
                Ok(())
            }
            _ => err("SETITEM(S) on something other than a dict"),
        }
    }

    fn run(&mut self) -> Result<Id, Error> {
        loop {
            let op = self.u8()?;
            match op {
                0x80 => {
                    // PROTO
                    let protocol = self.u8()?;
                    if protocol > 5 {
                        return err(format!("pickle protocol {protocol} is newer than 5"));
                    }
                }
                0x95 => {
                    // FRAME: a length the reader may ignore.
                    self.take(8)?;
                }
                b'.' => return self.pop(),
                b'(' => self.marks.push(self.stack.len()),
                b'0' => {
                    self.pop()?;
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    let top = self.top()?;
                    self.stack.push(top);
                }
                b'N' => self.push(Value::None)?,
                0x88 => self.push(Value::Bool(true))?,
                0x89 => self.push(Value::Bool(false))?,
                b'J' => {
                    let n = self.le(4)? as u32 as i32;
                    self.push(Value::Int(i64::from(n)))?;
                }
                b'K' => {
                    let n = self.u8()?;
                    self.push(Value::Int(i64::from(n)))?;
                }
                b'M' => {
                    let n = self.le(2)?;
                    self.push(Value::Int(n as i64))?;
                }
                0x8a | 0x8b => {
                    // LONG1, LONG4: little-endian two's complement of the given length.
                    let len = if op == 0x8a { usize::from(self.u8()?) } else { self.len(4)? };
                    let bytes = self.take(len)?.to_vec();
                    self.push(long(&bytes))?;
                }
                b'I' | b'L' => {
                    // INT, LONG (text): "01"/"00" are True/False for INT.
                    let line = self.line()?;
                    let text = line.trim_end_matches('L');
                    let value = match text {
                        "01" if op == b'I' => Value::Bool(true),
                        "00" if op == b'I' => Value::Bool(false),
                        _ => text.parse::<i64>().map_or(Value::BigInt, Value::Int),
                    };
                    self.push(value)?;
                }
                b'G' => {
                    let bits = self.take(8)?;
                    let mut be = [0u8; 8];
                    be.copy_from_slice(bits);
                    self.push(Value::Float(f64::from_be_bytes(be)))?;
                }
                b'F' => {
                    let line = self.line()?;
                    self.push(Value::Float(line.trim().parse().unwrap_or(f64::NAN)))?;
                }
                0x8c | b'X' | 0x8d => {
                    // SHORT_BINUNICODE, BINUNICODE, BINUNICODE8
                    let len = match op {
                        0x8c => usize::from(self.u8()?),
                        b'X' => self.len(4)?,
                        _ => self.len(8)?,
                    };
                    let text = String::from_utf8_lossy(self.take(len)?).into_owned();
                    self.push(Value::Str(text))?;
                }
                b'C' | b'B' | 0x8e | 0x96 | b'U' | b'T' => {
                    // SHORT_BINBYTES, BINBYTES, BINBYTES8, BYTEARRAY8, and protocol 2's
                    // SHORT_BINSTRING, BINSTRING (bytes, as Python 3 reads them with
                    // encoding="bytes").
                    let len = match op {
                        b'C' | b'U' => usize::from(self.u8()?),
                        b'B' | b'T' => self.len(4)?,
                        _ => self.len(8)?,
                    };
                    let bytes = self.take(len)?.to_vec();
                    self.push(Value::Bytes(bytes))?;
                }
                b')' => self.push(Value::Tuple(Vec::new()))?,
                b't' => {
                    let items = self.pop_mark()?;
                    self.push(Value::Tuple(items))?;
                }
                0x85..=0x87 => {
                    let n = usize::from(op - 0x84);
                    let mut items = Vec::with_capacity(n);
                    for _ in 0..n {
                        items.push(self.pop()?);
                    }
                    items.reverse();
                    self.push(Value::Tuple(items))?;
                }
                b']' => self.push(Value::List(Vec::new()))?,
                b'l' => {
                    let items = self.pop_mark()?;
                    self.push(Value::List(items))?;
                }
                b'a' | b'e' => {
                    let items = if op == b'a' { vec![self.pop()?] } else { self.pop_mark()? };
                    let list = self.top()?;
                    match self.value_mut(list) {
                        Value::List(list) => list.extend(items),
                        _ => return err("APPEND(S) on something other than a list"),
                    }
                }
                b'}' => self.push(Value::Dict(Vec::new()))?,
                b'd' => {
                    let items = self.pop_mark()?;
                    let dict = self.alloc(Value::Dict(Vec::new()))?;
                    self.set_items(dict, items)?;
                    self.stack.push(dict);
                }
                b's' => {
                    let value = self.pop()?;
                    let key = self.pop()?;
                    let dict = self.top()?;
                    self.set_items(dict, vec![key, value])?;
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    let dict = self.top()?;
                    self.set_items(dict, items)?;
                }
                0x8f => self.push(Value::Set(Vec::new()))?,
                0x90 => {
                    let items = self.pop_mark()?;
                    let set = self.top()?;
                    match self.value_mut(set) {
                        Value::Set(set) => set.extend(items),
                        _ => return err("ADDITEMS on something other than a set"),
                    }
                }
                0x91 => {
                    let items = self.pop_mark()?;
                    self.push(Value::Set(items))?;
                }
                0x94 => self.memo_put(self.memo.len())?,
                b'q' => {
                    let index = usize::from(self.u8()?);
                    self.memo_put(index)?;
                }
                b'r' => {
                    let index = self.le(4)? as usize;
                    self.memo_put(index)?;
                }
                b'p' => {
                    let index = self.line()?.trim().parse().map_err(|_| Error("a bad PUT index".into()))?;
                    self.memo_put(index)?;
                }
                b'h' => {
                    let index = usize::from(self.u8()?);
                    self.memo_get(index)?;
                }
                b'j' => {
                    let index = self.le(4)? as usize;
                    self.memo_get(index)?;
                }
                b'g' => {
                    let index = self.line()?.trim().parse().map_err(|_| Error("a bad GET index".into()))?;
                    self.memo_get(index)?;
                }
                b'c' => {
                    let module = self.line()?;
                    let name = self.line()?;
                    self.push(Value::Global { module, name })?;
                }
                0x93 => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    let (Value::Str(module), Value::Str(name)) =
                        (self.values[module].clone(), self.values[name].clone())
                    else {
                        return err("STACK_GLOBAL without two strings");
                    };
                    self.push(Value::Global { module, name })?;
                }
                b'R' | 0x81 => {
                    // REDUCE: callable(*args); NEWOBJ: cls.__new__(cls, *args).
                    let args = self.pop()?;
                    let callable = self.pop()?;
                    self.push(Value::Call { callable, args, state: None })?;
                }
                0x92 => {
                    // NEWOBJ_EX: cls, args, kwargs.
                    let _kwargs = self.pop()?;
                    let args = self.pop()?;
                    let callable = self.pop()?;
                    self.push(Value::Call { callable, args, state: None })?;
                }
                b'b' => {
                    let state = self.pop()?;
                    let object = self.top()?;
                    match self.value_mut(object) {
                        Value::Call { state: slot, .. } => *slot = Some(state),
                        _ => return err("BUILD on something that is not an object"),
                    }
                }
                other => {
                    return err(format!("opcode 0x{other:02x} is not read here (it would need more than data)"));
                }
            }
        }
    }
}

/// An integer from little-endian two's complement bytes.
fn long(bytes: &[u8]) -> Value {
    if bytes.is_empty() {
        return Value::Int(0);
    }
    if bytes.len() > 8 {
        return Value::BigInt;
    }
    let negative = bytes[bytes.len() - 1] & 0x80 != 0;
    let mut n: u64 = if negative { u64::MAX } else { 0 };
    for (i, &b) in bytes.iter().enumerate() {
        n &= !(0xff << (8 * i));
        n |= u64::from(b) << (8 * i);
    }
    Value::Int(n as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `pickle.dumps({"a": [1, -2, 300, 2**40], "b": (True, None, b"x")}, protocol=4)`
    const SAMPLE: &[u8] = b"\x80\x04\x95+\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x01a\x94]\x94(K\x01J\xfe\xff\xff\xffM,\x01\x8a\x06\x00\x00\x00\x00\x00\x01e\x8c\x01b\x94\x88NC\x01x\x94\x87\x94u.";

    #[test]
    fn reads_a_dict_of_lists_and_tuples() {
        let p = read(SAMPLE).expect("readable");
        let a = p.field(p.root(), "a").expect("a");
        let Value::List(items) = p.get(a) else { panic!("{:?}", p.get(a)) };
        let ints: Vec<i64> = items.iter().filter_map(|&i| p.int(i)).collect();
        assert_eq!(ints, [1, -2, 300, 1 << 40]);
        let b = p.field(p.root(), "b").expect("b");
        let Value::Tuple(items) = p.get(b) else { panic!() };
        assert_eq!(p.get(items[0]), &Value::Bool(true));
        assert_eq!(p.get(items[1]), &Value::None);
        assert_eq!(p.get(items[2]), &Value::Bytes(b"x".to_vec()));
    }

    #[test]
    fn refuses_what_would_need_more_than_data_and_never_panics_on_garbage() {
        // BINPERSID: a persistent id the unpickler would have to resolve.
        assert!(read(b"\x80\x04K\x01Q.").is_err());
        assert!(read(b"").is_err());
        assert!(read(b"\x80\x04h\x05.").is_err(), "an unknown memo entry");
        for cut in 0..SAMPLE.len() {
            let _ = read(&SAMPLE[..cut]);
        }
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..2000 {
            let len = (state % 64) as usize;
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    (state >> 24) as u8
                })
                .collect();
            let _ = read(&bytes);
        }
    }
}
