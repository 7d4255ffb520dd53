//! Shared test helpers: proptest strategies for every protocol type, one sample
//! value of every variant, a decode loop, and the split-at-every-byte check.
#![allow(dead_code)] // each test binary uses its own subset

use bytes::{BufMut, Bytes, BytesMut};
use proptest::collection::vec;
use proptest::option;
use proptest::prelude::*;
use rallypoint_core::{
    AbortInfo, AuthRefusal, CallShape, CollectiveKind, Exit, Gathered, Identity, JobIncarnation, LossReason, Members,
    Missing, Name, OpError, OpRef, ProcessInfo, RankInfo, RankRanges, RankState, Request, Response, SessionId, Welcome,
};
use rallypoint_proto::native::{ClientFrame, FrameLimits, ProtoError, ServerFrame};

pub fn bytes() -> impl Strategy<Value = Bytes> {
    vec(any::<u8>(), 0..12).prop_map(Bytes::from)
}

pub fn keys() -> impl Strategy<Value = Vec<Bytes>> {
    vec(bytes(), 0..4)
}

/// Any Unicode, multi-byte characters included.
pub fn string() -> impl Strategy<Value = String> {
    ".{0,6}"
}

/// A collective's name: short and multi-byte, up to the most kept inline on 64-bit
/// targets, and past it.
pub fn name() -> impl Strategy<Value = Name> {
    prop_oneof![".{0,6}", "[ -~]{20,24}", "[ -~]{25,64}"].prop_map(Name::from)
}

pub fn members() -> impl Strategy<Value = Members> {
    prop_oneof![Just(Members::World), vec(any::<u32>(), 0..5).prop_map(Members::Ranks), name().prop_map(Members::Role)]
}

pub fn identity() -> impl Strategy<Value = Identity> {
    let who = (string(), any::<Option<u32>>(), any::<Option<u32>>(), string(), any::<u32>(), option::of(string()));
    let incarnations = (any::<Option<u64>>(), any::<Option<u64>>(), any::<Option<u64>>());
    (who, incarnations).prop_map(
        |((job, rank, world_size, host, pid, role), (incarnation, job_incarnation, resume))| Identity {
            job,
            rank,
            world_size,
            host,
            pid,
            role,
            incarnation,
            job_incarnation,
            resume: resume.map(SessionId),
        },
    )
}

pub fn request() -> impl Strategy<Value = Request> {
    let t = any::<Option<u64>>;
    prop_oneof![
        (bytes(), bytes()).prop_map(|(key, value)| Request::Set { key, value }),
        (bytes(), t()).prop_map(|(key, timeout_ms)| Request::Get { key, timeout_ms }),
        (bytes(), any::<i64>()).prop_map(|(key, delta)| Request::Add { key, delta }),
        (bytes(), bytes(), bytes()).prop_map(|(key, expected, desired)| Request::CompareSet { key, expected, desired }),
        (bytes(), bytes()).prop_map(|(key, value)| Request::Append { key, value }),
        bytes().prop_map(|key| Request::Delete { key }),
        keys().prop_map(|keys| Request::Check { keys }),
        (keys(), t()).prop_map(|(keys, timeout_ms)| Request::Wait { keys, timeout_ms }),
        (keys(), t()).prop_map(|(keys, timeout_ms)| Request::MultiGet { keys, timeout_ms }),
        vec((bytes(), bytes()), 0..4).prop_map(|entries| Request::MultiSet { entries }),
        Just(Request::NumKeys),
        bytes().prop_map(|prefix| Request::ListKeys { prefix }),
        (name(), members(), t()).prop_map(|(name, members, timeout_ms)| Request::Barrier { name, members, timeout_ms }),
        (name(), members(), bytes(), t())
            .prop_map(|(name, members, value, timeout_ms)| { Request::AllGather { name, members, value, timeout_ms } }),
        (name(), members(), any::<u32>(), option::of(bytes()), t()).prop_map(
            |(name, members, root, value, timeout_ms)| Request::Broadcast { name, members, root, value, timeout_ms }
        ),
        string().prop_map(|reason| Request::Abort { reason }),
        (any::<u32>(), string(), any::<u32>(), exit()).prop_map(|(rank, host, pid, exit)| Request::RankExited {
            rank,
            host,
            pid,
            exit
        }),
        Just(Request::Heartbeat),
        Just(Request::Leave),
        Just(Request::Abandon),
        (bytes(), bytes()).prop_map(|(key, value)| Request::QueuePush { key, value }),
        bytes().prop_map(|key| Request::QueuePop { key }),
        bytes().prop_map(|key| Request::QueueLen { key }),
        Just(Request::CancelWait),
        (bytes(), any::<i64>(), t()).prop_map(|(key, world_size, timeout_ms)| Request::StoreBarrier {
            key,
            world_size,
            timeout_ms
        }),
        Just(Request::Status),
        any::<u64>().prop_map(|incarnation| Request::Reset { incarnation }),
        Just(Request::Jobs),
        Just(Request::Snapshot),
    ]
}

pub fn response() -> impl Strategy<Value = Response> {
    prop_oneof![
        Just(Response::Done),
        bytes().prop_map(Response::Value),
        any::<i64>().prop_map(Response::Int),
        any::<bool>().prop_map(Response::Bool),
        keys().prop_map(Response::Values),
        keys().prop_map(|values| Response::Gathered(Gathered::new(values))),
        (any::<i64>(), proptest::option::of(bytes()))
            .prop_map(|(len_before, value)| Response::Popped { len_before, value }),
    ]
}

fn collective_kind() -> impl Strategy<Value = CollectiveKind> {
    prop_oneof![Just(CollectiveKind::Barrier), Just(CollectiveKind::AllGather), Just(CollectiveKind::Broadcast)]
}

fn op_ref() -> impl Strategy<Value = OpRef> {
    (collective_kind(), string(), any::<u64>()).prop_map(|(kind, name, generation)| OpRef { kind, name, generation })
}

fn rank_state() -> impl Strategy<Value = RankState> {
    prop_oneof![
        Just(RankState::NeverConnected),
        Just(RankState::Connected),
        Just(RankState::Left),
        Just(RankState::Lost(LossReason::Disconnected)),
        any::<u64>().prop_map(|lease_ms| RankState::Lost(LossReason::LeaseExpired { lease_ms })),
        (any::<u32>(), exit()).prop_map(|(pid, exit)| RankState::Lost(LossReason::Exited { pid, exit })),
        any::<u32>().prop_map(|pid| RankState::Finished { pid }),
    ]
}

fn exit() -> impl Strategy<Value = Exit> {
    prop_oneof![any::<i32>().prop_map(Exit::Code), any::<i32>().prop_map(Exit::Signal)]
}

fn rank_ranges() -> impl Strategy<Value = RankRanges> {
    (vec((any::<u32>(), any::<u32>()), 0..4), any::<u64>()).prop_map(|(ranges, count)| RankRanges { ranges, count })
}

fn rank_info() -> impl Strategy<Value = RankInfo> {
    (any::<u32>(), option::of(string()), any::<Option<u32>>(), rank_state(), any::<Option<u64>>())
        .prop_map(|(rank, host, pid, state, last_seen_ms_ago)| RankInfo { rank, host, pid, state, last_seen_ms_ago })
}

fn call_shape() -> impl Strategy<Value = CallShape> {
    (any::<u32>(), members(), any::<u32>(), any::<Option<u32>>())
        .prop_map(|(rank, members, world_size, root)| CallShape { rank, members, world_size, root })
}

fn process() -> impl Strategy<Value = Box<ProcessInfo>> {
    (any::<u32>(), string(), any::<Option<u64>>())
        .prop_map(|(pid, host, incarnation)| Box::new(ProcessInfo { pid, host, incarnation }))
}

fn job_incarnation() -> impl Strategy<Value = Box<JobIncarnation>> {
    (any::<u64>(), any::<u64>(), process(), any::<bool>()).prop_map(|(incarnation, since_unix_ms, by, reset)| {
        Box::new(JobIncarnation { incarnation, since_unix_ms, by: *by, reset })
    })
}

fn abort_info() -> impl Strategy<Value = AbortInfo> {
    (any::<Option<u32>>(), string(), any::<u32>(), string()).prop_map(|(by_rank, host, pid, reason)| AbortInfo {
        by_rank,
        host,
        pid,
        reason,
    })
}

pub fn op_error() -> impl Strategy<Value = OpError> {
    prop_oneof![
        (op_ref(), any::<u64>(), any::<u32>(), vec(rank_info(), 0..4), rank_ranges(), any::<Option<u64>>()).prop_map(
            |(op, waited_ms, members, named, rest, before_call_ms)| {
                let missing = Missing::new(named, rest);
                OpError::CollectiveTimeout { op, waited_ms, members, missing, before_call_ms }
            }
        ),
        (any::<u64>(), keys()).prop_map(|(waited_ms, missing)| OpError::KeyTimeout { waited_ms, missing }),
        (op_ref(), rank_info()).prop_map(|(op, peer)| OpError::PeerLost { op, peer }),
        (op_ref(), rank_info()).prop_map(|(op, this)| OpError::ThisRankLost { op, this }),
        (string(), abort_info()).prop_map(|(job, by)| OpError::Aborted { job, by }),
        (op_ref(), call_shape(), call_shape()).prop_map(|(op, mine, theirs)| OpError::Mismatch {
            op,
            mine: Box::new(mine),
            theirs: Box::new(theirs)
        }),
        (collective_kind(), string(), string()).prop_map(|(kind, name, reason)| OpError::BadMembers {
            kind,
            name,
            reason
        }),
        string().prop_map(|op| OpError::NoRank { op }),
        (bytes(), bytes()).prop_map(|(key, value)| OpError::NotANumber { key, value }),
        (bytes(), any::<i64>(), any::<i64>()).prop_map(|(key, current, delta)| OpError::Overflow {
            key,
            current,
            delta
        }),
        (string(), any::<u64>(), any::<u64>()).prop_map(|(what, len, limit)| OpError::TooLarge { what, len, limit }),
        string().prop_map(OpError::Invalid),
        string().prop_map(OpError::Closed),
        (any::<u32>(), process(), any::<u64>(), process()).prop_map(|(rank, holder, since_unix_ms, claimant)| {
            OpError::RankHeld { rank, holder, since_unix_ms, claimant }
        }),
        (any::<u32>(), process(), any::<u64>(), process())
            .prop_map(|(rank, by, at_unix_ms, this)| OpError::TakenOver { rank, by, at_unix_ms, this }),
        (string(), job_incarnation()).prop_map(|(job, to)| OpError::JobReset { job, to }),
        (string(), any::<u64>(), job_incarnation()).prop_map(|(job, mine, current)| OpError::StaleIncarnation {
            job,
            mine,
            current
        }),
        prop_oneof![
            Just(AuthRefusal::TokenRequired),
            Just(AuthRefusal::WrongToken),
            Just(AuthRefusal::TlsRequired),
            Just(AuthRefusal::NoTokenHere),
        ]
        .prop_map(OpError::Unauthorized),
    ]
}

pub fn client_frame() -> impl Strategy<Value = ClientFrame> {
    prop_oneof![
        identity().prop_map(ClientFrame::Hello),
        (any::<u64>(), request()).prop_map(|(id, request)| ClientFrame::Request { id, request }),
        any::<[u8; 32]>().prop_map(|nonce| ClientFrame::AuthStart { nonce }),
        any::<[u8; 32]>().prop_map(|proof| ClientFrame::AuthProof { proof }),
    ]
}

pub fn server_frame() -> impl Strategy<Value = ServerFrame> {
    prop_oneof![
        (any::<u64>(), any::<u64>(), any::<Option<u64>>()).prop_map(|(session, lease_ms, job_incarnation)| {
            ServerFrame::Welcome(Welcome { session: SessionId(session), lease_ms, job_incarnation })
        }),
        op_error().prop_map(ServerFrame::Refused),
        (any::<u64>(), response()).prop_map(|(id, response)| ServerFrame::Reply { id, reply: Ok(response) }),
        (any::<u64>(), op_error()).prop_map(|(id, error)| ServerFrame::Reply { id, reply: Err(error) }),
        any::<[u8; 32]>().prop_map(|nonce| ServerFrame::AuthChallenge { nonce }),
        any::<[u8; 32]>().prop_map(|proof| ServerFrame::AuthAccepted { proof }),
    ]
}

/// One sample value of every variant, drawn from the strategies with a fixed seed
/// and checked to cover each variant (by the `Debug` name of its variant).
pub fn samples<T: std::fmt::Debug>(strategy: impl Strategy<Value = T>, variants: usize) -> Vec<T> {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, TestRng, TestRunner};
    let mut runner = TestRunner::new_with_rng(Config::default(), TestRng::deterministic_rng(Default::default()));
    let mut seen = std::collections::BTreeMap::new();
    for _ in 0..100_000 {
        let value = strategy.new_tree(&mut runner).expect("strategy").current();
        let debug = format!("{value:?}");
        let name: String = debug.chars().take_while(|c| c.is_alphanumeric()).collect();
        seen.entry(name).or_insert(value);
        if seen.len() == variants {
            return seen.into_values().collect();
        }
    }
    panic!("only {} of {variants} variants generated: {:?}", seen.len(), seen.keys().collect::<Vec<_>>());
}

/// Decodes every whole frame in `src`, stopping at the first `Ok(None)` or fatal error.
pub fn drain<T>(
    src: &mut BytesMut,
    decode: impl Fn(&mut BytesMut, &FrameLimits) -> Result<Option<T>, ProtoError>,
) -> Vec<Result<T, ProtoError>> {
    let mut out = Vec::new();
    loop {
        match decode(src, &FrameLimits::default()) {
            Ok(None) => return out,
            Ok(Some(frame)) => out.push(Ok(frame)),
            Err(e) => {
                let fatal = e.is_fatal();
                out.push(Err(e));
                if fatal {
                    return out;
                }
            }
        }
    }
}

/// Feeds `stream` split in two at every byte boundary, and one byte at a time,
/// and checks that each way decodes to `expected`.
pub fn assert_split_invariant<T: PartialEq + std::fmt::Debug>(
    stream: &[u8],
    expected: &[Result<T, ProtoError>],
    decode: impl Fn(&mut BytesMut, &FrameLimits) -> Result<Option<T>, ProtoError> + Copy,
) {
    for cut in 0..=stream.len() {
        let mut src = BytesMut::from(&stream[..cut]);
        let mut got = drain(&mut src, decode);
        src.extend_from_slice(&stream[cut..]);
        got.extend(drain(&mut src, decode));
        assert_eq!(got, expected, "split at byte {cut}");
        assert!(src.is_empty(), "bytes left over after split at {cut}");
    }
    let mut src = BytesMut::new();
    let mut got = Vec::new();
    for &byte in stream {
        src.put_u8(byte);
        got.extend(drain(&mut src, decode));
    }
    assert_eq!(got, expected, "fed one byte at a time");
}
