//! The fuzz targets' stream-cut property (tests/stream_cut/mod.rs) on stable, so that
//! CI catches a regression without nightly: over random streams of valid frames and
//! requests, damaged at random places and cut at random points, and over every input
//! the fuzzers keep (fuzz/seeds, the local fuzz/corpus if any, and the crash inputs
//! kept as regressions in fuzz/regressions). Each run also checks that no single
//! allocation exceeded a bound proportional to the input: a length or count a peer
//! merely claims never sizes an allocation.

mod common;
mod stream_cut;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::{Path, PathBuf};

use bytes::BytesMut;
use common::{bytes, client_frame, identity, keys, op_error, request, response, samples, server_frame, string};
use proptest::collection::vec;
use proptest::prelude::*;
use rallypoint_core::{Identity, SessionId, Welcome};
use rallypoint_proto::native::{
    encode_agent_frame, encode_client_frame, encode_root_frame, encode_server_frame, AgentFrame, ClientFrame,
    RootFrame, ServerFrame,
};
use rallypoint_proto::tcpstore::{encode_command, Command};
use stream_cut::{check, make_input, split_input, Cuts, Target};

/// The system allocator, noting the largest single allocation of each thread.
struct Tracking;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

/// Notes an allocation made by a decoder.
fn note(size: usize) {
    if stream_cut::IN_DECODER.try_with(Cell::get).unwrap_or(false) {
        let _ = LARGEST.try_with(|largest| largest.set(largest.get().max(size)));
    }
}

// SAFETY: every call is passed on unchanged to `System`.
unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        System.alloc_zeroed(layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        System.realloc(ptr, layout, new_size)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static ALLOCATOR: Tracking = Tracking;

/// The property, and no allocation by a decoder larger than a small multiple of the
/// input (a decoded value holds at most a few words per byte of input).
fn check_bounded(target: Target, cuts: &Cuts, stream: &[u8]) {
    LARGEST.with(|largest| largest.set(0));
    check(target, cuts, stream);
    let largest = LARGEST.with(Cell::get);
    let bound = 16 * stream.len() + 4096;
    assert!(
        largest <= bound,
        "{}: an allocation of {largest} bytes for {} bytes of input",
        target.name(),
        stream.len()
    );
}

fn encoded<T>(items: &[T], encode: fn(&T, &mut BytesMut)) -> Vec<u8> {
    let mut stream = BytesMut::new();
    items.iter().for_each(|item| encode(item, &mut stream));
    stream.to_vec()
}

fn agent_frame() -> impl Strategy<Value = AgentFrame> {
    let calls = || vec((any::<u64>(), any::<u64>()), 0..4);
    prop_oneof![
        (string(), any::<u32>()).prop_map(|(host, pid)| AgentFrame::Hello { host, pid }),
        (any::<u64>(), identity()).prop_map(|(sub, identity)| AgentFrame::SubHello { sub, identity }),
        (any::<u64>(), any::<u64>(), request()).prop_map(|(sub, id, request)| AgentFrame::SubRequest {
            sub,
            id,
            request
        }),
        (any::<u64>(), any::<bool>()).prop_map(|(sub, gone)| AgentFrame::SubClose { sub, gone }),
        (calls(), request()).prop_map(|(calls, request)| AgentFrame::SubRequests { calls, request }),
    ]
}

fn root_frame() -> impl Strategy<Value = RootFrame> {
    let calls = || vec((any::<u64>(), any::<u64>()), 0..4);
    let reply = || prop_oneof![response().prop_map(Ok), op_error().prop_map(Err)];
    prop_oneof![
        any::<u64>().prop_map(|lease_ms| RootFrame::Welcome { lease_ms }),
        op_error().prop_map(RootFrame::Refused),
        (any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(sub, session, lease_ms)| RootFrame::SubWelcome {
            sub,
            welcome: Welcome { session: SessionId(session), lease_ms, job_incarnation: None }
        }),
        (any::<u64>(), op_error()).prop_map(|(sub, error)| RootFrame::SubRefused { sub, error }),
        (any::<u64>(), any::<u64>(), reply()).prop_map(|(sub, id, reply)| RootFrame::SubReply { sub, id, reply }),
        // One call is encoded as a plain SubReply: aggregated frames carry two or more.
        (vec((any::<u64>(), any::<u64>()), 2..4), reply())
            .prop_map(|(calls, reply)| RootFrame::SubReplies { calls, reply }),
        (calls(), reply()).prop_map(|(calls, reply)| RootFrame::SubReplies { calls, reply }),
    ]
}

fn command() -> impl Strategy<Value = Command> {
    let entries = || vec((bytes(), bytes()), 0..4);
    prop_oneof![
        any::<u32>().prop_map(|magic| Command::Validate { magic }),
        (bytes(), bytes()).prop_map(|(key, value)| Command::Set { key, value }),
        (bytes(), bytes(), bytes()).prop_map(|(key, expected, desired)| Command::CompareSet { key, expected, desired }),
        bytes().prop_map(|key| Command::Get { key }),
        (bytes(), any::<i64>()).prop_map(|(key, delta)| Command::Add { key, delta }),
        keys().prop_map(|keys| Command::Check { keys }),
        keys().prop_map(|keys| Command::Wait { keys }),
        Just(Command::NumKeys),
        bytes().prop_map(|key| Command::DeleteKey { key }),
        (bytes(), bytes()).prop_map(|(key, value)| Command::Append { key, value }),
        keys().prop_map(|keys| Command::MultiGet { keys }),
        entries().prop_map(|entries| Command::MultiSet { entries }),
        Just(Command::CancelWait),
        any::<u32>().prop_map(|nonce| Command::Ping { nonce }),
        (bytes(), bytes()).prop_map(|(key, value)| Command::QueuePush { key, value }),
        bytes().prop_map(|key| Command::QueuePop { key }),
        bytes().prop_map(|key| Command::QueueLen { key }),
        Just(Command::ListKeys),
        (bytes(), any::<i64>()).prop_map(|(key, world_size)| Command::Barrier { key, world_size }),
    ]
}

/// A valid stream of `target`'s frames or requests.
fn valid_stream(target: Target) -> BoxedStrategy<Vec<u8>> {
    let n = 0..6;
    match target {
        Target::ClientFrame => vec(client_frame(), n).prop_map(|f| encoded(&f, encode_client_frame)).boxed(),
        Target::ServerFrame => vec(server_frame(), n).prop_map(|f| encoded(&f, encode_server_frame)).boxed(),
        Target::AgentFrame => vec(agent_frame(), n).prop_map(|f| encoded(&f, encode_agent_frame)).boxed(),
        Target::RootFrame => vec(root_frame(), n).prop_map(|f| encoded(&f, encode_root_frame)).boxed(),
        Target::Tcpstore => vec(command(), n).prop_map(|c| encoded(&c, encode_command)).boxed(),
    }
}

/// A valid stream with a few bytes overwritten and its tail maybe cut off, and how to cut it.
fn damaged(target: Target) -> impl Strategy<Value = (Cuts, Vec<u8>)> {
    let cuts = (vec(1usize..=256, 0..16), any::<bool>()).prop_map(|(chunks, small)| Cuts { chunks, small });
    let damage = vec((any::<prop::sample::Index>(), any::<u8>()), 0..3);
    (cuts, valid_stream(target), damage, any::<prop::sample::Index>(), any::<bool>()).prop_map(
        |(cuts, mut stream, damage, cut, truncate)| {
            if !stream.is_empty() {
                for (at, byte) in damage {
                    let at = at.index(stream.len());
                    stream[at] = byte;
                }
                if truncate {
                    stream.truncate(cut.index(stream.len()));
                }
            }
            (cuts, stream)
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn client_frames_cut_anywhere((cuts, stream) in damaged(Target::ClientFrame)) {
        check_bounded(Target::ClientFrame, &cuts, &stream);
    }

    #[test]
    fn server_frames_cut_anywhere((cuts, stream) in damaged(Target::ServerFrame)) {
        check_bounded(Target::ServerFrame, &cuts, &stream);
    }

    #[test]
    fn agent_frames_cut_anywhere((cuts, stream) in damaged(Target::AgentFrame)) {
        check_bounded(Target::AgentFrame, &cuts, &stream);
    }

    #[test]
    fn root_frames_cut_anywhere((cuts, stream) in damaged(Target::RootFrame)) {
        check_bounded(Target::RootFrame, &cuts, &stream);
    }

    #[test]
    fn tcpstore_requests_cut_anywhere((cuts, stream) in damaged(Target::Tcpstore)) {
        check_bounded(Target::Tcpstore, &cuts, &stream);
    }

    #[test]
    fn random_bytes_cut_anywhere(data in vec(any::<u8>(), 0..512)) {
        for target in Target::ALL {
            let (cuts, stream) = split_input(&data);
            check_bounded(target, &cuts, stream);
        }
    }

    #[test]
    fn fuzz_inputs_say_how_to_cut(chunks in vec(1usize..=256, 0..16), small: bool, stream in vec(any::<u8>(), 0..64)) {
        let cuts = Cuts { chunks, small };
        let input = make_input(&cuts, &stream);
        let (back, tail) = split_input(&input);
        prop_assert_eq!(back, Cuts { chunks: cuts.chunks.into_iter().take(15).collect(), small });
        prop_assert_eq!(tail, &stream[..]);
    }
}

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz")
}

/// Every file the fuzzers keep for `target`: its seeds, the local corpus (not in
/// git), and the crash inputs kept as regressions.
fn kept_inputs(target: Target) -> Vec<(PathBuf, Vec<u8>)> {
    let mut inputs = Vec::new();
    for dir in ["seeds", "corpus", "regressions"] {
        let Ok(entries) = std::fs::read_dir(fuzz_dir().join(dir).join(target.name())) else { continue };
        for entry in entries.flatten() {
            let path = entry.path();
            if let Ok(data) = std::fs::read(&path) {
                inputs.push((path, data));
            }
        }
    }
    inputs
}

#[test]
fn every_kept_fuzz_input_holds() {
    let mut seeds = 0;
    for target in Target::ALL {
        for (path, data) in kept_inputs(target) {
            seeds += usize::from(path.parent().and_then(Path::parent).is_some_and(|p| p.ends_with("seeds")));
            let (cuts, stream) = split_input(&data);
            let outcome = std::panic::catch_unwind(|| check_bounded(target, &cuts, stream));
            assert!(outcome.is_ok(), "{} fails on {}", target.name(), path.display());
        }
    }
    assert!(seeds >= Target::ALL.len(), "the seed corpus is missing: run `{}`", SEED_COMMAND);
}

const SEED_COMMAND: &str = "cargo test -p rallypoint-proto --test stream_cuts -- --ignored write_seed_corpus";

/// Writes fuzz/seeds: for each target, one stream of a sample of every variant (fed
/// one byte at a time and in pieces of 7, 100 and 256 bytes), and each sample alone. Run by hand when a frame kind or request is added (see scripts/fuzz).
#[test]
#[ignore]
fn write_seed_corpus() {
    let streams: Vec<(Target, Vec<Vec<u8>>)> = vec![
        (Target::ClientFrame, {
            let requests = samples(request(), 24).into_iter().map(|request| ClientFrame::Request { id: 1, request });
            let frames: Vec<_> =
                [ClientFrame::Hello(Identity::ranked("job", 0, 2))].into_iter().chain(requests).collect();
            singles(&frames, encode_client_frame)
        }),
        (Target::ServerFrame, {
            let replies =
                samples(response(), 7).into_iter().map(Ok).chain(samples(op_error(), 12).into_iter().map(Err));
            let frames: Vec<_> = replies
                .enumerate()
                .map(|(id, reply)| ServerFrame::Reply { id: id as u64, reply })
                .chain([ServerFrame::Welcome(Welcome { session: SessionId(3), lease_ms: 9, job_incarnation: Some(7) })])
                .collect();
            singles(&frames, encode_server_frame)
        }),
        (Target::AgentFrame, {
            let mut frames = vec![
                AgentFrame::Hello { host: "node".into(), pid: 7 },
                AgentFrame::SubHello { sub: 1, identity: Identity::ranked("job", 0, 2) },
                AgentFrame::SubClose { sub: 1, gone: true },
            ];
            for request in samples(request(), 24) {
                frames.push(AgentFrame::SubRequest { sub: 1, id: 2, request: request.clone() });
                frames.push(AgentFrame::SubRequests { calls: vec![(1, 2), (3, 4)], request });
            }
            singles(&frames, encode_agent_frame)
        }),
        (Target::RootFrame, {
            let mut frames = vec![
                RootFrame::Welcome { lease_ms: 5 },
                RootFrame::SubWelcome {
                    sub: 1,
                    welcome: Welcome { session: SessionId(2), lease_ms: 5, job_incarnation: None },
                },
            ];
            for error in samples(op_error(), 12) {
                frames.push(RootFrame::SubRefused { sub: 1, error: error.clone() });
                frames.push(RootFrame::SubReply { sub: 1, id: 2, reply: Err(error) });
            }
            for response in samples(response(), 7) {
                frames.push(RootFrame::SubReplies { calls: vec![(1, 2), (3, 4)], reply: Ok(response) });
            }
            singles(&frames, encode_root_frame)
        }),
        (Target::Tcpstore, singles(&samples(command(), 19), encode_command)),
    ];
    for (target, streams) in streams {
        let dir = fuzz_dir().join("seeds").join(target.name());
        std::fs::create_dir_all(&dir).expect("create the seed directory");
        let all: Vec<u8> = streams.concat();
        let mut inputs: Vec<Vec<u8>> = [vec![], vec![7], vec![100], vec![256]]
            .into_iter()
            .map(|chunks| make_input(&Cuts { chunks, small: false }, &all))
            .collect();
        inputs.extend(streams.iter().map(|s| make_input(&Cuts { chunks: vec![3], small: false }, s)));
        for (i, input) in inputs.iter().enumerate() {
            std::fs::write(dir.join(format!("seed-{i:03}")), input).expect("write a seed");
        }
    }
}

/// Each item encoded alone.
fn singles<T>(items: &[T], encode: fn(&T, &mut BytesMut)) -> Vec<Vec<u8>> {
    items.iter().map(|item| encoded(std::slice::from_ref(item), encode)).collect()
}
