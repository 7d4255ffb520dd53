//! A node's ranks at one barrier, sent as one SubRequests frame, are held by the
//! coordinator in one record and released as one reply (docs/PROTOCOL.md, section
//! 12). These tests cut a rank of such a frame away from its agent while its call is
//! held, or after its record was released or failed, and resume it: its call is
//! answered where its session is now, once, and a copy it sends again neither counts
//! twice nor goes unanswered.

use std::time::Duration;

use rallypoint::server::Protocol;
use rallypoint::{Client, Members, OpError};
use rallypoint_core::{Identity, Reply, Request, Response, SessionId};
use rallypoint_proto::native::{AgentFrame, RootFrame};

use crate::agent_resume::{barrier_of, long_grace, raw_rank, wait_for_status, welcomed, RawRank};
use crate::agents::{RawAgent, WAIT};
use crate::common::{bounded, connect, rank, start_server_with};

fn barrier() -> Request {
    Request::Barrier { name: "b".into(), members: Members::World, timeout_ms: Some(50_000) }
}

/// Every call the agent's next frames answer, until `calls` are all answered: each
/// `(sub-session, request id)` with its reply, in order.
async fn answered(agent: &mut RawAgent, calls: &[(u64, u64)]) -> Vec<((u64, u64), Reply)> {
    let mut got: Vec<((u64, u64), Reply)> = Vec::new();
    while !calls.iter().all(|call| got.iter().any(|(c, _)| c == call)) {
        match agent.next().await {
            RootFrame::SubReply { sub, id, reply } => got.push(((sub, id), reply)),
            RootFrame::SubReplies { calls, reply } => got.extend(calls.into_iter().map(|c| (c, reply.clone()))),
            other => panic!("expected replies to {calls:?}, got {other:?} after {got:?}"),
        }
    }
    got
}

/// Ranks 0 and 1 of `job` (of 3) behind `agent` as sub-sessions 1 and 2, both at
/// barrier 'b' in one frame (request ids 10 and 20); rank 2 connected directly.
async fn two_held(agent: &mut RawAgent, server: &rallypoint::server::ServerHandle, job: &str) -> (SessionId, Client) {
    agent
        .send(&[
            AgentFrame::SubHello { sub: 1, identity: raw_rank(job, 0, 3) },
            AgentFrame::SubHello { sub: 2, identity: raw_rank(job, 1, 3) },
        ])
        .await;
    welcomed(agent, 1).await;
    let session = welcomed(agent, 2).await;
    agent.send(&[AgentFrame::SubRequests { calls: vec![(1, 10), (2, 20)], request: barrier() }]).await;
    let peer = connect(server, rank(job, 2, 3)).await;
    wait_for_status(&peer, "ranks 0 and 1 held at the barrier", |s| s.contains("missing (1): rank 2")).await;
    (session, peer)
}

/// Where rank 1 says hello again after its connection to the agent was cut.
#[derive(Debug, Clone, Copy)]
enum Via {
    /// The same agent, as a new sub-session (3).
    SameAgent,
    /// Directly.
    Direct,
    /// Another agent, as its sub-session 1.
    OtherAgent,
}

/// Rank 1, held in a record with rank 0, is cut from its agent and resumes its
/// session through the same agent, directly or through another, sending its call
/// again: the record's release answers rank 0 where it was and rank 1 where it is
/// now, each once, and the copy did not count (generation 2 waits for rank 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_call_is_answered_where_its_session_resumed() {
    let server = start_server_with(long_grace()).await;
    for via in [Via::SameAgent, Via::Direct, Via::OtherAgent] {
        let job = format!("held-moves-{via:?}");
        let mut a = RawAgent::connect(&server).await;
        let mut b = RawAgent::connect(&server).await;
        let (session, peer) = two_held(&mut a, &server, &job).await;
        let again = Identity { resume: Some(session), ..raw_rank(&job, 1, 3) };
        let mut direct = None;
        match via {
            Via::SameAgent => {
                a.send(&[
                    AgentFrame::SubHello { sub: 3, identity: again },
                    AgentFrame::SubClose { sub: 2, gone: false },
                ])
                .await;
                assert_eq!(welcomed(&mut a, 3).await, session, "{via:?}: resumed");
                a.send(&[AgentFrame::SubRequests { calls: vec![(3, 20)], request: barrier() }]).await;
            }
            Via::Direct => {
                let (mut rank1, resumed) = RawRank::hello(&server, again).await;
                assert_eq!(resumed, session, "{via:?}: resumed");
                rank1.request(20, barrier()).await;
                direct = Some(rank1);
            }
            Via::OtherAgent => {
                b.send(&[AgentFrame::SubHello { sub: 1, identity: again }]).await;
                assert_eq!(welcomed(&mut b, 1).await, session, "{via:?}: resumed");
                b.send(&[AgentFrame::SubRequests { calls: vec![(1, 20)], request: barrier() }]).await;
            }
        }
        // The copy is in (a heartbeat after it on the same path comes back first).
        wait_for_status(&peer, "the copy taken in", |s| s.contains("missing (1): rank 2")).await;
        bounded("rank 2's barrier", peer.barrier("b", Members::World, WAIT))
            .await
            .unwrap_or_else(|e| panic!("{via:?}: rank 2's barrier: {e}"));
        let done = Ok(Response::Done);
        match via {
            Via::SameAgent => {
                let got = answered(&mut a, &[(1, 10), (3, 20)]).await;
                assert_eq!(got, [((1, 10), done.clone()), ((3, 20), done.clone())], "{via:?}");
            }
            Via::Direct => {
                assert_eq!(answered(&mut a, &[(1, 10)]).await, [((1, 10), done.clone())], "{via:?}");
                if let Some(rank1) = &mut direct {
                    rank1.done(20).await;
                }
            }
            Via::OtherAgent => {
                assert_eq!(answered(&mut a, &[(1, 10)]).await, [((1, 10), done.clone())], "{via:?}");
                assert_eq!(answered(&mut b, &[(1, 20)]).await, [((1, 20), done.clone())], "{via:?}");
            }
        }
        assert!(server.lost_ranks(&job).is_empty(), "{via:?}: {:?}", server.lost_ranks(&job));

        // Generation 2 waits for rank 1: its copy did not count.
        let second = barrier_of(&peer, "b");
        a.send(&[AgentFrame::SubRequest { sub: 1, id: 11, request: barrier() }]).await;
        wait_for_status(&peer, "generation 2 waiting for rank 1", |s| {
            s.contains("waiting: barrier 'b' (generation 2)") && s.contains("missing (1): rank 1")
        })
        .await;
        match (&mut direct, via) {
            (Some(rank1), _) => {
                rank1.request(21, barrier()).await;
                rank1.done(21).await;
            }
            (None, Via::SameAgent) => {
                a.send(&[AgentFrame::SubRequest { sub: 3, id: 21, request: barrier() }]).await;
                answered(&mut a, &[(1, 11), (3, 21)]).await;
            }
            (None, _) => {
                b.send(&[AgentFrame::SubRequest { sub: 1, id: 21, request: barrier() }]).await;
                answered(&mut b, &[(1, 21)]).await;
            }
        }
        bounded("rank 2's second barrier", second).await.expect("task").expect("generation 2 passes");
        bounded("close", peer.close()).await.expect("clean leave");
    }
    server.shutdown().await;
}

/// How a held record ends while rank 1 is cut away from its agent.
#[derive(Debug, Clone, Copy)]
enum End {
    /// Rank 2 arrives: the record is released.
    Released,
    /// Rank 0's process is gone: the generation fails, naming it.
    Failed,
}

/// Rank 1's record ends while its connection is cut; it then resumes through its
/// agent and sends its call again: the copy gets the record's outcome (a release,
/// or the failure naming rank 0) and counts for nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_sent_again_after_its_record_ended_gets_the_outcome() {
    let server = start_server_with(long_grace()).await;
    for end in [End::Released, End::Failed] {
        let job = format!("held-ended-{end:?}");
        let mut a = RawAgent::connect(&server).await;
        let (session, peer) = two_held(&mut a, &server, &job).await;
        a.send(&[AgentFrame::SubClose { sub: 2, gone: false }]).await;
        wait_for_status(&peer, "rank 1 reconnecting", |s| s.contains("reconnecting")).await;
        match end {
            End::Released => {
                bounded("rank 2's barrier", peer.barrier("b", Members::World, WAIT)).await.expect("released");
                // Rank 0's reply; rank 1's went to the closed sub-session.
                answered(&mut a, &[(1, 10)]).await;
            }
            End::Failed => a.send(&[AgentFrame::SubClose { sub: 1, gone: true }]).await,
        }
        let again = Identity { resume: Some(session), ..raw_rank(&job, 1, 3) };
        a.send(&[AgentFrame::SubHello { sub: 3, identity: again }]).await;
        assert_eq!(welcomed(&mut a, 3).await, session, "{end:?}: resumed");
        a.send(&[AgentFrame::SubRequests { calls: vec![(3, 20)], request: barrier() }]).await;
        let got = answered(&mut a, &[(3, 20)]).await;
        let reply = got.iter().find(|(call, _)| *call == (3, 20)).map(|(_, reply)| reply.clone());
        match (end, reply) {
            (End::Released, Some(Ok(Response::Done))) => {}
            (End::Failed, Some(Err(OpError::PeerLost { peer, .. }))) => assert_eq!(peer.rank, 0, "{end:?}"),
            (_, other) => panic!("{end:?}: the copy of rank 1's call got {other:?}"),
        }
        if let End::Released = end {
            // Generation 2 waits for rank 1, whose copy did not count.
            let second = barrier_of(&peer, "b");
            a.send(&[AgentFrame::SubRequest { sub: 1, id: 11, request: barrier() }]).await;
            wait_for_status(&peer, "generation 2 waiting for rank 1", |s| {
                s.contains("waiting: barrier 'b' (generation 2)") && s.contains("missing (1): rank 1")
            })
            .await;
            a.send(&[AgentFrame::SubRequest { sub: 3, id: 21, request: barrier() }]).await;
            answered(&mut a, &[(1, 11), (3, 21)]).await;
            bounded("rank 2's second barrier", second).await.expect("task").expect("generation 2 passes");
        }
        bounded("close", peer.close()).await.expect("clean leave");
    }
    server.shutdown().await;
}

/// Rank 0, alone behind agent A, is held at barrier 'b' in a record of A. Its
/// connection to A is cut and it resumes its session directly, sending the call
/// again (the copy is dropped: the call waits). Then A's connection ends (A carries
/// nothing any more). Rank 1 arrives: the generation is released, and rank 0's call
/// is answered on its direct connection, though the record's agent is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_call_is_answered_after_its_agent_left() {
    let server = start_server_with(long_grace()).await;
    let job = "held-agent-gone";
    let mut a = RawAgent::connect(&server).await;
    a.send(&[AgentFrame::SubHello { sub: 1, identity: raw_rank(job, 0, 2) }]).await;
    let session = welcomed(&mut a, 1).await;
    a.send(&[AgentFrame::SubRequests { calls: vec![(1, 10)], request: barrier() }]).await;
    let peer = connect(&server, rank(job, 1, 2)).await;
    wait_for_status(&peer, "rank 0 held", |s| s.contains("missing (1): rank 1")).await;

    let again = Identity { resume: Some(session), ..raw_rank(job, 0, 2) };
    let (mut rank0, resumed) = RawRank::hello(&server, again).await;
    assert_eq!(resumed, session, "resumed");
    rank0.request(10, barrier()).await;
    drop(a);
    // The coordinator has closed the agent's link before rank 1 arrives.
    let agents_open = || {
        let traffic = server.observer().metrics().traffic;
        traffic.protocols.iter().filter(|p| p.protocol == Protocol::Agent).map(|p| p.open).sum::<u64>()
    };
    for _ in 0..1_000 {
        if agents_open() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(agents_open(), 0, "the coordinator still holds the agent's link");
    assert!(server.lost_ranks(job).is_empty(), "{:?}", server.lost_ranks(job));

    bounded("rank 1's barrier", peer.barrier("b", Members::World, WAIT)).await.expect("released");
    bounded("rank 0's reply", rank0.done(10)).await;
    server.shutdown().await;
}

/// Rank 0 behind agent A as sub-session 1 resumes its session on A as sub-session 2.
/// The agent read the rank's barrier call (request 10) from the old connection late
/// and forwards it after the resuming hello, in the same write; the rank then sends
/// its copy on sub-session 2. Sub-session 1 no longer speaks for the session
/// (docs/PROTOCOL.md, section 12): the call counts once, from sub-session 2, and its
/// release reaches the rank there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_of_the_sub_session_left_in_the_resuming_write_is_not_the_sessions() {
    let server = start_server_with(long_grace()).await;
    let job = "held-stale-sub";
    let mut a = RawAgent::connect(&server).await;
    a.send(&[AgentFrame::SubHello { sub: 1, identity: raw_rank(job, 0, 2) }]).await;
    let session = welcomed(&mut a, 1).await;
    let peer = connect(&server, rank(job, 1, 2)).await;
    let again = Identity { resume: Some(session), ..raw_rank(job, 0, 2) };
    a.send(&[
        AgentFrame::SubHello { sub: 2, identity: again },
        AgentFrame::SubRequests { calls: vec![(1, 10)], request: barrier() },
    ])
    .await;
    assert_eq!(welcomed(&mut a, 2).await, session, "resumed");
    a.send(&[AgentFrame::SubRequests { calls: vec![(2, 10)], request: barrier() }]).await;
    wait_for_status(&peer, "rank 0 at the barrier", |s| s.contains("missing (1): rank 1")).await;
    bounded("rank 1's barrier", peer.barrier("b", Members::World, WAIT)).await.expect("released");
    assert_eq!(answered(&mut a, &[(2, 10)]).await, [((2, 10), Ok(Response::Done))]);
    server.shutdown().await;
}
