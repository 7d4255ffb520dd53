//! The TCPStore codec against the byte trace recorded from torch 2.15
//! (docs/TCPSTORE.md, section "Byte trace"), split reads and random input.

use bytes::{Bytes, BytesMut};
use proptest::prelude::*;
use rallypoint_proto::tcpstore::{
    decode_command, encode_answer, encode_command, Answer, Command, CommandDecoder, TcpError, TcpLimits, VALIDATE_MAGIC,
};

fn hex(s: &str) -> Vec<u8> {
    let digits: Vec<u8> = s.bytes().filter(u8::is_ascii_hexdigit).collect();
    digits
        .chunks(2)
        .map(|pair| u8::from_str_radix(std::str::from_utf8(pair).expect("ascii"), 16).expect("hex digit"))
        .collect()
}

fn len(n: u64) -> String {
    n.to_le_bytes().iter().map(|b| format!("{b:02x}")).collect()
}

fn b(s: &str) -> Bytes {
    Bytes::copy_from_slice(s.as_bytes())
}

/// The client side of the trace, request by request, with the bytes torch sent.
fn trace_requests() -> Vec<(Vec<u8>, Command)> {
    vec![
        (hex("00 cef7853c"), Command::Validate { magic: VALIDATE_MAGIC }),
        (hex("0d 9d0d0000"), Command::Ping { nonce: 3485 }),
        (hex(&format!("01 {} 2f6b {} 76", len(2), len(1))), Command::Set { key: b("/k"), value: b("v") }),
        (hex(&format!("06 {} {} 2f6b", len(1), len(2))), Command::Wait { keys: vec![b("/k")] }),
        (hex(&format!("03 {} 2f6b", len(2))), Command::Get { key: b("/k") }),
        (hex(&format!("04 {} 2f636e74 0500000000000000", len(4))), Command::Add { key: b("/cnt"), delta: 5 }),
        (hex(&format!("04 {} 2f636e74 feffffffffffffff", len(4))), Command::Add { key: b("/cnt"), delta: -2 }),
        (hex(&format!("06 {} {} 2f6e6f6b6579", len(1), len(6))), Command::Wait { keys: vec![b("/nokey")] }),
        (hex("0c"), Command::CancelWait),
        (hex(&format!("12 {} 2f62 0100000000000000", len(2))), Command::Barrier { key: b("/b"), world_size: 1 }),
    ]
}

/// The server side of the trace.
fn trace_replies() -> Vec<(Vec<u8>, Answer)> {
    vec![
        (hex("9d0d0000"), Answer::Pong(3485)),
        (hex("00"), Answer::StopWaiting),
        (hex(&format!("{} 76", len(1))), Answer::Value(b("v"))),
        (hex("0500000000000000"), Answer::Int(5)),
        (hex("0300000000000000"), Answer::Int(3)),
        (hex("01"), Answer::WaitCanceled),
        (hex("00"), Answer::StopWaiting),
    ]
}

fn decode_all(stream: &[u8], chunk: usize) -> Result<Vec<Command>, TcpError> {
    let mut buf = BytesMut::new();
    let mut out = Vec::new();
    for piece in stream.chunks(chunk.max(1)) {
        buf.extend_from_slice(piece);
        while let Some(cmd) = decode_command(&mut buf, &TcpLimits::default())? {
            out.push(cmd);
        }
    }
    assert!(buf.is_empty(), "bytes left over");
    Ok(out)
}

#[test]
fn trace_decodes_and_encodes_byte_for_byte() {
    for (bytes, command) in trace_requests() {
        let mut buf = BytesMut::from(&bytes[..]);
        assert_eq!(decode_command(&mut buf, &TcpLimits::default()), Ok(Some(command.clone())));
        assert!(buf.is_empty());
        let mut encoded = BytesMut::new();
        encode_command(&command, &mut encoded);
        assert_eq!(&encoded[..], &bytes[..], "{}", command.name());
    }
    for (bytes, answer) in trace_replies() {
        let mut encoded = BytesMut::new();
        encode_answer(&answer, &mut encoded);
        assert_eq!(&encoded[..], &bytes[..], "{answer:?}");
    }
}

#[test]
fn whole_trace_split_at_every_boundary_decodes_the_same() {
    let stream: Vec<u8> = trace_requests().into_iter().flat_map(|(bytes, _)| bytes).collect();
    let expected: Vec<Command> = trace_requests().into_iter().map(|(_, c)| c).collect();
    for chunk in 1..=stream.len() {
        assert_eq!(decode_all(&stream, chunk).expect("valid stream"), expected, "chunk {chunk}");
    }
    // Two pieces, split at every byte.
    for at in 0..=stream.len() {
        let mut buf = BytesMut::from(&stream[..at]);
        let mut got = Vec::new();
        while let Some(c) = decode_command(&mut buf, &TcpLimits::default()).expect("valid") {
            got.push(c);
        }
        buf.extend_from_slice(&stream[at..]);
        while let Some(c) = decode_command(&mut buf, &TcpLimits::default()).expect("valid") {
            got.push(c);
        }
        assert_eq!(got, expected, "split at {at}");
    }
}

fn every_command() -> Vec<Command> {
    vec![
        Command::Validate { magic: VALIDATE_MAGIC },
        Command::Set { key: b("/a"), value: b("1") },
        Command::CompareSet { key: b("/a"), expected: b(""), desired: b("x") },
        Command::Get { key: b("/a") },
        Command::Add { key: b("/n"), delta: i64::MIN },
        Command::Check { keys: vec![b("/a"), b("/b")] },
        Command::Wait { keys: vec![] },
        Command::NumKeys,
        Command::DeleteKey { key: b("/a") },
        Command::Append { key: b("/a"), value: b("yz") },
        Command::MultiGet { keys: vec![b("/a"), b("")] },
        Command::MultiSet { entries: vec![(b("/a"), b("1")), (b("/b"), b(""))] },
        Command::CancelWait,
        Command::Ping { nonce: 7 },
        Command::QueuePush { key: b("q"), value: b("item") },
        Command::QueuePop { key: b("q") },
        Command::QueueLen { key: b("q") },
        Command::ListKeys,
        Command::Barrier { key: b("/bar"), world_size: 4 },
    ]
}

#[test]
fn every_query_type_round_trips_split_anywhere() {
    let commands = every_command();
    let mut stream = BytesMut::new();
    for c in &commands {
        encode_command(c, &mut stream);
    }
    for chunk in [1, 2, 3, 7, 13, stream.len()] {
        assert_eq!(decode_all(&stream, chunk).expect("valid"), commands, "chunk {chunk}");
    }
}

#[test]
fn limits_and_unknown_types_are_fatal_before_buffering() {
    let limits = TcpLimits::default();
    let over = |kind: u8, n: u64| {
        let mut buf = BytesMut::new();
        buf.extend_from_slice(&[kind]);
        buf.extend_from_slice(&n.to_le_bytes());
        decode_command(&mut buf, &limits)
    };
    // Only the length has arrived: refused without waiting for 8 KiB + 1 bytes.
    assert!(matches!(over(1, 8193), Err(TcpError::TooLarge { what: "key length", len: 8193, .. })));
    assert_eq!(over(1, 8192), Ok(None));
    assert!(matches!(over(5, 131_073), Err(TcpError::TooLarge { what: "number of keys", .. })));
    assert!(matches!(over(11, u64::MAX), Err(TcpError::TooLarge { .. })));
    let mut value = BytesMut::new();
    encode_command(&Command::Set { key: b("k"), value: b("") }, &mut value);
    value.truncate(1 + 8 + 1);
    value.extend_from_slice(&((8u64 << 20) + 1).to_le_bytes());
    assert!(matches!(decode_command(&mut value, &limits), Err(TcpError::TooLarge { what: "value length", .. })));
    for kind in [19u8, 0x52, 0xff] {
        assert_eq!(decode_command(&mut BytesMut::from(&[kind][..]), &limits), Err(TcpError::UnknownType(kind)));
    }
}

#[test]
fn replies_of_every_shape() {
    let enc = |a: Answer| {
        let mut buf = BytesMut::new();
        encode_answer(&a, &mut buf);
        buf.to_vec()
    };
    assert_eq!(enc(Answer::Check { ready: true }), [0]);
    assert_eq!(enc(Answer::Check { ready: false }), [1]);
    assert_eq!(enc(Answer::Values(vec![b("a"), b("")])), hex(&format!("{} 61 {}", len(1), len(0))));
    assert_eq!(enc(Answer::Keys(vec![b("/k")])), hex(&format!("{} {} 2f6b", len(1), len(2))));
    assert_eq!(enc(Answer::Popped { len_before: 0, value: None }), hex(&len(0)));
    assert_eq!(enc(Answer::Popped { len_before: 2, value: Some(b("x")) }), hex(&format!("{} {} 78", len(2), len(1))));
}

proptest! {
    #[test]
    fn random_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..256), chunk in 1usize..32) {
        let limits = TcpLimits { max_key_len: 64, max_value_len: 64, max_keys: 8, max_request_len: 192 };
        let mut buf = BytesMut::new();
        'outer: for piece in data.chunks(chunk) {
            buf.extend_from_slice(piece);
            loop {
                match decode_command(&mut buf, &limits) {
                    Ok(Some(_)) => {}
                    Ok(None) => break,
                    Err(_) => break 'outer,
                }
            }
        }
    }

    #[test]
    fn random_commands_round_trip(i in 0usize..19, key in "[a-z/]{0,12}", n in any::<i64>(), chunk in 1usize..9) {
        let mut command = every_command()[i].clone();
        match &mut command {
            Command::Set { key: k, .. } | Command::Get { key: k } | Command::QueuePop { key: k } => *k = b(&key),
            Command::Add { delta, .. } => *delta = n,
            _ => {}
        }
        let mut stream = BytesMut::new();
        encode_command(&command, &mut stream);
        prop_assert_eq!(decode_all(&stream, chunk).expect("valid"), vec![command]);
    }
}

/// The attack of issue 13: a MULTI_SET announcing torch's maximum of entries, each
/// with a value of the largest size. Every value is within its own limit; the sum is
/// refused as soon as an entry's length takes it over `max_request_len`, with that
/// entry's bytes not yet sent.
#[test]
fn a_request_whose_keys_and_values_add_up_past_max_request_len_is_refused_as_it_arrives() {
    let limits = TcpLimits::default();
    assert_eq!(limits.max_request_len, 64 << 20);
    let mut decoder = CommandDecoder::new(limits);
    let mut buf = BytesMut::new();
    buf.extend_from_slice(&[11]);
    buf.extend_from_slice(&131_072u64.to_le_bytes());
    let value = vec![0u8; 8 << 20];
    let mut carried = 0u64;
    for i in 0u32..16 {
        let key = format!("/k{i}");
        buf.extend_from_slice(&(key.len() as u64).to_le_bytes());
        buf.extend_from_slice(key.as_bytes());
        buf.extend_from_slice(&(value.len() as u64).to_le_bytes());
        carried += (key.len() + value.len()) as u64;
        match decoder.decode(&mut buf) {
            Ok(None) => buf.extend_from_slice(&value),
            Err(error) => {
                assert_eq!(error, TcpError::RequestTooLarge { query: "MULTI_SET", len: carried, limit: 64 << 20 });
                assert!(error.to_string().contains("max_request_len"), "{error}");
                assert_eq!(i, 7, "the eighth 8 MiB value crosses 64 MiB with its key");
                // The request's bytes so far: seven values, not the one announced last.
                assert!(buf.len() < (7 * (8 << 20) + 1024), "{} bytes buffered", buf.len());
                return;
            }
            Ok(Some(command)) => panic!("decoded {}", command.name()),
        }
    }
    panic!("{} bytes of one request buffered, not refused", buf.len());
}

/// One key and two values of the largest sizes always fit, whatever
/// `max_request_len` says: raising the value limit alone keeps them working.
#[test]
fn single_value_requests_are_never_refused_by_max_request_len() {
    let limits =
        rallypoint_core::Limits { max_value_len: 100, max_key_len: 10, max_request_len: 1, ..Default::default() };
    let tcp = TcpLimits::from_limits(&limits);
    assert_eq!(tcp.max_request_len, 210);
    let command =
        Command::CompareSet { key: b("0123456789"), expected: b(&"e".repeat(100)), desired: b(&"d".repeat(100)) };
    let mut stream = BytesMut::new();
    encode_command(&command, &mut stream);
    assert_eq!(CommandDecoder::new(tcp).decode(&mut stream), Ok(Some(command)));
    // Keys of a WAIT count too.
    let mut wait = BytesMut::new();
    encode_command(&Command::Wait { keys: vec![b("0123456789"); 22] }, &mut wait);
    assert_eq!(
        CommandDecoder::new(tcp).decode(&mut wait),
        Err(TcpError::RequestTooLarge { query: "WAIT", len: 220, limit: 210 })
    );
}
