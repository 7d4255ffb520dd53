//! What goes up to the coordinator: the frames of the local ranks, gathered while
//! the previous write is in flight, with identical barrier calls of several ranks
//! merged into one SubRequests frame.

use std::collections::HashSet;

use foldhash::fast::RandomState;

use bytes::BytesMut;
use rallypoint_core::Request;
use rallypoint_proto::native::{encode_agent_frame, AgentFrame, MAX_CALLS_PER_FRAME};

/// Distinct barrier calls merged at once before a write; they are compared one by
/// one, and a node's ranks rarely wait at more than one or two barriers together.
const MAX_MERGED: usize = 8;

/// Frames for the coordinator not yet written.
#[derive(Default)]
pub(crate) struct Up {
    /// Frames for the coordinator not yet written.
    pub(crate) buf: BytesMut,
    /// Barrier calls of the local ranks not yet written, merged by identical request;
    /// [`Up::seal`] appends them to `buf`.
    pub(crate) merged: Vec<Merged>,
    /// Sub-sessions with a call in `merged`: their next frame must not overtake it.
    pub(crate) in_merged: HashSet<u64, RandomState>,
    /// Set once the coordinator connection has ended: why.
    pub(crate) lost: Option<String>,
}

/// One barrier call made by several local ranks: one SubRequests frame.
pub(crate) struct Merged {
    request: Request,
    /// `(sub, request id)` of each rank that made it.
    pub(crate) calls: Vec<(u64, u64)>,
}

impl Up {
    /// Nothing waits to be written.
    pub(crate) fn is_idle(&self) -> bool {
        self.buf.is_empty() && self.merged.is_empty()
    }

    /// A frame of `sub` is about to be appended: if a merged call of `sub` is still
    /// held back, everything merged goes first, so `sub`'s frames keep their order.
    /// (Holding back a call past other sub-sessions' frames is harmless: their ranks'
    /// calls were concurrent, and any interleaving of them is one they could have had.)
    pub(crate) fn order_before(&mut self, sub: u64) {
        if self.in_merged.contains(&sub) {
            self.seal();
        }
    }

    /// Adds a barrier call to the merged call with the same request, or starts one.
    pub(crate) fn merge(&mut self, sub: u64, id: u64, request: Request) {
        self.order_before(sub);
        match self.merged.iter_mut().find(|m| m.calls.len() < MAX_CALLS_PER_FRAME && m.request == request) {
            Some(merged) => merged.calls.push((sub, id)),
            None => {
                if self.merged.len() >= MAX_MERGED {
                    self.seal();
                }
                self.merged.push(Merged { request, calls: vec![(sub, id)] });
            }
        }
        self.in_merged.insert(sub);
    }

    /// Adds the calls `(sub, request id)`, all of `request`, as [`Up::merge`] would one
    /// by one, comparing the request once per frame instead of once per call.
    pub(crate) fn merge_all(&mut self, calls: &[(u64, u64)], request: &Request) {
        let mut at = None;
        for &(sub, id) in calls {
            if self.in_merged.contains(&sub) {
                self.seal();
                at = None;
            }
            let full = |m: &Merged| m.calls.len() >= MAX_CALLS_PER_FRAME;
            let index = match at.filter(|&i| !full(&self.merged[i])) {
                Some(i) => i,
                None => match self.merged.iter().position(|m| !full(m) && m.request == *request) {
                    Some(i) => i,
                    None => {
                        if self.merged.len() >= MAX_MERGED {
                            self.seal();
                        }
                        self.merged.push(Merged { request: request.clone(), calls: Vec::with_capacity(calls.len()) });
                        self.merged.len() - 1
                    }
                },
            };
            at = Some(index);
            self.merged[index].calls.push((sub, id));
            self.in_merged.insert(sub);
        }
    }

    /// Appends the merged calls to `buf`: a call made by one rank alone as the plain
    /// SubRequest it was.
    pub(crate) fn seal(&mut self) {
        for Merged { request, calls } in self.merged.drain(..) {
            let frame = match calls[..] {
                [(sub, id)] => AgentFrame::SubRequest { sub, id, request },
                _ => AgentFrame::SubRequests { calls, request },
            };
            encode_agent_frame(&frame, &mut self.buf);
        }
        self.in_merged.clear();
    }
}

#[cfg(test)]
mod tests {
    use rallypoint_core::Members;
    use rallypoint_proto::native::{decode_agent_frame, FrameLimits};

    use super::*;

    fn barrier(name: &str) -> Request {
        Request::Barrier { name: name.into(), members: Members::World, timeout_ms: Some(1000) }
    }

    fn sealed(up: &mut Up) -> Vec<AgentFrame> {
        up.seal();
        let mut frames = Vec::new();
        while let Some(frame) = decode_agent_frame(&mut up.buf, &FrameLimits::unbounded()).expect("well-formed") {
            frames.push(frame);
        }
        frames
    }

    #[test]
    fn identical_barrier_calls_go_up_as_one_frame_and_a_lone_call_as_it_was() {
        let mut up = Up::default();
        up.merge(1, 10, barrier("a"));
        up.merge(2, 20, barrier("a"));
        up.merge(3, 30, barrier("b"));
        up.merge(4, 40, barrier("a"));
        assert_eq!(
            sealed(&mut up),
            [
                AgentFrame::SubRequests { calls: vec![(1, 10), (2, 20), (4, 40)], request: barrier("a") },
                AgentFrame::SubRequest { sub: 3, id: 30, request: barrier("b") },
            ]
        );
        assert!(up.is_idle() && up.in_merged.is_empty());
    }

    #[test]
    fn a_later_frame_of_a_merged_rank_never_overtakes_its_call() {
        let mut up = Up::default();
        up.merge(1, 10, barrier("a"));
        up.merge(2, 20, barrier("a"));
        // Another rank's frame may pass the held-back calls...
        up.order_before(3);
        encode_agent_frame(&AgentFrame::SubClose { sub: 3, gone: false }, &mut up.buf);
        // ...but rank 1's next frame goes after its call, and so does its next barrier.
        up.order_before(1);
        encode_agent_frame(&AgentFrame::SubClose { sub: 1, gone: true }, &mut up.buf);
        up.merge(2, 21, barrier("a"));
        assert_eq!(
            sealed(&mut up),
            [
                AgentFrame::SubClose { sub: 3, gone: false },
                AgentFrame::SubRequests { calls: vec![(1, 10), (2, 20)], request: barrier("a") },
                AgentFrame::SubClose { sub: 1, gone: true },
                AgentFrame::SubRequest { sub: 2, id: 21, request: barrier("a") },
            ]
        );
    }

    #[test]
    fn merging_calls_all_at_once_makes_the_frames_merging_one_by_one_makes() {
        let n = MAX_CALLS_PER_FRAME as u64;
        // Calls already held: another barrier, and this one, of ranks that come again.
        let before = [(1, 5, "b"), (7, 5, "a"), (2, 5, "a")];
        let batches: [Vec<(u64, u64)>; 3] = [
            (10..20).map(|sub| (sub, 1)).collect(),
            vec![(3, 1), (2, 6), (4, 1), (1, 6)],
            (100..100 + n + 3).map(|sub| (sub, 1)).collect(),
        ];
        for calls in batches {
            let (mut all, mut one) = (Up::default(), Up::default());
            for (sub, id, name) in before {
                all.merge(sub, id, barrier(name));
                one.merge(sub, id, barrier(name));
            }
            all.merge_all(&calls, &barrier("a"));
            for &(sub, id) in &calls {
                one.merge(sub, id, barrier("a"));
            }
            assert_eq!(sealed(&mut all), sealed(&mut one), "calls {calls:?}");
        }
    }

    #[test]
    fn merged_calls_are_bounded_per_frame_and_in_kinds() {
        let mut up = Up::default();
        let n = MAX_CALLS_PER_FRAME as u64 + 1;
        for sub in 0..n {
            up.merge(sub, 1, barrier("a"));
        }
        let frames = sealed(&mut up);
        assert!(
            matches!(&frames[..], [AgentFrame::SubRequests { calls, .. }, AgentFrame::SubRequest { sub, .. }]
                if calls.len() == MAX_CALLS_PER_FRAME && *sub == n - 1),
            "{} frames",
            frames.len()
        );
        for sub in 0..=MAX_MERGED as u64 {
            up.merge(sub, 1, barrier(&format!("b{sub}")));
        }
        // The ninth distinct call sealed the first eight.
        assert_eq!(up.merged.len(), 1);
        assert!(!up.buf.is_empty());
    }
}
