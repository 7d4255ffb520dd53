//! `rallypoint bench ...`: the benchmarks live in a binary of their own
//! (`rallypoint-bench`, crate `rallypoint-bench`) so that the `rallypoint` users
//! install carries no load generators or plotting library. This finds that binary
//! next to this one (or on `PATH`) and runs it in this process's place.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

#[derive(Args, Debug)]
#[command(disable_help_flag = true)]
pub struct BenchArgs {
    /// The workload and its flags, as `rallypoint-bench` takes them (`rallypoint bench --help` lists them)
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, value_name = "ARGS")]
    args: Vec<OsString>,
}

const BENCH: &str = "rallypoint-bench";

pub fn run(args: BenchArgs) -> anyhow::Result<i32> {
    let bench = find().with_context(|| {
        format!(
            "the benchmarks are not part of this build: build them with `cargo build --release -p {BENCH}` \
             (the binary `{BENCH}` goes next to `rallypoint`, or anywhere on PATH)"
        )
    })?;
    // Only returns if the binary could not be started.
    let error = std::process::Command::new(&bench).args(&args.args).exec();
    Err(error).with_context(|| format!("cannot run {}", bench.display()))
}

/// `rallypoint-bench` next to this executable (how cargo builds them), else on PATH.
fn find() -> Option<PathBuf> {
    let sibling = std::env::current_exe().ok().map(|me| me.with_file_name(BENCH)).filter(|p| p.is_file());
    sibling.or_else(|| {
        let path = std::env::var_os("PATH")?;
        std::env::split_paths(&path).map(|dir| dir.join(BENCH)).find(|p| p.is_file())
    })
}
