//! Server replies. None is framed: the client knows from its request what to read.

use bytes::{BufMut, Bytes, BytesMut};

/// One reply to a TCPStore client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// GET, COMPARE_SET: u64 length and the bytes.
    Value(Bytes),
    /// ADD, GETNUMKEYS, DELETE_KEY, QUEUE_LEN: i64.
    Int(i64),
    /// CHECK: u8 0 READY, 1 NOT_READY.
    Check { ready: bool },
    /// WAIT and BARRIER released: u8 0 STOP_WAITING.
    StopWaiting,
    /// CANCEL_WAIT: u8 1 WAIT_CANCELED.
    WaitCanceled,
    /// PING: the nonce echoed.
    Pong(u32),
    /// MULTI_GET: each value as u64 length and bytes, concatenated (no count).
    Values(Vec<Bytes>),
    /// LIST_KEYS: i64 count, then each key as u64 length and bytes.
    Keys(Vec<Bytes>),
    /// QUEUE_POP: i64 queue length before the pop, then the value if it was not 0.
    Popped { len_before: i64, value: Option<Bytes> },
}

pub fn encode_answer(answer: &Answer, dst: &mut BytesMut) {
    let blob = |dst: &mut BytesMut, b: &[u8]| {
        dst.put_u64_le(b.len() as u64);
        dst.put_slice(b);
    };
    match answer {
        Answer::Value(value) => blob(dst, value),
        Answer::Int(n) => dst.put_i64_le(*n),
        Answer::Check { ready } => dst.put_u8(if *ready { 0 } else { 1 }),
        Answer::StopWaiting => dst.put_u8(0),
        Answer::WaitCanceled => dst.put_u8(1),
        Answer::Pong(nonce) => dst.put_u32_le(*nonce),
        Answer::Values(values) => values.iter().for_each(|v| blob(dst, v)),
        Answer::Keys(keys) => {
            dst.put_i64_le(i64::try_from(keys.len()).unwrap_or(i64::MAX));
            keys.iter().for_each(|k| blob(dst, k));
        }
        Answer::Popped { len_before, value } => {
            dst.put_i64_le(*len_before);
            if let Some(value) = value {
                blob(dst, value);
            }
        }
    }
}
