//! How `rallypoint status` finds the launchers of this user on this machine without
//! being told an address: each launcher writes a small file saying where its
//! coordinator is and which job it runs, in a directory only this user can enter
//! (`$XDG_RUNTIME_DIR/rallypoint`, else `rallypoint-<uid>` in the temporary
//! directory, mode 0700), and removes it when it ends. A file left by a launcher
//! killed with SIGKILL is recognised by its process being gone (or being another
//! process with the same pid: the start time is recorded too) and removed by the
//! next reader.

use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

const FILE_PREFIX: &str = "launch-";
const FILE_SUFFIX: &str = ".json";

/// What a launcher says about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub pid: u32,
    /// The process's start time (`/proc/PID/stat`, clock ticks since boot): a pid
    /// reused by another process does not pass for the launcher.
    pub start_ticks: u64,
    /// The coordinator, HOST:PORT.
    pub addr: String,
    /// The job as the user named it.
    pub job: String,
    /// The coordinator job of the attempt running now (`NAME`, then `NAME.restart1`, ...).
    pub attempt_job: String,
    /// `None` until a launcher taking the next free index has joined.
    pub node_rank: Option<u32>,
    pub nnodes: u32,
    pub nproc_per_node: u32,
    /// The worker command, for a person choosing among launchers.
    pub command: String,
    pub started_unix_ms: u64,
    /// The job's token file (readable by this user only), so that `rallypoint status`
    /// of the same user proves the token without being given it.
    #[serde(default)]
    pub token_file: Option<PathBuf>,
}

/// This launcher's file, removed when dropped.
pub struct Registration {
    path: PathBuf,
    entry: Entry,
}

impl Registration {
    /// Writes the file (this process's pid and start time fill `entry`'s).
    pub fn create(mut entry: Entry) -> io::Result<Registration> {
        entry.pid = std::process::id();
        entry.start_ticks = start_ticks(entry.pid).unwrap_or(0);
        let path = private_dir()?.join(format!("{FILE_PREFIX}{}{FILE_SUFFIX}", entry.pid));
        write(&path, &entry)?;
        Ok(Registration { path, entry })
    }

    /// This launcher joined as node `node`.
    pub fn set_node_rank(&mut self, node: u32) {
        self.entry.node_rank = Some(node);
        if let Err(error) = write(&self.path, &self.entry) {
            tracing::debug!(%error, "cannot update {}", self.path.display());
        }
    }

    /// The attempt running now moved to another coordinator job.
    pub fn set_attempt_job(&mut self, job: &str) {
        self.entry.attempt_job = job.to_owned();
        if let Err(error) = write(&self.path, &self.entry) {
            tracing::debug!(%error, "cannot update {}", self.path.display());
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Err(error) = std::fs::remove_file(&self.path) {
            tracing::debug!(%error, "cannot remove {}", self.path.display());
        }
    }
}

/// The launchers of this user running on this machine, oldest first. Files of
/// launchers that are gone are removed on the way.
pub fn launchers() -> Vec<Entry> {
    let Ok(dir) = existing_private_dir() else { return Vec::new() };
    let Ok(files) = std::fs::read_dir(&dir) else { return Vec::new() };
    let mut found = Vec::new();
    for file in files.flatten() {
        let name = file.file_name();
        let Some(name) = name.to_str() else { continue };
        if !(name.starts_with(FILE_PREFIX) && name.ends_with(FILE_SUFFIX)) {
            continue;
        }
        let path = file.path();
        let Some(entry) = std::fs::read(&path).ok().and_then(|bytes| serde_json::from_slice::<Entry>(&bytes).ok())
        else {
            continue;
        };
        if start_ticks(entry.pid).is_some_and(|ticks| ticks == entry.start_ticks) {
            found.push(entry);
        } else {
            let _ = std::fs::remove_file(&path);
        }
    }
    found.sort_by_key(|e| (e.started_unix_ms, e.pid));
    found
}

/// Written whole or not at all: a reader never sees half a file.
fn write(path: &Path, entry: &Entry) -> io::Result<()> {
    let json = serde_json::to_vec(entry).map_err(io::Error::other)?;
    let tmp = path.with_extension("tmp");
    let mut file = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp)?;
    file.write_all(&json)?;
    drop(file);
    std::fs::rename(&tmp, path)
}

fn base_dir() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from) {
        Some(dir) if dir.is_absolute() && dir.is_dir() => dir.join("rallypoint"),
        // SAFETY: geteuid has no preconditions and cannot fail.
        _ => std::env::temp_dir().join(format!("rallypoint-{}", unsafe { libc::geteuid() })),
    }
}

/// The directory, made if missing; refused unless it is this user's own and private
/// (in a shared temporary directory, someone else could have made it first).
fn private_dir() -> io::Result<PathBuf> {
    let dir = base_dir();
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => Ok(dir),
        Err(error) if error.kind() == io::ErrorKind::AlreadyExists => existing_private_dir(),
        Err(error) => Err(error),
    }
}

fn existing_private_dir() -> io::Result<PathBuf> {
    let dir = base_dir();
    let meta = std::fs::symlink_metadata(&dir)?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    if !meta.is_dir() || meta.uid() != uid || meta.permissions().mode() & 0o077 != 0 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("{} is not a private directory of this user", dir.display()),
        ));
    }
    Ok(dir)
}

/// Field 22 of `/proc/PID/stat`: when the process started.
fn start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: fields start after the last ')'.
    let after = stat.iter().rposition(|&b| b == b')')?;
    let rest = std::str::from_utf8(&stat[after + 1..]).ok()?;
    rest.split_whitespace().nth(19)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_start_time_of_this_process_is_read() {
        let ticks = start_ticks(std::process::id()).expect("this process has a stat");
        assert!(ticks > 0);
        assert_eq!(start_ticks(std::process::id()), Some(ticks), "stable");
        assert_eq!(start_ticks(u32::MAX), None);
    }
}
