//! `rallypoint bench barrier --op wake-floor --procs N`: what a barrier of N rank
//! *processes* costs with nothing between them but one shared word, measured in the
//! same run as the barriers it bounds. No agent, no coordinator, no sockets, no
//! client library: each child process maps one shared file, counts itself in it
//! with one atomic add, and sleeps on a futex; the last to arrive stamps the time,
//! readies the count for the next round and wakes every sleeper with one futex
//! wake. This is the barrier channels' path (docs/PROTOCOL.md, section 15) without
//! the agent in the middle: a round cannot take less than the kernel needs to wake
//! N sleeping processes and run each of them once.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use rustix::mm::{mmap, munmap, MapFlags, ProtFlags};
use rustix::thread::futex;

use crate::floor::Plan;
use crate::{mono_ns, round_stats, Times};

/// The shared file: the arrival count, the round word the sleepers wait on, a
/// failure flag, and each round's end as stamped by its last arrival.
struct Shared {
    base: NonNull<u8>,
    len: usize,
    rounds: usize,
}

const COUNT: usize = 0;
const ROUND: usize = 4;
const FAILED: usize = 8;
const STAMPS: usize = 16;

impl Shared {
    fn len(rounds: usize) -> usize {
        STAMPS + 8 * rounds
    }

    fn map(file: &File, rounds: usize) -> anyhow::Result<Shared> {
        let len = Shared::len(rounds);
        ensure!(file.metadata()?.len() as usize >= len, "the shared file is shorter than {rounds} rounds need");
        // SAFETY: a fresh shared mapping of a file at least `len` long, unmapped on drop.
        let base =
            unsafe { mmap(std::ptr::null_mut(), len, ProtFlags::READ | ProtFlags::WRITE, MapFlags::SHARED, file, 0) }
                .context("mapping the shared file")?;
        let base = NonNull::new(base.cast::<u8>()).context("mmap returned null")?;
        Ok(Shared { base, len, rounds })
    }

    fn word(&self, at: usize) -> &AtomicU32 {
        // SAFETY: `at` is one of the aligned offsets above, inside the mapping, which
        // lives as long as `self`; other processes touch it only through atomics.
        unsafe { &*self.base.as_ptr().add(at).cast::<AtomicU32>() }
    }

    fn stamp(&self, round: usize) -> &AtomicU64 {
        assert!(round < self.rounds, "round {round} is past the shared file's {} rounds", self.rounds);
        // SAFETY: as `word`; stamps are 8-aligned, and `round` is in range.
        unsafe { &*self.base.as_ptr().add(STAMPS + 8 * round).cast::<AtomicU64>() }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, no reference to it outlives `self`.
        let _ = unsafe { munmap(self.base.as_ptr().cast(), self.len) };
    }
}

/// The shared file's path, removed when the measurement ends however it ends.
struct SharedPath(PathBuf);

impl Drop for SharedPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Runs the measurement: N child processes, each one rank.
pub(crate) async fn measure(plan: &Plan) -> anyhow::Result<Times> {
    ensure!(plan.warmup >= 1, "--op wake-floor needs --warmup 1 or more: the first round starts the children");
    let path = SharedPath(std::env::temp_dir().join(format!("rallypoint-wake-floor-{}", std::process::id())));
    let file =
        File::options().read(true).write(true).create_new(true).open(&path.0).context("creating the shared file")?;
    file.set_len(Shared::len(plan.total()) as u64)?;
    let shared = Shared::map(&file, plan.total())?;
    let path = &path.0;
    let exe = std::env::current_exe().context("this benchmark's own path")?;
    let mut children = Vec::with_capacity(plan.ranks as usize);
    for _ in 0..plan.ranks {
        let child = tokio::process::Command::new(&exe)
            .args(["barrier", "--op", "wake-floor", "--procs", &plan.ranks.to_string()])
            .args(["--rounds", &plan.rounds.to_string(), "--warmup", &plan.warmup.to_string()])
            .args(["--timeout", &plan.timeout.as_secs_f64().to_string()])
            .arg("--wake-child")
            .arg(path)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("starting a rank process")?;
        children.push(child);
    }
    let deadline = tokio::time::Instant::now() + plan.timeout;
    for child in &mut children {
        let status = tokio::time::timeout_at(deadline, child.wait())
            .await
            .context("the rank processes did not finish their rounds in time")??;
        ensure!(status.success(), "a rank process failed ({status})");
    }
    ensure!(shared.word(FAILED).load(Ordering::Acquire) == 0, "a rank process gave up waiting");
    let ends: Vec<u64> = (0..plan.total()).map(|r| shared.stamp(r).load(Ordering::Acquire)).collect();
    // Round 0 ends when every process has started: a start, not a round.
    let stats = round_stats(ends[0], &ends[1..], plan.warmup as usize - 1).context("no rounds")?;
    Ok(stats.times)
}

/// One rank process: every round, arrive and wait for the last arrival's wake-up.
pub(crate) fn child(plan: &Plan, path: &Path) -> anyhow::Result<()> {
    let file = File::options().read(true).write(true).open(path).context("opening the shared file")?;
    let shared = Shared::map(&file, plan.total())?;
    let (count, round_word, failed) = (shared.word(COUNT), shared.word(ROUND), shared.word(FAILED));
    let deadline = Instant::now() + plan.timeout;
    for round in 0..plan.total() {
        let seen = round_word.load(Ordering::Acquire);
        if count.fetch_add(1, Ordering::AcqRel) + 1 == plan.ranks {
            shared.stamp(round).store(mono_ns(), Ordering::Release);
            count.store(0, Ordering::Release);
            round_word.store(seen.wrapping_add(1), Ordering::Release);
            let _ = futex::wake(round_word, futex::Flags::empty(), i32::MAX as u32);
            continue;
        }
        while round_word.load(Ordering::Acquire) == seen {
            if failed.load(Ordering::Acquire) != 0 {
                bail!("another rank process gave up");
            }
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                failed.store(1, Ordering::Release);
                let _ = futex::wake(round_word, futex::Flags::empty(), i32::MAX as u32);
                bail!("round {round} was not released within the timeout");
            };
            let left = left.min(Duration::from_millis(100));
            let timeout = futex::Timespec { tv_sec: left.as_secs() as i64, tv_nsec: i64::from(left.subsec_nanos()) };
            // EAGAIN (released meanwhile), EINTR and ETIMEDOUT all mean: look again.
            let _ = futex::wait(round_word, futex::Flags::empty(), seen, Some(&timeout));
        }
    }
    Ok(())
}
