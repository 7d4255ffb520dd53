//! Decoding resumes where it stopped: a request that arrives in many small pieces
//! costs work in proportion to its length, never a re-parse from its start.

use bytes::{BufMut, Bytes, BytesMut};
use rallypoint_core::Request;
use rallypoint_proto::native::{
    decode_agent_frame, decode_client_frame, decode_root_frame, decode_server_frame, encode_client_frame, ClientFrame,
    FrameLimits, ProtoError,
};
use rallypoint_proto::tcpstore::{encode_command, Command, CommandDecoder, TcpLimits};

/// torch's own limit of entries per MULTI_SET, trickled in pieces smaller than one
/// entry: the decoder's work (bytes of lengths and integers read, re-reads
/// included) stays within a constant times the bytes fed plus a constant per call.
/// Re-parsing from the start on each call exceeds the bound within a few calls.
#[test]
fn a_trickled_multi_set_of_131072_entries_costs_linear_work() {
    let entries: Vec<(Bytes, Bytes)> =
        (0..131_072u32).map(|i| (Bytes::from(format!("/k{i}")), Bytes::from_static(b"v"))).collect();
    let command = Command::MultiSet { entries };
    let mut stream = BytesMut::new();
    encode_command(&command, &mut stream);

    let mut decoder = CommandDecoder::new(TcpLimits::default());
    let mut buf = BytesMut::new();
    let mut decoded = Vec::new();
    let (mut fed, mut calls) = (0u64, 0u64);
    for piece in stream.chunks(16) {
        buf.extend_from_slice(piece);
        fed += piece.len() as u64;
        calls += 1;
        if let Some(command) = decoder.decode(&mut buf).expect("a valid request") {
            decoded.push(command);
        }
        let bound = 2 * fed + 32 * calls;
        assert!(
            decoder.bytes_examined() <= bound,
            "after {fed} bytes in {calls} calls the decoder read {} bytes (bound {bound})",
            decoder.bytes_examined()
        );
    }
    assert_eq!(decoded, [command]);
    assert!(buf.is_empty());
    assert!(!decoder.is_mid_request());
}

/// The same for every query type, each fed one byte at a time: the work per call
/// is bounded by a constant, not by what is buffered.
#[test]
fn every_request_fed_byte_by_byte_costs_constant_work_per_byte() {
    let key = Bytes::from(vec![b'k'; 300]);
    let value = Bytes::from(vec![b'v'; 5000]);
    let commands = [
        Command::Set { key: key.clone(), value: value.clone() },
        Command::CompareSet { key: key.clone(), expected: value.clone(), desired: value.clone() },
        Command::Add { key: key.clone(), delta: -3 },
        Command::Wait { keys: vec![key.clone(); 40] },
        Command::MultiSet { entries: vec![(key.clone(), value.clone()); 3] },
        Command::Barrier { key, world_size: 8 },
    ];
    for command in commands {
        let mut stream = BytesMut::new();
        encode_command(&command, &mut stream);
        let mut decoder = CommandDecoder::new(TcpLimits::default());
        let mut buf = BytesMut::new();
        let mut decoded = None;
        for &byte in stream.iter() {
            buf.put_u8(byte);
            decoded = decoder.decode(&mut buf).expect("valid").or(decoded);
        }
        assert_eq!(decoded.as_ref(), Some(&command));
        let per_byte = decoder.bytes_examined() as f64 / stream.len() as f64;
        assert!(per_byte <= 40.0, "{}: {per_byte:.1} bytes read per byte fed", command.name());
    }
}

/// The decoder keeps no view of the buffer between calls: what it returns owns its
/// bytes, and a buffer that shrank (the caller dropped it) is decoded from its front.
#[test]
fn a_buffer_replaced_mid_request_is_decoded_afresh() {
    let mut decoder = CommandDecoder::new(TcpLimits::default());
    let mut set = BytesMut::new();
    encode_command(&Command::Set { key: Bytes::from_static(b"/a"), value: Bytes::from_static(b"123") }, &mut set);
    let mut buf = BytesMut::from(&set[..set.len() - 1]);
    assert_eq!(decoder.decode(&mut buf), Ok(None));
    assert!(decoder.is_mid_request());
    let mut other = BytesMut::new();
    encode_command(&Command::Get { key: Bytes::from_static(b"/b") }, &mut other);
    assert_eq!(decoder.decode(&mut other), Ok(Some(Command::Get { key: Bytes::from_static(b"/b") })));
}

/// Native frames are length-prefixed: whether one is whole is known from its prefix
/// alone, and its body is not looked at until then. A body that does not decode
/// gives `Ok(None)`, consuming nothing, at every cut before its last byte; only the
/// whole frame is an error.
#[test]
fn a_partial_native_frame_is_never_parsed() {
    let mut body = vec![0x02];
    body.extend_from_slice(&7u64.to_le_bytes());
    body.push(0x7f); // unknown opcode
    body.extend_from_slice(&[0xaa; 1000]);
    let mut frame = BytesMut::new();
    frame.put_u32_le(body.len() as u32);
    frame.put_slice(&body);
    let limits = FrameLimits::default();
    for cut in 0..frame.len() {
        let mut src = BytesMut::from(&frame[..cut]);
        assert_eq!(decode_client_frame(&mut src, &limits), Ok(None), "cut at {cut}");
        assert_eq!(decode_server_frame(&mut src, &limits), Ok(None), "cut at {cut}");
        assert_eq!(decode_agent_frame(&mut src, &limits), Ok(None), "cut at {cut}");
        assert_eq!(decode_root_frame(&mut src, &limits), Ok(None), "cut at {cut}");
        assert_eq!(src.len(), cut);
    }
    let whole = || BytesMut::from(&frame[..]);
    assert!(matches!(decode_client_frame(&mut whole(), &limits), Err(ProtoError::BadRequest { id: Some(7), .. })));
    assert!(matches!(decode_server_frame(&mut whole(), &limits), Err(ProtoError::BadReply { .. })));
    assert!(matches!(decode_agent_frame(&mut whole(), &limits), Err(ProtoError::BadSubFrame { .. })));
    assert!(matches!(decode_root_frame(&mut whole(), &limits), Err(ProtoError::BadSubFrame { .. })));
    // And a good frame after it decodes: nothing of the bad one was left behind.
    let mut src = whole();
    encode_client_frame(&ClientFrame::Request { id: 8, request: Request::NumKeys }, &mut src);
    assert!(decode_client_frame(&mut src, &limits).is_err());
    assert_eq!(
        decode_client_frame(&mut src, &limits),
        Ok(Some(ClientFrame::Request { id: 8, request: Request::NumKeys }))
    );
}
