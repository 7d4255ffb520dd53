//! Worker output: each stream of each worker is read by a pump that copies it,
//! byte for byte, to its log file, cuts it into pieces for the console (see
//! [`super::console`]), and keeps the last lines of stderr for the failure summary.
//!
//! Only the console view is cut: at `\n` and `\r`, and a line still without its end
//! when the worker pauses (so a prompt or a progress bar shows as it is written) or
//! when it grows very long (so one runaway line cannot take unbounded memory).

use std::collections::VecDeque;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};

use crate::console::{End, Piece, RankConsole};

/// Lines of stderr kept per rank for the summary.
pub const TAIL_LINES: usize = 20;
/// Longest piece of a line passed to the console at once.
const MAX_PIECE: usize = 64 * 1024;
/// Longest line kept for the summary (longer ones are cut, with a mark).
const MAX_TAIL_LINE: usize = 4096;
/// How long the start of a line waits for the rest before it is shown as it is: long
/// enough that a `print` written as text then newline arrives whole, short enough
/// to look live.
const PARTIAL_AFTER: Duration = Duration::from_millis(100);
const READ_CHUNK: usize = 64 * 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Stream {
    Stdout,
    Stderr,
}

impl Stream {
    pub fn name(self) -> &'static str {
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

/// What the pumps of one worker say of their progress.
#[derive(Clone, Default)]
pub struct Progress {
    /// What the pumps did (bytes read, pieces shown), so that whoever waits for them
    /// can tell a pump at work from one whose pipe a stray process holds open.
    pub activity: Arc<AtomicU64>,
    /// When the worker last wrote ([`crate::stacks::mono_ms`]; 0: never), for
    /// telling a hung job.
    pub heard: Arc<AtomicU64>,
}

/// Copies one stream of one worker until it closes, telling `progress`.
pub async fn pump(
    mut source: impl AsyncRead + Unpin,
    rank: u32,
    stream: Stream,
    mut console: Option<RankConsole>,
    log_dir: Option<&Path>,
    tail: Option<Tail>,
    progress: Progress,
) {
    let Progress { activity, heard } = progress;
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
    let cut = console.is_some() || tail.is_some();
    let mut splitter = Splitter::default();
    let mut tail_line = TailLine::default();
    let mut pieces = Vec::new();
    let mut buf = vec![0u8; READ_CHUNK];
    loop {
        let read = if console.is_some() && splitter.has_partial() {
            match tokio::time::timeout(PARTIAL_AFTER, source.read(&mut buf)).await {
                Ok(read) => read,
                Err(_) => {
                    // The worker paused mid-line: show what there is.
                    splitter.flush(&mut pieces);
                    deliver(&mut pieces, console.as_mut(), tail.as_ref(), &mut tail_line, &activity).await;
                    continue;
                }
            }
        } else {
            source.read(&mut buf).await
        };
        let n = match read {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) => {
                tracing::debug!("reading {} of rank {rank}: {e}", stream.name());
                break;
            }
        };
        activity.fetch_add(1, Ordering::Relaxed);
        heard.store(crate::stacks::mono_ms(), Ordering::Relaxed);
        if let Some(f) = file.as_mut() {
            if let Err(e) = f.write_all(&buf[..n]).await {
                tracing::warn!("writing the {} log of rank {rank}: {e}", stream.name());
                file = None;
            }
        }
        if cut {
            splitter.feed(&buf[..n], &mut pieces);
            deliver(&mut pieces, console.as_mut(), tail.as_ref(), &mut tail_line, &activity).await;
        }
    }
    if let Some(mut f) = file {
        if let Err(e) = f.flush().await {
            tracing::warn!("writing the {} log of rank {rank}: {e}", stream.name());
        }
    }
    if cut {
        splitter.finish(&mut pieces);
        deliver(&mut pieces, console.as_mut(), tail.as_ref(), &mut tail_line, &activity).await;
    }
    if let Some(console) = console {
        console.finish();
    }
}

/// Notes each piece in the tail, then shows it: the tail never waits for the console.
async fn deliver(
    pieces: &mut Vec<Piece>,
    mut console: Option<&mut RankConsole>,
    tail: Option<&Tail>,
    tail_line: &mut TailLine,
    activity: &AtomicU64,
) {
    if let Some(tail) = tail {
        for piece in pieces.iter() {
            tail_line.note(piece, tail);
        }
    }
    for piece in pieces.drain(..) {
        if let Some(console) = console.as_deref_mut() {
            console.show(piece).await;
            activity.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Cuts a byte stream into console pieces (sans I/O: fed what was read, it returns
/// what to show).
#[derive(Default)]
struct Splitter {
    /// The line so far, not yet shown.
    pending: Vec<u8>,
    /// Part of the current line was shown already: the next piece continues it.
    shown: bool,
    /// The last chunk ended with `\r`: the next byte tells `\r\n` from a redraw.
    cr: bool,
}

impl Splitter {
    fn has_partial(&self) -> bool {
        self.cr || !self.pending.is_empty()
    }

    fn feed(&mut self, mut data: &[u8], out: &mut Vec<Piece>) {
        if self.cr && !data.is_empty() {
            self.cr = false;
            if data[0] == b'\n' {
                self.emit(End::Newline, out);
                data = &data[1..];
            } else {
                self.emit(End::Return, out);
            }
        }
        while let Some(i) = data.iter().position(|&b| b == b'\n' || b == b'\r') {
            self.extend(&data[..i], out);
            if data[i] == b'\n' {
                self.emit(End::Newline, out);
                data = &data[i + 1..];
            } else if i + 1 == data.len() {
                self.cr = true;
                data = &[];
            } else if data[i + 1] == b'\n' {
                self.emit(End::Newline, out);
                data = &data[i + 2..];
            } else {
                self.emit(End::Return, out);
                data = &data[i + 1..];
            }
        }
        self.extend(data, out);
    }

    /// The worker paused: show the line so far.
    fn flush(&mut self, out: &mut Vec<Piece>) {
        if std::mem::take(&mut self.cr) {
            self.emit(End::Return, out);
        } else if !self.pending.is_empty() {
            self.emit(End::Open, out);
        }
    }

    /// The stream closed.
    fn finish(&mut self, out: &mut Vec<Piece>) {
        if std::mem::take(&mut self.cr) {
            self.emit(End::Return, out);
        }
        self.emit(End::Eof, out);
    }

    fn extend(&mut self, mut bytes: &[u8], out: &mut Vec<Piece>) {
        while self.pending.len() + bytes.len() >= MAX_PIECE {
            let take = MAX_PIECE - self.pending.len();
            self.pending.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            self.emit(End::Open, out);
        }
        self.pending.extend_from_slice(bytes);
    }

    fn emit(&mut self, end: End, out: &mut Vec<Piece>) {
        out.push(Piece { body: std::mem::take(&mut self.pending), continues: self.shown, end });
        self.shown = end == End::Open;
    }
}

/// The line of stderr being written, as a terminal would show it at its end (a
/// progress bar's last state, not every redraw).
#[derive(Default)]
struct TailLine {
    text: Vec<u8>,
    cut: bool,
    /// A `\r` came: the next text draws over the line.
    redraw: bool,
}

impl TailLine {
    fn note(&mut self, piece: &Piece, tail: &Tail) {
        if !piece.body.is_empty() {
            if std::mem::take(&mut self.redraw) {
                self.text.clear();
                self.cut = false;
            }
            let room = MAX_TAIL_LINE.saturating_sub(self.text.len());
            self.text.extend_from_slice(&piece.body[..piece.body.len().min(room)]);
            self.cut |= piece.body.len() > room;
        }
        match piece.end {
            End::Return => self.redraw = true,
            End::Open => {}
            End::Newline | End::Eof => {
                if piece.end == End::Newline || !self.text.is_empty() {
                    let mut line = String::from_utf8_lossy(&self.text).into_owned();
                    if self.cut {
                        line.push_str(" [...]");
                    }
                    if let Ok(mut t) = tail.lock() {
                        if t.len() == TAIL_LINES {
                            t.pop_front();
                        }
                        t.push_back(line);
                    }
                }
                *self = TailLine::default();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(chunks: &[&[u8]]) -> Vec<(String, bool, End)> {
        let mut s = Splitter::default();
        let mut out = Vec::new();
        for chunk in chunks {
            if chunk.is_empty() {
                s.flush(&mut out);
            } else {
                s.feed(chunk, &mut out);
            }
        }
        s.finish(&mut out);
        out.into_iter().map(|p| (String::from_utf8_lossy(&p.body).into_owned(), p.continues, p.end)).collect()
    }

    fn p(body: &str, continues: bool, end: End) -> (String, bool, End) {
        (body.to_owned(), continues, end)
    }

    #[test]
    fn lines_returns_and_crlf_end_pieces_wherever_the_chunks_are_cut() {
        assert_eq!(
            split(&[b"a\nb\r\nc", b"\r", b"\nd\re"]),
            [p("a", false, End::Newline), p("b", false, End::Newline), p("c", false, End::Newline)]
                .into_iter()
                .chain([p("d", false, End::Return), p("e", false, End::Eof)])
                .collect::<Vec<_>>()
        );
        // A `\r` at the end of a chunk waits for the next byte, or for a pause.
        assert_eq!(
            split(&[b"10%\r", b"", b"20%\r"]),
            [p("10%", false, End::Return), p("20%", false, End::Return), p("", false, End::Eof)]
        );
    }

    #[test]
    fn a_pause_shows_the_line_so_far_and_the_rest_continues_it() {
        assert_eq!(
            split(&[b"epoch ", b"", b"3\nnext"]),
            [p("epoch ", false, End::Open), p("3", true, End::Newline), p("next", false, End::Eof)]
        );
    }

    #[test]
    fn a_long_line_goes_in_bounded_pieces() {
        let line = vec![b'x'; MAX_PIECE * 2 + 10];
        let pieces = split(&[&line, b"\n"]);
        let shape: Vec<(usize, bool, End)> = pieces.iter().map(|(b, c, e)| (b.len(), *c, *e)).collect();
        assert_eq!(
            shape,
            [
                (MAX_PIECE, false, End::Open),
                (MAX_PIECE, true, End::Open),
                (10, true, End::Newline),
                (0, false, End::Eof)
            ]
        );
    }

    #[test]
    fn the_tail_keeps_lines_as_a_terminal_shows_them_at_their_end() {
        let tail = Tail::default();
        let mut line = TailLine::default();
        let mut s = Splitter::default();
        let mut out = Vec::new();
        s.feed(b"Traceback\n\r 10%|#\r 100%|##\n\nValueError: bad", &mut out);
        s.finish(&mut out);
        for piece in &out {
            line.note(piece, &tail);
        }
        assert_eq!(tail_lines(&tail), ["Traceback", " 100%|##", "", "ValueError: bad"]);
    }
}
