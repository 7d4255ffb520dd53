//! The launcher's console: whatever it shows on its stdout and stderr (the workers'
//! output, prefixed with their rank, and its own messages) goes through a bounded
//! queue to a writer thread per output file, so that no task of the launcher ever
//! waits in `write()`. The coordinator the launcher hosts, fail-fast and signal
//! handling share a runtime with the output pumps: a console that stops reading (a
//! pipe nobody drains, a paused terminal) must cost lines, never the job.
//!
//! A pump that finds the queue full waits for the writer to make progress, so a slow
//! console slows a chatty worker down as a terminal would. Once the writer has made
//! none for [`STALL`], the console counts as not reading: pieces that do not fit are
//! dropped and counted per rank, and when the console reads again a notice stands
//! where they were ("N lines of rank R dropped: console not reading"); whatever was
//! never noticed is reported on stderr when the launcher ends. Log files are written
//! by the pumps themselves, before and regardless of the console.
//!
//! Lines of different ranks never mix. Each piece carries its rank, and the writer
//! knows whose line is open on the screen: another rank's piece first ends that line.
//! A piece ending in `\r` (a progress bar redrawing itself) leaves the line open with
//! the cursor at its start, so the rank's next piece is drawn over it, prefix
//! included, and another rank's output leaves the progress as it last stood.

use std::collections::{BTreeMap, VecDeque};
use std::io;
use std::os::fd::RawFd;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::output::Stream;

/// Bytes a sink may hold queued or being written.
const BUDGET: usize = 1 << 20;
/// A writer that has written nothing for this long while pieces wait: the console
/// is not reading, and pieces that do not fit are dropped rather than waited for.
pub const STALL: Duration = Duration::from_secs(1);
/// What a queued piece costs beyond its bytes (prefix, bookkeeping).
const OVERHEAD: usize = 32;

/// Whose output a piece is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Key {
    pub rank: u32,
    pub stream: Stream,
}

/// How a piece of a worker's output ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// `\n` (or `\r\n`): the line is complete.
    Newline,
    /// `\r`: the worker will draw over this line.
    Return,
    /// Not yet: the worker paused mid-line, or the line is very long.
    Open,
    /// The stream closed (the line, if any, lacked its newline).
    Eof,
}

/// A piece of one line of a worker's output, without its terminator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    pub body: Vec<u8>,
    /// Continues a line whose earlier part was an `Open` piece.
    pub continues: bool,
    pub end: End,
}

enum Item {
    /// A piece of a rank's line, and the prefix its lines get when not the default.
    Piece(Key, Piece, Option<Arc<str>>),
    /// One of the launcher's own messages (one or more lines).
    Line(String),
    Dropped {
        key: Key,
        lines: u64,
    },
}

impl Item {
    fn cost(&self) -> usize {
        OVERHEAD
            + match self {
                Item::Piece(_, piece, _) => piece.body.len(),
                Item::Line(text) => text.len(),
                Item::Dropped { .. } => 0,
            }
    }
}

/// Lines dropped and lines reported as dropped, per rank and stream.
type Drops = Mutex<BTreeMap<Key, (u64, u64)>>;

/// The launcher's stdout and stderr (one sink when both are the same file, so that
/// their lines keep their order).
pub struct Console {
    stdout: Arc<Sink>,
    stderr: Arc<Sink>,
    drops: Arc<Drops>,
}

impl Console {
    /// Starts the writer threads.
    pub fn start() -> Arc<Console> {
        let drops = Arc::new(Drops::default());
        let stdout = Sink::start(libc::STDOUT_FILENO, "stdout", Arc::clone(&drops));
        let stderr = if same_file(libc::STDOUT_FILENO, libc::STDERR_FILENO) {
            Arc::clone(&stdout)
        } else {
            Sink::start(libc::STDERR_FILENO, "stderr", Arc::clone(&drops))
        };
        Arc::new(Console { stdout, stderr, drops })
    }

    fn sink(&self, stream: Stream) -> &Arc<Sink> {
        match stream {
            Stream::Stdout => &self.stdout,
            Stream::Stderr => &self.stderr,
        }
    }

    /// Shows one of the launcher's own messages on stderr. Never waits and never
    /// drops: these are few and short, and the summary is what a user looks for.
    pub fn message(&self, text: impl Into<String>) {
        self.stderr.force(Item::Line(text.into()));
    }

    /// Where one stream of one rank is shown; its lines start with `prefix`, or
    /// `[rankN]: ` when `None`.
    pub fn for_rank(self: &Arc<Self>, rank: u32, stream: Stream, prefix: Option<String>) -> RankConsole {
        RankConsole {
            prefix: prefix.map(Arc::from),
            sink: Arc::clone(self.sink(stream)),
            drops: Arc::clone(&self.drops),
            key: Key { rank, stream },
            dropping: false,
            unnoticed: 0,
        }
    }

    /// Lets the writers finish what is queued, for at most `wait`; then reports on
    /// stderr the lines that were dropped and never noticed (the console may never
    /// have read again), and stops the writers. A writer blocked in `write()` is
    /// left behind: the launcher exits without it.
    pub fn close(&self, wait: Duration) {
        let deadline = Instant::now() + wait;
        self.stdout.wait_drained(deadline);
        self.stderr.wait_drained(deadline);
        let unnoticed: Vec<(Key, u64)> = lock(&self.drops)
            .iter()
            .filter(|(_, (dropped, noticed))| dropped > noticed)
            .map(|(key, (dropped, noticed))| (*key, dropped - noticed))
            .collect();
        if !unnoticed.is_empty() {
            for (key, lines) in unnoticed {
                let text = format!("{} ({})", dropped_notice(key.rank, lines), key.stream.name());
                self.stderr.force(Item::Line(text));
            }
            // Stdout may be the blocked one; stderr gets a moment of its own.
            self.stderr.wait_drained(Instant::now().max(deadline) + Duration::from_millis(500));
        }
        self.stdout.stop();
        self.stderr.stop();
    }
}

fn dropped_notice(rank: u32, lines: u64) -> String {
    let unit = if lines == 1 { "line" } else { "lines" };
    format!("rallypoint: {lines} {unit} of rank {rank} dropped: console not reading")
}

/// One rank's stream on the console, owned by the pump reading it.
pub struct RankConsole {
    prefix: Option<Arc<str>>,
    sink: Arc<Sink>,
    drops: Arc<Drops>,
    key: Key,
    /// Part of the current line was dropped: the rest of it goes too (half a line
    /// would read as a whole one).
    dropping: bool,
    /// Lines dropped since the last notice.
    unnoticed: u64,
}

impl RankConsole {
    /// Queues a piece, waiting while the console reads but slower than the worker
    /// writes; drops it (counted) once the console has stopped reading.
    pub async fn show(&mut self, piece: Piece) {
        if self.dropping && piece.continues {
            return;
        }
        let mut items = Vec::with_capacity(2);
        if self.unnoticed > 0 {
            items.push(Item::Dropped { key: self.key, lines: self.unnoticed });
        }
        let is_eof = piece.end == End::Eof;
        items.push(Item::Piece(self.key, piece, self.prefix.clone()));
        match self.sink.admit(items).await {
            Admit::Queued => {
                self.dropping = false;
                self.unnoticed = 0;
            }
            Admit::Full => {
                // An end of stream carries nothing of its own to lose.
                if !is_eof {
                    self.dropping = true;
                    self.unnoticed += 1;
                    lock(&self.drops).entry(self.key).or_default().0 += 1;
                }
            }
            Admit::Gone => {}
        }
    }

    /// At the end of the stream: the notice of the last lines dropped, if any,
    /// queued whatever the budget (it is short).
    pub fn finish(self) {
        if self.unnoticed > 0 {
            self.sink.force(Item::Dropped { key: self.key, lines: self.unnoticed });
        }
    }
}

enum Admit {
    Queued,
    Full,
    /// The console is closed or failed (EPIPE: nobody will ever read it).
    Gone,
}

struct Sink {
    fd: RawFd,
    state: Mutex<Queue>,
    /// Wakes the writer (items queued, or stop) and whoever waits for it to drain.
    changed: Condvar,
    /// Pumps waiting for room.
    room: Notify,
}

#[derive(Default)]
struct Queue {
    items: VecDeque<Item>,
    /// Cost of what is queued and what the writer is writing.
    bytes: usize,
    /// Completed writes, so a waiting pump can tell a slow console from a stopped one.
    progress: u64,
    /// The writer made no progress for STALL while pieces waited.
    stalled: bool,
    writing: bool,
    /// The writer is gone (stopped, or its file failed).
    gone: bool,
    stop: bool,
}

impl Sink {
    fn start(fd: RawFd, name: &str, drops: Arc<Drops>) -> Arc<Sink> {
        let sink =
            Arc::new(Sink { fd, state: Mutex::new(Queue::default()), changed: Condvar::new(), room: Notify::new() });
        let writer = Arc::clone(&sink);
        let spawned = std::thread::Builder::new().name(format!("console-{name}")).spawn(move || writer.run(&drops));
        if let Err(error) = spawned {
            tracing::warn!(%error, "cannot start the console writer for {name}; its output is discarded");
            lock(&sink.state).gone = true;
        }
        sink
    }

    async fn admit(&self, items: Vec<Item>) -> Admit {
        let cost: usize = items.iter().map(Item::cost).sum();
        let mut items = Some(items);
        loop {
            let room = self.room.notified();
            tokio::pin!(room);
            room.as_mut().enable();
            let seen = {
                let mut q = lock(&self.state);
                if q.gone {
                    return Admit::Gone;
                }
                if q.bytes == 0 || q.bytes + cost <= BUDGET {
                    q.bytes += cost;
                    q.items.extend(items.take().into_iter().flatten());
                    drop(q);
                    self.changed.notify_all();
                    return Admit::Queued;
                }
                if q.stalled {
                    return Admit::Full;
                }
                q.progress
            };
            if tokio::time::timeout(STALL, room).await.is_err() {
                let mut q = lock(&self.state);
                if q.progress == seen {
                    q.stalled = true;
                    return Admit::Full;
                }
            }
        }
    }

    fn force(&self, item: Item) {
        let mut q = lock(&self.state);
        if q.gone {
            return;
        }
        q.bytes += item.cost();
        q.items.push_back(item);
        drop(q);
        self.changed.notify_all();
    }

    fn wait_drained(&self, deadline: Instant) {
        let mut q = lock(&self.state);
        while !q.gone && (q.writing || !q.items.is_empty()) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            q = self.changed.wait_timeout(q, left).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    fn stop(&self) {
        lock(&self.state).stop = true;
        self.changed.notify_all();
    }

    fn run(&self, drops: &Drops) {
        let mut screen = Screen::default();
        let mut out = Vec::new();
        let mut failed = false;
        loop {
            let (batch, cost) = {
                let mut q = lock(&self.state);
                while q.items.is_empty() && !q.stop {
                    q = self.changed.wait(q).unwrap_or_else(|e| e.into_inner());
                }
                if q.items.is_empty() {
                    q.gone = true;
                    drop(q);
                    self.changed.notify_all();
                    self.room.notify_waiters();
                    return;
                }
                q.writing = true;
                let batch: Vec<Item> = q.items.drain(..).collect();
                let cost = batch.iter().map(Item::cost).sum::<usize>();
                (batch, cost)
            };
            out.clear();
            for item in &batch {
                screen.render(item, &mut out);
                if let Item::Dropped { key, lines } = item {
                    lock(drops).entry(*key).or_default().1 += lines;
                }
            }
            if !failed {
                if let Err(error) = write_all(self.fd, &out) {
                    // EPIPE (the reader is gone, e.g. `| head`) or a closed descriptor:
                    // nothing will be shown again; the job goes on.
                    tracing::debug!(%error, fd = self.fd, "the console stopped taking output");
                    failed = true;
                }
            }
            {
                let mut q = lock(&self.state);
                q.bytes = q.bytes.saturating_sub(cost);
                q.progress += 1;
                q.stalled = false;
                q.writing = false;
                q.gone |= failed;
            }
            self.changed.notify_all();
            self.room.notify_waiters();
        }
    }
}

/// What the screen shows of the line being written: whose it is, and whether the
/// cursor went back to its start (`\r`).
#[derive(Default)]
struct Screen {
    open: Option<(Key, bool)>,
}

impl Screen {
    fn render(&mut self, item: &Item, out: &mut Vec<u8>) {
        match item {
            Item::Piece(key, piece, prefix) => self.piece(*key, piece, prefix.as_deref(), out),
            Item::Line(text) => self.line(text, out),
            Item::Dropped { key, lines } => self.line(&dropped_notice(key.rank, *lines), out),
        }
    }

    fn line(&mut self, text: &str, out: &mut Vec<u8>) {
        if self.open.take().is_some() {
            out.push(b'\n');
        }
        out.extend_from_slice(text.as_bytes());
        if !text.ends_with('\n') {
            out.push(b'\n');
        }
    }

    fn piece(&mut self, key: Key, piece: &Piece, custom: Option<&str>, out: &mut Vec<u8>) {
        let (ours, returned) = match self.open {
            Some((open, returned)) if open == key => (true, returned),
            Some(_) => {
                // Another rank's line ends here, as it stood.
                out.push(b'\n');
                self.open = None;
                (false, false)
            }
            None => (false, false),
        };
        if piece.body.is_empty() && !ours && (piece.continues || piece.end != End::Newline) {
            // Nothing of this line on screen and nothing to add: a bare `\r`, an end
            // of stream, or the end of a line another rank's output cut.
            return;
        }
        let appends = ours && !returned && piece.continues;
        if ours && !returned && !piece.continues {
            // Our line dangles but this piece starts a new one (its end was dropped).
            out.push(b'\n');
        }
        if !(appends || returned && piece.body.is_empty()) {
            if let Some(custom) = custom {
                out.extend_from_slice(custom.as_bytes());
            } else {
                let prefix = format!("[rank{}]:", key.rank);
                // Once a process group exists, torch prefixes the lines it writes itself
                // (tracebacks, C++ warnings) with this same `[rankN]:`: not twice.
                if !piece.body.starts_with(prefix.as_bytes()) {
                    out.extend_from_slice(prefix.as_bytes());
                    out.push(b' ');
                }
            }
        }
        out.extend_from_slice(&piece.body);
        self.open = match piece.end {
            End::Newline | End::Eof => {
                out.push(b'\n');
                None
            }
            End::Return => {
                out.push(b'\r');
                Some((key, true))
            }
            End::Open => Some((key, false)),
        };
    }
}

fn write_all(fd: RawFd, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        // SAFETY: writes from a live buffer of the given length to a descriptor we do
        // not own and do not close.
        let n = unsafe { libc::write(fd, buf.as_ptr().cast(), buf.len()) };
        if let Ok(n) = usize::try_from(n) {
            buf = &buf[n..];
            continue;
        }
        let error = io::Error::last_os_error();
        match error.kind() {
            io::ErrorKind::Interrupted => {}
            io::ErrorKind::WouldBlock => {
                // Someone made the shared file description non-blocking: wait for room.
                let mut pollfd = libc::pollfd { fd, events: libc::POLLOUT, revents: 0 };
                // SAFETY: one valid pollfd.
                unsafe { libc::poll(&mut pollfd, 1, -1) };
            }
            _ => return Err(error),
        }
    }
    Ok(())
}

/// Whether two descriptors are the same file (a terminal, usually).
fn same_file(a: RawFd, b: RawFd) -> bool {
    let stat = |fd| {
        let mut st = std::mem::MaybeUninit::<libc::stat>::zeroed();
        // SAFETY: fstat fills the buffer on success; it is read only then.
        (unsafe { libc::fstat(fd, st.as_mut_ptr()) } == 0).then(|| {
            // SAFETY: initialised by the successful fstat.
            let st = unsafe { st.assume_init() };
            (st.st_dev, st.st_ino)
        })
    };
    matches!((stat(a), stat(b)), (Some(x), Some(y)) if x == y)
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(rank: u32) -> Key {
        Key { rank, stream: Stream::Stdout }
    }

    fn piece(body: &str, continues: bool, end: End) -> Item {
        Item::Piece(key(0), Piece { body: body.as_bytes().to_vec(), continues, end }, None)
    }

    fn render(items: &[(u32, Item)]) -> String {
        let mut screen = Screen::default();
        let mut out = Vec::new();
        for (rank, item) in items {
            let item = match item {
                Item::Piece(_, p, prefix) => Item::Piece(key(*rank), p.clone(), prefix.clone()),
                Item::Line(text) => Item::Line(text.clone()),
                Item::Dropped { lines, .. } => Item::Dropped { key: key(*rank), lines: *lines },
            };
            screen.render(&item, &mut out);
        }
        String::from_utf8(out).expect("utf-8")
    }

    #[test]
    fn whole_lines_get_their_prefix_and_continuations_do_not() {
        let text = render(&[
            (0, piece("loss 0.5", false, End::Newline)),
            (1, piece("epoch ", false, End::Open)),
            (1, piece("3", true, End::Open)),
            (1, piece("", true, End::Newline)),
            (0, piece("", false, End::Newline)),
        ]);
        assert_eq!(text, "[rank0]: loss 0.5\n[rank1]: epoch 3\n[rank0]: \n");
    }

    #[test]
    fn another_rank_ends_an_open_line_and_its_rest_gets_a_prefix_again() {
        let text = render(&[
            (0, piece("epoch ", false, End::Open)),
            (1, piece("hello", false, End::Newline)),
            (0, piece("3", true, End::Newline)),
            (1, piece("cut", false, End::Open)),
            (0, piece("", false, End::Eof)),
            (1, piece("", true, End::Newline)),
        ]);
        assert_eq!(text, "[rank0]: epoch \n[rank1]: hello\n[rank0]: 3\n[rank1]: cut\n");
    }

    #[test]
    fn progress_lines_are_drawn_over_and_left_as_they_stood_when_cut() {
        let text = render(&[
            (0, piece("", false, End::Return)),
            (0, piece(" 10%", false, End::Open)),
            (0, piece("", true, End::Return)),
            (0, piece(" 20%", false, End::Return)),
            (1, piece("a line", false, End::Newline)),
            (0, piece(" 30%", false, End::Open)),
            (0, piece("", true, End::Eof)),
        ]);
        assert_eq!(text, "[rank0]:  10%\r[rank0]:  20%\r\n[rank1]: a line\n[rank0]:  30%\n");
        // A progress line finished by a newline keeps its last state.
        let text = render(&[(0, piece("99%", false, End::Return)), (0, piece("", false, End::Newline))]);
        assert_eq!(text, "[rank0]: 99%\r\n");
    }

    #[test]
    fn torch_own_rank_prefix_is_not_doubled() {
        let text = render(&[
            (1, piece("[rank1]: Traceback (most recent call last):", false, End::Newline)),
            (1, piece("[rank1]:[W1123 19:48:13 ProcessGroupGloo.cpp:1] warning", false, End::Newline)),
            // Another rank's prefix, or one inside a line, is the worker's text.
            (2, piece("[rank1]: relayed", false, End::Newline)),
            (2, piece("x [rank2]: y", false, End::Newline)),
        ]);
        assert_eq!(
            text,
            "[rank1]: Traceback (most recent call last):\n\
             [rank1]:[W1123 19:48:13 ProcessGroupGloo.cpp:1] warning\n\
             [rank2]: [rank1]: relayed\n\
             [rank2]: x [rank2]: y\n"
        );
    }

    #[test]
    fn a_custom_prefix_replaces_the_default_one() {
        let custom = |body: &str| {
            Item::Piece(
                key(0),
                Piece { body: body.as_bytes().to_vec(), continues: false, end: End::Newline },
                Some("gpu7:3: ".into()),
            )
        };
        let text = render(&[(3, custom("hello")), (3, custom("[rank3]: Traceback"))]);
        assert_eq!(text, "gpu7:3: hello\ngpu7:3: [rank3]: Traceback\n");
    }

    #[test]
    fn notices_and_messages_start_on_a_line_of_their_own() {
        let text = render(&[
            (2, piece("half", false, End::Open)),
            (2, Item::Dropped { key: key(2), lines: 7 }),
            (0, Item::Line("rallypoint: job 'x' FAILED".into())),
        ]);
        assert_eq!(
            text,
            "[rank2]: half\nrallypoint: 7 lines of rank 2 dropped: console not reading\nrallypoint: job 'x' FAILED\n"
        );
    }
}
