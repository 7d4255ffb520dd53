//! torch's error files: each worker gets a path in `TORCHELASTIC_ERROR_FILE`, as
//! torchrun gives it, where a script's `@record`-decorated entry point (torch's
//! `torch.distributed.elastic.multiprocessing.errors.record`) writes the exception
//! that ended it. The launcher reads it back into the summary and the job's abort
//! reason: a stderr tail may have lost the exception's line under what the process
//! printed while exiting (torch's own shutdown warnings, for one).
//!
//! The file is the worker's to write, so reading it must not cost the launcher its
//! job: only a regular file is read, opened without blocking (a FIFO would wait for
//! a writer), at most [`MAX_READ`] of it, off the runtime's threads and bounded in
//! time (a stalled network file system).

use std::borrow::Cow;
use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The variable torch's `@record` reads (and torchrun sets per worker).
pub const VAR: &str = "TORCHELASTIC_ERROR_FILE";

/// Read no more: a message is all we keep, and a worker must not make its
/// launcher read gigabytes.
const MAX_READ: u64 = 1 << 20;
/// How long a read may take before the launcher goes on without it.
const READ_BOUND: Duration = Duration::from_secs(2);
/// The message kept: at most this many lines and characters; a headline's line at
/// most [`HEADLINE_CHARS`].
const MAX_LINES: usize = 20;
const MAX_CHARS: usize = 4_000;
const HEADLINE_CHARS: usize = 200;

/// What a worker's error file said.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Raised {
    /// The exception's message, as `@record` wrote it ("ValueError: bad lr"),
    /// bounded, control characters written out.
    Message(String),
    /// There was a file, but not one `@record` writes, or it could not be read: why.
    Unreadable(String),
}

impl Raised {
    /// ": ValueError: bad lr", the first line of the message, for a one-line headline;
    /// nothing for a file that could not be read (the summary says why).
    pub fn headline(raised: Option<&Raised>) -> String {
        match raised {
            Some(Raised::Message(message)) => {
                // "RuntimeError: " then the message on the lines after: its first one.
                let mut lines = message.lines();
                let first = lines.next().unwrap_or("").trim_end();
                let line = match lines.find(|l| !l.trim().is_empty()).filter(|_| first.ends_with(':')) {
                    Some(next) => Cow::Owned(format!("{first} {}", next.trim())),
                    None => Cow::Borrowed(first),
                };
                match line.char_indices().nth(HEADLINE_CHARS) {
                    Some((at, _)) => format!(": {} [...]", &line[..at]),
                    None => format!(": {line}"),
                }
            }
            _ => String::new(),
        }
    }
}

/// Where rank `rank`'s error file goes in an attempt's directory: beside its log
/// files (`rank<N>.stderr`) when there are any.
pub fn path(dir: &Path, rank: u32) -> PathBuf {
    dir.join(format!("rank{rank}.error.json"))
}

/// Removes what an earlier run left at `path` (a log directory used again), so that
/// an old exception is never taken for this worker's.
pub fn clear(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Err(error) if error.kind() != io::ErrorKind::NotFound => Err(error),
        _ => Ok(()),
    }
}

/// What the file at `path` says the worker raised, if it wrote one.
pub async fn read(path: PathBuf) -> Option<Raised> {
    let shown = path.display().to_string();
    match bounded_read(path).await {
        Err(why) => Some(Raised::Unreadable(format!("its error file {shown} {why}"))),
        Ok(None) => None,
        Ok(Some(text)) => Some(match message(&text) {
            Some(message) => Raised::Message(shown_bounded(message.trim_end())),
            None => Raised::Unreadable(format!("its error file {shown} is not the JSON torch's @record writes")),
        }),
    }
}

/// Copies the error file at `ours` to `parent` (the launcher's own
/// `TORCHELASTIC_ERROR_FILE`), as torchrun passes its root cause's on: only a file
/// `@record` wrote, with the worker's exit code as its `errorCode` (a worker ended by
/// a signal could not write it). Nothing (`Ok(false)`) when there is no such file.
pub async fn pass_on(ours: PathBuf, parent: PathBuf, exit_code: i32) -> io::Result<bool> {
    let Some(text) = bounded_read(ours).await.map_err(io::Error::other)? else { return Ok(false) };
    let Some(mut value) = json(&text).filter(|value| message_of(value).is_some()) else { return Ok(false) };
    if let Some(message) = value.get_mut("message").and_then(|m| m.as_object_mut()).filter(|_| exit_code != 0) {
        message.insert("errorCode".to_owned(), exit_code.into());
    }
    let bytes = serde_json::to_vec(&value).map_err(io::Error::other)?;
    tokio::task::spawn_blocking(move || std::fs::write(parent, bytes)).await.map_err(io::Error::other)??;
    Ok(true)
}

/// The file's bytes, `None` if there is none; else why it was not read.
async fn bounded_read(path: PathBuf) -> Result<Option<Vec<u8>>, String> {
    let read = tokio::task::spawn_blocking(move || read_now(&path));
    match tokio::time::timeout(READ_BOUND, read).await {
        Ok(Ok(read)) => read,
        Ok(Err(error)) => Err(format!("could not be read: {error}")),
        Err(_) => Err(format!("could not be read within {} s", READ_BOUND.as_secs())),
    }
}

fn read_now(path: &Path) -> Result<Option<Vec<u8>>, String> {
    let file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path);
    let file = match file {
        Ok(file) => file,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(error) => return Err(format!("could not be read: {error}")),
    };
    let meta = file.metadata().map_err(|error| format!("could not be read: {error}"))?;
    if !meta.is_file() {
        return Err("is not a regular file".to_owned());
    }
    if meta.len() > MAX_READ {
        return Err(format!("is {} bytes, too large to read (at most {MAX_READ})", meta.len()));
    }
    let mut text = Vec::new();
    file.take(MAX_READ).read_to_end(&mut text).map_err(|error| format!("could not be read: {error}"))?;
    Ok(Some(text))
}

/// `{"message": {"message": "...", "extraInfo": {...}}}` as `@record` writes it, or
/// `{"message": "..."}` as torch also reads.
fn message(text: &[u8]) -> Option<String> {
    json(text).as_ref().and_then(message_of).map(str::to_owned)
}

fn message_of(value: &serde_json::Value) -> Option<&str> {
    let message = value.get("message")?;
    message.as_str().or_else(|| message.get("message")?.as_str())
}

/// The file as JSON. Python's `json.dump` writes an exception text's lone surrogates
/// (bytes it could not decode) as `\udcXX` escapes, which Python reads back and strict
/// JSON parsers refuse: each becomes U+FFFD first.
fn json(text: &[u8]) -> Option<serde_json::Value> {
    let text = std::str::from_utf8(text).ok()?;
    serde_json::from_str(&mend_lone_surrogates(text)).ok()
}

fn mend_lone_surrogates(text: &str) -> Cow<'_, str> {
    if !text.contains("\\u") {
        return Cow::Borrowed(text);
    }
    let surrogate = |at: usize| -> Option<u16> {
        let hex = text.get(at + 2..at + 6)?;
        let unit = u16::from_str_radix(hex, 16).ok()?;
        (text.get(at..at + 2) == Some("\\u") && (0xD800..=0xDFFF).contains(&unit)).then_some(unit)
    };
    let mut out = String::with_capacity(text.len());
    let mut rest = 0;
    let mut at = 0;
    let bytes = text.as_bytes();
    while at < bytes.len() {
        if bytes[at] != b'\\' {
            at += 1;
            continue;
        }
        match surrogate(at) {
            // A high surrogate followed by a low one: a pair, kept.
            Some(0xD800..=0xDBFF) if surrogate(at + 6).is_some_and(|low| low >= 0xDC00) => at += 12,
            Some(_) => {
                out.push_str(&text[rest..at]);
                out.push_str("\\ufffd");
                at += 6;
                rest = at;
            }
            // Any other escape: skip its character (an escaped backslash among them).
            None => at += 2,
        }
    }
    if rest == 0 {
        return Cow::Borrowed(text);
    }
    out.push_str(&text[rest..]);
    Cow::Owned(out)
}

/// At most [`MAX_LINES`] lines and [`MAX_CHARS`] characters, control characters but
/// line ends written out (an escape sequence or a `\r` would redraw the terminal).
fn shown_bounded(message: &str) -> String {
    let mut kept = String::new();
    let mut cut = false;
    for (i, line) in message.lines().enumerate() {
        if i == MAX_LINES {
            cut = true;
            break;
        }
        if i > 0 {
            kept.push('\n');
        }
        for c in line.chars() {
            // Bidirectional controls too: they reorder what the terminal shows.
            let bidi = matches!(c, '\u{200E}' | '\u{200F}' | '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}');
            if (c.is_control() && c != '\t') || bidi {
                kept.extend(c.escape_default());
            } else {
                kept.push(c);
            }
        }
    }
    if let Some((at, _)) = kept.char_indices().nth(MAX_CHARS) {
        kept.truncate(at);
        cut = true;
    }
    if cut {
        kept.push_str(" [...]");
    }
    kept
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory of the test's own, removed when dropped.
    struct Dir(PathBuf);

    impl Dir {
        fn new(test: &str) -> Dir {
            let dir = std::env::temp_dir().join(format!("rp-error-file-{}-{test}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("dir");
            Dir(dir)
        }

        fn written(&self, name: &str, contents: &[u8]) -> PathBuf {
            let path = self.0.join(name);
            std::fs::write(&path, contents).expect("write");
            path
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn said(raised: Option<Raised>) -> String {
        match raised {
            Some(Raised::Message(text)) => text,
            other => panic!("no message: {other:?}"),
        }
    }

    fn unreadable(raised: Option<Raised>) -> String {
        match raised {
            Some(Raised::Unreadable(why)) => why,
            other => panic!("not unreadable: {other:?}"),
        }
    }

    #[tokio::test]
    async fn the_message_record_writes_is_read_and_a_missing_file_is_nothing() {
        let dir = Dir::new("read");
        let record = br#"{"message": {"message": "ValueError: bad lr", "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1764570000"}}}"#;
        assert_eq!(said(read(dir.written("record.json", record)).await), "ValueError: bad lr");
        let plain = br#"{"message": "RuntimeError: boom\n", "timestamp": 1}"#;
        assert_eq!(said(read(dir.written("plain.json", plain)).await), "RuntimeError: boom");
        assert_eq!(read(path(&dir.0, 0)).await, None);
        // Python's json.dump of an undecodable byte; an escaped backslash is not an escape.
        let surrogates = br#"{"message": {"message": "RuntimeError: \udcff\udcfe \ud83d\ude00 \\udcff"}}"#;
        assert_eq!(
            said(read(dir.written("surrogates.json", surrogates)).await),
            "RuntimeError: \u{fffd}\u{fffd} \u{1f600} \\udcff"
        );
    }

    #[tokio::test]
    async fn what_is_not_a_file_record_wrote_is_named_and_never_blocks() {
        let dir = Dir::new("odd");
        let why = unreadable(read(dir.written("garbage.json", b"Segmentation fault")).await);
        assert!(why.contains("is not the JSON torch's @record writes") && why.contains("garbage.json"), "{why}");
        let big = dir.written("big.json", &vec![b' '; MAX_READ as usize + 1]);
        assert!(unreadable(read(big).await).contains("too large to read"));
        std::fs::create_dir(dir.0.join("dir.json")).expect("dir");
        assert!(unreadable(read(dir.0.join("dir.json")).await).ends_with("is not a regular file"));
        // A FIFO with no writer: opening it to read would wait for one.
        let fifo = dir.0.join("fifo.json");
        let c_path = std::ffi::CString::new(fifo.to_str().expect("utf-8")).expect("path");
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0, "mkfifo");
        assert!(unreadable(read(fifo).await).ends_with("is not a regular file"));
    }

    #[tokio::test]
    async fn a_long_message_is_bounded_and_control_characters_written_out() {
        let dir = Dir::new("bounded");
        let long = serde_json::json!({ "message": { "message": "x\n".repeat(100) } }).to_string();
        let text = said(read(dir.written("long.json", long.as_bytes())).await);
        assert_eq!(text.lines().count(), MAX_LINES);
        assert!(text.ends_with(" [...]"), "{text}");
        let wide = serde_json::json!({ "message": "é".repeat(MAX_CHARS * 2) }).to_string();
        let text = said(read(dir.written("wide.json", wide.as_bytes())).await);
        assert_eq!(text.chars().count(), MAX_CHARS + " [...]".len());
        let headline = Raised::headline(Some(&Raised::Message(text)));
        assert_eq!(headline.chars().count(), ": ".len() + HEADLINE_CHARS + " [...]".len());
        let ansi = serde_json::json!({ "message": "\u{1b}[31mred\r\0" }).to_string();
        assert_eq!(said(read(dir.written("ansi.json", ansi.as_bytes())).await), "\\u{1b}[31mred\\r\\u{0}");
        let rtl = serde_json::json!({ "message": "ok\u{202e}txt.exe" }).to_string();
        assert_eq!(said(read(dir.written("rtl.json", rtl.as_bytes())).await), "ok\\u{202e}txt.exe");
        assert_eq!(Raised::headline(Some(&Raised::Unreadable("why".into()))), "");
        let later = Raised::Message("RuntimeError: \n\n  the real message\nmore".into());
        assert_eq!(Raised::headline(Some(&later)), ": RuntimeError: the real message");
        let two = Raised::Message("ValueError: bad lr\nlr must be positive".into());
        assert_eq!(Raised::headline(Some(&two)), ": ValueError: bad lr");
    }

    #[tokio::test]
    async fn only_a_file_record_wrote_is_passed_on_with_the_exit_code() {
        let dir = Dir::new("pass");
        let parent = dir.0.join("parent.json");
        let record = br#"{"message": {"message": "ValueError: bad lr", "extraInfo": {"timestamp": "1"}}}"#;
        assert!(pass_on(dir.written("record.json", record), parent.clone(), -9).await.expect("passed"));
        let passed: serde_json::Value = serde_json::from_slice(&std::fs::read(&parent).expect("parent")).expect("json");
        assert_eq!(passed["message"]["message"], "ValueError: bad lr");
        assert_eq!(passed["message"]["errorCode"], -9);
        std::fs::remove_file(&parent).expect("removed");
        assert!(!pass_on(dir.written("garbage.json", b"\0\xff {{{"), parent.clone(), 1).await.expect("nothing"));
        assert!(!pass_on(dir.0.join("none.json"), parent.clone(), 1).await.expect("nothing"));
        assert!(!parent.exists());
    }

    #[test]
    fn clearing_removes_an_old_file_and_tolerates_none() {
        let dir = Dir::new("clear");
        let path = dir.written("old.json", b"{}");
        clear(&path).expect("cleared");
        assert!(!path.exists());
        clear(&path).expect("nothing to clear");
    }
}
