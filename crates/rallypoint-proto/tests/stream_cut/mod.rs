//! The stream-cut property of every decoder, shared by the fuzz targets (`fuzz/`,
//! which include this file by path) and the stable test suite (`tests/stream_cuts.rs`).
//!
//! A byte stream fed to a decoder in pieces must decode to exactly what it decodes
//! to when fed whole: the same frames or requests, the same errors at the same
//! places, the same bytes left undecoded. Each value decoded also re-encodes to the
//! very bytes it was decoded from, and a decoder that returns a value has consumed
//! bytes. A TCPStore stream is decoded three ways: whole, in pieces by one
//! [`CommandDecoder`] (as a connection does), and in pieces by a fresh decoder per
//! call ([`decode_command`]). Any difference panics.
//!
//! A fuzz input is `[h] [n bytes] [stream]`: the low 4 bits of `h` are `n`, the number
//! of chunk lengths that follow (each byte `b` is a chunk of `b + 1` bytes, used in
//! turn, cycled; none: one byte at a time), and bit 4 selects small limits, so that
//! the limit checks are reached by short inputs too.
#![allow(dead_code)] // each fuzz target uses one target

use std::fmt::Debug;

use bytes::BytesMut;
use rallypoint_proto::native::{
    decode_agent_frame, decode_client_frame, decode_root_frame, decode_server_frame, encode_agent_frame,
    encode_client_frame, encode_root_frame, encode_server_frame, FrameLimits, ProtoError,
};
use rallypoint_proto::tcpstore::{decode_command, encode_command, CommandDecoder, TcpError, TcpLimits};

/// The decoders, named as the fuzz targets are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// Frames a client sends (the coordinator's and the agent's local side).
    ClientFrame,
    /// Frames the coordinator sends to a client.
    ServerFrame,
    /// Frames a node agent sends to the coordinator.
    AgentFrame,
    /// Frames the coordinator sends to a node agent.
    RootFrame,
    /// TCPStore requests.
    Tcpstore,
}

impl Target {
    pub const ALL: [Target; 5] =
        [Target::ClientFrame, Target::ServerFrame, Target::AgentFrame, Target::RootFrame, Target::Tcpstore];

    pub fn name(self) -> &'static str {
        match self {
            Target::ClientFrame => "client_frame",
            Target::ServerFrame => "server_frame",
            Target::AgentFrame => "agent_frame",
            Target::RootFrame => "root_frame",
            Target::Tcpstore => "tcpstore",
        }
    }
}

/// How a fuzz input says to cut its stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cuts {
    /// Lengths of the pieces, used in turn; empty: one byte at a time.
    pub chunks: Vec<usize>,
    /// Small limits instead of the defaults.
    pub small: bool,
}

/// Splits a fuzz input into its cuts and its stream.
pub fn split_input(data: &[u8]) -> (Cuts, &[u8]) {
    let Some((&header, rest)) = data.split_first() else {
        return (Cuts { chunks: Vec::new(), small: false }, &[]);
    };
    let n = usize::from(header & 0x0f).min(rest.len());
    let (chunks, stream) = rest.split_at(n);
    (Cuts { chunks: chunks.iter().map(|&b| usize::from(b) + 1).collect(), small: header & 0x10 != 0 }, stream)
}

/// The fuzz input that cuts `stream` as `cuts` says (at most 15 chunk lengths, each 1 to 256).
pub fn make_input(cuts: &Cuts, stream: &[u8]) -> Vec<u8> {
    let chunks: Vec<u8> = cuts.chunks.iter().take(15).map(|&c| (c.clamp(1, 256) - 1) as u8).collect();
    let mut input = vec![chunks.len() as u8 | if cuts.small { 0x10 } else { 0 }];
    input.extend_from_slice(&chunks);
    input.extend_from_slice(stream);
    input
}

/// Checks the property of `target` on one fuzz input.
pub fn check_input(target: Target, data: &[u8]) {
    let (cuts, stream) = split_input(data);
    check(target, &cuts, stream);
}

pub fn check(target: Target, cuts: &Cuts, stream: &[u8]) {
    let frames =
        if cuts.small { FrameLimits { max_frame_len: 4096 } } else { FrameLimits::from_limits(&Default::default()) };
    match target {
        Target::ClientFrame => native(stream, cuts, |src| decode_client_frame(src, &frames), encode_client_frame),
        Target::ServerFrame => native(stream, cuts, |src| decode_server_frame(src, &frames), encode_server_frame),
        Target::AgentFrame => native(stream, cuts, |src| decode_agent_frame(src, &frames), encode_agent_frame),
        Target::RootFrame => native(stream, cuts, |src| decode_root_frame(src, &frames), encode_root_frame),
        Target::Tcpstore => tcpstore(stream, cuts),
    }
}

fn native<T: PartialEq + Debug>(
    stream: &[u8],
    cuts: &Cuts,
    decode: impl Fn(&mut BytesMut) -> Result<Option<T>, ProtoError>,
    encode: impl Fn(&T, &mut BytesMut),
) {
    let whole = feed(stream, None, &mut |src: &mut BytesMut| decode(src), ProtoError::is_fatal);
    let cut = feed(stream, Some(&cuts.chunks), &mut |src: &mut BytesMut| decode(src), ProtoError::is_fatal);
    assert_eq!(whole, cut, "cut at {:?}", cuts.chunks);
    round_trips(&whole, encode);
}

fn tcpstore(stream: &[u8], cuts: &Cuts) {
    let limits = if cuts.small {
        TcpLimits { max_key_len: 64, max_value_len: 256, max_keys: 16, max_request_len: 1024 }
    } else {
        TcpLimits::default()
    };
    let fatal = |_: &TcpError| true;
    let mut decoder = CommandDecoder::new(limits);
    let whole = feed(stream, None, &mut |src: &mut BytesMut| decoder.decode(src), fatal);
    let mut decoder = CommandDecoder::new(limits);
    let cut = feed(stream, Some(&cuts.chunks), &mut |src: &mut BytesMut| decoder.decode(src), fatal);
    assert_eq!(whole, cut, "cut at {:?}", cuts.chunks);
    let afresh = feed(stream, Some(&cuts.chunks), &mut |src: &mut BytesMut| decode_command(src, &limits), fatal);
    assert_eq!(whole, afresh, "cut at {:?}, a fresh decoder per call", cuts.chunks);
    round_trips(&whole, encode_command);
}

thread_local! {
    /// True while a decoder runs (not this module's own bookkeeping): a test's
    /// allocator reads it to bound what decoders allocate.
    pub static IN_DECODER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// What decoding yielded: each value with the bytes it was decoded from, or an error.
type Outcomes<T, E> = Vec<Result<(T, Vec<u8>), E>>;

/// Feeds `stream` whole (`chunks` = `None`) or in pieces and decodes after each
/// piece until the decoder waits for more or fails fatally. Returns what it decoded
/// and the bytes of the stream after the last thing decoded.
fn feed<T: Debug, E>(
    stream: &[u8],
    chunks: Option<&[usize]>,
    decode: &mut dyn FnMut(&mut BytesMut) -> Result<Option<T>, E>,
    fatal: impl Fn(&E) -> bool,
) -> (Outcomes<T, E>, Vec<u8>) {
    let mut pieces = chunks.map(|c| c.iter().copied().cycle());
    let mut src = BytesMut::new();
    let mut out = Vec::new();
    let (mut fed, mut consumed) = (0, 0);
    while fed < stream.len() {
        let left = stream.len() - fed;
        let n = match pieces.as_mut() {
            None => left,
            Some(pieces) => pieces.next().unwrap_or(1).clamp(1, left),
        };
        src.extend_from_slice(&stream[fed..fed + n]);
        fed += n;
        loop {
            let before = src.len();
            IN_DECODER.with(|flag| flag.set(true));
            let result = decode(&mut src);
            IN_DECODER.with(|flag| flag.set(false));
            let used = before - src.len();
            let bytes = stream[consumed..consumed + used].to_vec();
            consumed += used;
            match result {
                Ok(None) => {
                    assert_eq!(used, 0, "a decoder that waits for more consumed {used} bytes");
                    break;
                }
                Ok(Some(value)) => {
                    assert!(used > 0, "a decoder returned {value:?} without consuming anything");
                    out.push(Ok((value, bytes)));
                }
                Err(error) => {
                    let stop = fatal(&error);
                    out.push(Err(error));
                    if stop {
                        return (out, stream[consumed..].to_vec());
                    }
                }
            }
        }
        assert_eq!(&src[..], &stream[consumed..fed], "decoders consume from the front of the buffer only");
    }
    (out, stream[consumed..].to_vec())
}

/// Every value decoded re-encodes to the bytes it came from: the encoding is canonical.
fn round_trips<T: Debug, E>(outcomes: &(Outcomes<T, E>, Vec<u8>), encode: impl Fn(&T, &mut BytesMut)) {
    for (value, bytes) in outcomes.0.iter().filter_map(|o| o.as_ref().ok()) {
        let mut encoded = BytesMut::new();
        encode(value, &mut encoded);
        assert_eq!(&encoded[..], &bytes[..], "{value:?} re-encodes differently");
    }
}
