//! How the launchers of a job's nodes agree, through the coordinator, using
//! rallypoint's own primitives in a job of their own (`JOB/launch`, whose ranks are
//! the launchers, one per node):
//! - rendezvous: an all-gather of every node's worker count gives each node its
//!   rank range and the world size;
//! - each node `j > 0` reports its attempt's outcome (its first failure, or success)
//!   with a broadcast rooted at `j` that node 0 waits on; node 0 decides and
//!   broadcasts the verdict to all. A node whose launcher dies fails those
//!   broadcasts at once, by name, so every node learns of it immediately.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use rallypoint_client::{Client, ConnectOptions, Error, Identity, Members, OpError, RankState};

use crate::outcome::{Failure, FailureKind};

/// Waits that last as long as an attempt runs.
const FOREVER: Duration = Duration::from_secs(30 * 24 * 3600);

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Report {
    Succeeded,
    Failed(Failure),
}

/// What the supervisor of an attempt hears from the other nodes.
#[derive(Debug)]
pub enum Remote {
    /// Node 0 only: node `j` finished its workers successfully.
    NodeSucceeded(u32),
    /// A failure elsewhere (or of another node itself): take this node's workers down.
    Failed(Failure),
    /// Not node 0: every node succeeded.
    VerdictSucceeded,
}

/// Where the ranks of an attempt are.
pub struct Layout {
    /// This node's first rank.
    pub base_rank: u32,
    pub world_size: u32,
    /// Workers per node, by node.
    pub counts: Vec<u32>,
}

/// This node's launcher as a member of the launchers' job.
#[derive(Clone)]
pub struct Launchers {
    client: Client,
    pub node: u32,
    pub nnodes: u32,
}

impl Launchers {
    pub async fn join(
        addr: &str,
        run_id: &str,
        node: u32,
        nnodes: u32,
        host: &str,
        timeout: Duration,
        token: Option<std::sync::Arc<rallypoint_server::Token>>,
    ) -> Result<Self, Error> {
        let identity = Identity {
            host: host.to_owned(),
            pid: std::process::id(),
            role: Some("launcher".into()),
            ..Identity::ranked(format!("{run_id}/launch"), node, nnodes)
        };
        let options = ConnectOptions::new(addr, identity).with_timeout(timeout).with_token(token);
        let client = Client::connect_with(options).await?;
        Ok(Launchers { client, node, nnodes })
    }

    /// Waits for every node of attempt `attempt`; returns where the ranks are.
    pub async fn rendezvous(&self, attempt: u32, nproc: u32, timeout: Duration) -> Result<Layout, Error> {
        let counts = self
            .client
            .all_gather(&format!("attempt{attempt}/nproc"), Members::World, nproc.to_string(), Some(timeout))
            .await?;
        let mut layout = Layout { base_rank: 0, world_size: 0, counts: Vec::with_capacity(counts.len()) };
        for (node, count) in counts.iter().enumerate() {
            let n: u32 = std::str::from_utf8(count)
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| Error::Protocol(format!("node {node} announced a bad worker count {count:?}")))?;
            if (node as u32) < self.node {
                layout.base_rank += n;
            }
            layout.world_size = layout
                .world_size
                .checked_add(n)
                .ok_or_else(|| Error::Config("the world size exceeds 2^32 ranks".into()))?;
            layout.counts.push(n);
        }
        Ok(layout)
    }

    /// Starts listening to the other nodes for this attempt.
    pub fn watch(&self, attempt: u32, events: mpsc::UnboundedSender<Remote>) {
        if self.node == 0 {
            for j in 1..self.nnodes {
                let client = self.client.clone();
                let events = events.clone();
                tokio::spawn(async move {
                    let name = report_name(attempt, j);
                    let got = client.broadcast(&name, Members::Ranks(vec![0, j]), j, None, Some(FOREVER)).await;
                    let _ = events.send(match decode(got, j) {
                        Ok(Report::Succeeded) => Remote::NodeSucceeded(j),
                        Ok(Report::Failed(f)) | Err(f) => Remote::Failed(f),
                    });
                });
            }
        } else {
            let client = self.client.clone();
            tokio::spawn(async move {
                let got = client.broadcast(&verdict_name(attempt), Members::World, 0, None, Some(FOREVER)).await;
                let _ = events.send(match decode(got, 0) {
                    Ok(Report::Succeeded) => Remote::VerdictSucceeded,
                    Ok(Report::Failed(f)) | Err(f) => Remote::Failed(f),
                });
            });
        }
    }

    /// Node `j > 0`: tells node 0 how this node's attempt went. Node 0: tells every node the verdict.
    pub fn publish(&self, attempt: u32, report: &Report) {
        let Ok(value) = serde_json::to_vec(report) else { return };
        let client = self.client.clone();
        let node = self.node;
        tokio::spawn(async move {
            let result = if node == 0 {
                client.broadcast(&verdict_name(attempt), Members::World, 0, Some(&value), Some(FOREVER)).await
            } else {
                client
                    .broadcast(
                        &report_name(attempt, node),
                        Members::Ranks(vec![0, node]),
                        node,
                        Some(&value),
                        Some(FOREVER),
                    )
                    .await
            };
            if let Err(e) = result {
                tracing::debug!("publishing the outcome of attempt {attempt}: {e}");
            }
        });
    }

    /// Lets every node finish reading the verdict before node 0 stops the coordinator.
    pub async fn farewell(&self, attempt: u32) {
        let _ =
            self.client.barrier(&format!("attempt{attempt}/bye"), Members::World, Some(Duration::from_secs(10))).await;
    }

    pub async fn close(self) {
        let _ = self.client.close().await;
    }
}

fn report_name(attempt: u32, node: u32) -> String {
    format!("attempt{attempt}/report/{node}")
}

fn verdict_name(attempt: u32) -> String {
    format!("attempt{attempt}/verdict")
}

/// A report, or the failure of not getting one: the sending node is gone.
fn decode(got: Result<bytes::Bytes, Error>, from: u32) -> Result<Report, Failure> {
    match got {
        Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| {
            Failure::now(FailureKind::NodeLost { detail: format!("it sent an unreadable report: {e}") }, from, "?")
        }),
        Err(Error::Op(OpError::PeerLost { peer, .. })) => {
            // The peer is a launcher, whose "rank" is its node index: say it in those terms.
            let how = match peer.state {
                RankState::Lost(reason) => reason.to_string(),
                _ => "was lost".to_owned(),
            };
            let pid = peer.pid.map_or(String::new(), |pid| format!(" (pid {pid})"));
            Err(Failure::now(
                FailureKind::NodeLost { detail: format!("its launcher{pid}: {how}") },
                from,
                peer.host.as_deref().unwrap_or("?"),
            ))
        }
        Err(e) => {
            Err(Failure::now(FailureKind::NodeLost { detail: format!("no word from its launcher: {e}") }, from, "?"))
        }
    }
}
