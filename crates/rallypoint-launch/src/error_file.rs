//! torch's error files: each worker gets a path in `TORCHELASTIC_ERROR_FILE`, as
//! torchrun gives it, where a script's `@record`-decorated entry point (torch's
//! `torch.distributed.elastic.multiprocessing.errors.record`) writes the exception
//! that ended it. The launcher reads it back into the summary and the job's abort
//! reason: a stderr tail may have lost the exception's line under what the process
//! printed while exiting (torch's own shutdown warnings, for one).

use std::io::{self, Read};
use std::path::{Path, PathBuf};

/// The variable torch's `@record` reads (and torchrun sets per worker).
pub const VAR: &str = "TORCHELASTIC_ERROR_FILE";

/// Read at most this much of a file: its message is all we keep, and a worker
/// must not make its launcher read gigabytes.
const MAX_READ: u64 = 1 << 20;
/// The message kept: at most this many lines and characters.
const MAX_LINES: usize = 20;
const MAX_CHARS: usize = 4_000;

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

/// What the file at `path` says the worker raised, if it wrote one: its
/// `message` ("ValueError: bad lr"), bounded. A file torch did not write (not its
/// JSON) is said to be so, rather than dropped.
pub fn read(path: &Path) -> Option<String> {
    let mut text = Vec::new();
    match std::fs::File::open(path).and_then(|file| file.take(MAX_READ).read_to_end(&mut text)) {
        Ok(_) => {}
        Err(error) if error.kind() == io::ErrorKind::NotFound => return None,
        Err(error) => return Some(format!("(its error file {} could not be read: {error})", path.display())),
    }
    match message(&text) {
        Some(message) => Some(bounded(message.trim_end())),
        None => Some(format!("(its error file {} is not the JSON torch's @record writes)", path.display())),
    }
}

/// `{"message": {"message": "...", "extraInfo": {...}}}` as `@record` writes it, or
/// `{"message": "..."}` as torch also reads.
fn message(text: &[u8]) -> Option<String> {
    let value: serde_json::Value = serde_json::from_slice(text).ok()?;
    let message = value.get("message")?;
    let text = message.as_str().or_else(|| message.get("message")?.as_str())?;
    Some(text.to_owned())
}

fn bounded(message: &str) -> String {
    let mut kept: String = message.lines().take(MAX_LINES).collect::<Vec<_>>().join("\n");
    if let Some((at, _)) = kept.char_indices().nth(MAX_CHARS) {
        kept.truncate(at);
    }
    if kept.len() < message.len() {
        kept.push_str(" [...]");
    }
    kept
}

/// The first line of what a worker raised, for one-line headlines.
pub fn first_line(raised: &str) -> &str {
    raised.lines().next().unwrap_or("")
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

    #[test]
    fn the_message_record_writes_is_read_and_a_missing_file_is_nothing() {
        let dir = Dir::new("read");
        let record = br#"{"message": {"message": "ValueError: bad lr", "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1764570000"}}}"#;
        assert_eq!(read(&dir.written("record.json", record)).as_deref(), Some("ValueError: bad lr"));
        let plain = br#"{"message": "RuntimeError: boom\n", "timestamp": 1}"#;
        assert_eq!(read(&dir.written("plain.json", plain)).as_deref(), Some("RuntimeError: boom"));
        assert_eq!(read(&path(&dir.0, 0)), None);
    }

    #[test]
    fn a_file_torch_did_not_write_is_named_and_a_long_message_bounded() {
        let dir = Dir::new("bounded");
        let path = dir.written("garbage.json", b"Segmentation fault");
        let said = read(&path).expect("said");
        assert!(said.contains("is not the JSON torch's @record writes") && said.contains("garbage.json"), "{said}");
        let long = serde_json::json!({ "message": { "message": "x\n".repeat(100) } }).to_string();
        let said = read(&dir.written("long.json", long.as_bytes())).expect("said");
        assert_eq!(said.lines().count(), MAX_LINES);
        assert!(said.ends_with(" [...]"), "{said}");
        let wide = serde_json::json!({ "message": "é".repeat(MAX_CHARS * 2) }).to_string();
        let said = read(&dir.written("wide.json", wide.as_bytes())).expect("said");
        assert_eq!(said.chars().count(), MAX_CHARS + " [...]".len());
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
