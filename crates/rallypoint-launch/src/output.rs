//! Worker output: each line prefixed with its rank and written whole (never
//! interleaved mid-line with another rank's), optionally to per-rank log files,
//! with the last lines of stderr kept for the failure summary.

use std::collections::VecDeque;
use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};

/// Lines of stderr kept per rank for the summary.
pub const TAIL_LINES: usize = 20;
/// Longest line passed on in one piece; longer ones are split, so one runaway line
/// cannot take unbounded memory.
const MAX_LINE: u64 = 64 * 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

impl Stream {
    fn name(self) -> &'static str {
        match self {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
        }
    }
}

/// The last lines a worker wrote to stderr, shared with whoever writes the summary.
pub type Tail = Arc<Mutex<VecDeque<String>>>;

pub fn tail_lines(tail: &Tail) -> Vec<String> {
    tail.lock().map(|t| t.iter().cloned().collect()).unwrap_or_default()
}

/// Copies one stream of one worker until it closes.
pub async fn pump(
    source: impl AsyncRead + Unpin,
    rank: u32,
    stream: Stream,
    console: bool,
    log_dir: Option<&Path>,
    tail: Option<Tail>,
) {
    let mut file = match log_dir {
        Some(dir) => match tokio::fs::File::create(dir.join(format!("rank{rank}.{}", stream.name()))).await {
            Ok(f) => Some(f),
            Err(e) => {
                tracing::warn!("cannot write the {} log of rank {rank} in {}: {e}", stream.name(), dir.display());
                None
            }
        },
        None => None,
    };
    let prefix = format!("[rank{rank}]: ");
    let mut reader = BufReader::new(source);
    let mut line = Vec::with_capacity(256);
    loop {
        line.clear();
        match (&mut reader).take(MAX_LINE).read_until(b'\n', &mut line).await {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) => {
                tracing::debug!("reading {} of rank {rank}: {e}", stream.name());
                break;
            }
        }
        if line.last() != Some(&b'\n') {
            line.push(b'\n');
        }
        if console {
            write_line(stream, prefix.as_bytes(), &line);
        }
        if let Some(f) = file.as_mut() {
            if let Err(e) = f.write_all(&line).await {
                tracing::warn!("writing the {} log of rank {rank}: {e}", stream.name());
                file = None;
            }
        }
        if let Some(tail) = &tail {
            if let Ok(mut t) = tail.lock() {
                if t.len() == TAIL_LINES {
                    t.pop_front();
                }
                t.push_back(String::from_utf8_lossy(&line[..line.len() - 1]).into_owned());
            }
        }
    }
    if let Some(mut f) = file {
        let _ = f.flush().await;
    }
}

/// One write under the stream's lock: the whole line, prefix included, or nothing.
fn write_line(stream: Stream, prefix: &[u8], line: &[u8]) {
    let mut buf = Vec::with_capacity(prefix.len() + line.len());
    buf.extend_from_slice(prefix);
    buf.extend_from_slice(line);
    let result = match stream {
        Stream::Stdout => std::io::stdout().lock().write_all(&buf),
        Stream::Stderr => std::io::stderr().lock().write_all(&buf),
    };
    // A closed console (launcher piped into `head`) must not stop the job.
    let _ = result;
}
