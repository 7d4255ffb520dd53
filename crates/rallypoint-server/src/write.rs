//! How replies are written: a batch of encoded replies and a large tail shared with
//! other replies in one vectored write, and a long write counted as a sign of life
//! of the ranks it goes to.

use std::io::{self, IoSlice};
use std::time::{Duration, Instant};

use rallypoint_core::SessionId;
use tokio::io::{AsyncWrite, AsyncWriteExt};

use crate::shared::Shared;

/// Writes `head`, then `tail`, as one stream of bytes: a batch of encoded replies
/// ending with the start of a frame whose last bytes are `tail`, bytes shared with
/// other replies (an all-gather's values, encoded once for every member). Writing
/// them together (`writev`) sends them without copying `tail` into the batch (over
/// TLS, rustls takes both slices in one call too). Flushed at the end: TLS holds
/// the last record it encrypted until then (a no-op for TCP).
pub(crate) async fn write_with_tail<S: AsyncWrite + Unpin>(
    stream: &mut S,
    mut head: &[u8],
    mut tail: &[u8],
    progress: &mut WriteProgress<'_>,
) -> io::Result<()> {
    while !head.is_empty() || !tail.is_empty() {
        let written = if head.is_empty() {
            stream.write(tail).await?
        } else {
            stream.write_vectored(&[IoSlice::new(head), IoSlice::new(tail)]).await?
        };
        if written == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        if written < head.len() {
            head = &head[written..];
        } else {
            tail = &tail[written - head.len()..];
            head = &[];
        }
        progress.made();
    }
    stream.flush().await
}

/// Tells the engine, at most once per [`ALIVE_EVERY`], that the peers of a connection
/// take in a long write: a connection does not read (so sees no heartbeat) while it
/// writes, and a rank receiving many MiB must not lose its lease meanwhile.
pub(crate) struct WriteProgress<'a> {
    shared: &'a Shared,
    sessions: &'a (dyn Fn() -> Vec<SessionId> + Sync),
    since: Instant,
}

/// How often a long write counts as a sign of life (well inside any sensible lease).
pub(crate) const ALIVE_EVERY: Duration = Duration::from_secs(1);

impl<'a> WriteProgress<'a> {
    pub(crate) fn new(shared: &'a Shared, sessions: &'a (dyn Fn() -> Vec<SessionId> + Sync)) -> Self {
        WriteProgress { shared, sessions, since: Instant::now() }
    }

    fn made(&mut self) {
        if self.since.elapsed() >= ALIVE_EVERY {
            self.shared.alive((self.sessions)().into_iter());
            self.since = Instant::now();
        }
    }
}
