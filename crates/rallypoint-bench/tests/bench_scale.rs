//! `rallypoint bench` reports JSON; and scale at a size CI affords: with 4,096 clients in one barrier
//! (native; TCPStore's BARRIER with 1,024, spread over two load-generator processes) and a
//! 4,096-client connection storm, which must admit everyone with zero resets. Each
//! run is a separate process killed after a generous limit; nothing here asserts a
//! time (the figures are in docs/BENCHMARKS.md).

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_rallypoint-bench");
/// How long one benchmark process may run before the test kills it and fails.
const LIMIT: Duration = Duration::from_secs(180);

/// 4,096 clients, or fewer if this machine's open-file limit cannot hold them (the
/// load generator and the coordinator each need one descriptor per client).
fn clients() -> u32 {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit only writes the struct we pass.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) }, 0);
    let fit = limit.rlim_max.saturating_sub(200).min(4096) as u32;
    if fit < 4096 {
        eprintln!("open-file limit {}: running with {fit} clients instead of 4,096", limit.rlim_max);
    }
    fit
}

/// Runs `rallypoint bench ARGS --json` and returns its JSON report.
fn bench(args: &[&str]) -> Value {
    let mut child = Command::new(BIN)
        .args(args)
        .arg("--json")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start rallypoint bench");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for rallypoint bench") {
            break status;
        }
        if started.elapsed() > LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            panic!("rallypoint bench {args:?} did not finish within {LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut out = String::new();
    child.stdout.take().expect("piped stdout").read_to_string(&mut out).expect("read the report");
    assert!(status.success(), "rallypoint bench {args:?} failed ({status}); stdout: {out}");
    serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("bad report {out:?}: {e}"))
}

#[test]
fn barrier_of_4096_native_clients() {
    let n = clients().to_string();
    let report = bench(&["barrier", "--clients", &n, "--rounds", "3", "--warmup", "1"]);
    assert_eq!(report["clients"].to_string(), n);
    assert!(report["median_us"].as_f64().is_some_and(|us| us > 0.0), "{report}");
}

/// Barriers spoken without the client library (`--bare`: tokio tasks, native;
/// `--raw`: the floor's client threads, native and TCPStore): the run succeeds only
/// if every round was released with its own reply, and the report says which client
/// ran and carries both sides' CPU (the server's started by the benchmark; `--raw`
/// samples it from the load), over all rounds and over the measured ones.
#[test]
fn bare_and_raw_barriers_run_every_round() {
    for (client, protocol) in [("bare", "native"), ("raw", "native"), ("raw", "tcpstore")] {
        let flag = format!("--{client}");
        let args = ["barrier", &flag, "--protocol", protocol, "--clients", "256", "--rounds", "20", "--warmup", "2"];
        let report = bench(&args);
        assert_eq!((report[client].as_bool(), report["clients"].as_u64()), (Some(true), Some(256)), "{report}");
        assert!(report["median_us"].as_f64().is_some_and(|us| us > 0.0), "{report}");
        for side in ["server", "client"] {
            for window in ["", "measured_"] {
                let cpu = &report[format!("{side}_cpu_us_per_{window}rank_round")];
                assert!(cpu.as_f64().is_some_and(|us| us > 0.0), "{client} {protocol} {side} {window}: {report}");
            }
        }
    }
}

/// `--bare` is the native barrier from one process, `--raw` a barrier of either
/// protocol from one process: anything else is refused by name.
#[test]
fn bare_and_raw_clients_refuse_what_they_cannot_run() {
    let neither = [&["--op", "ping"][..], &["--op", "floor"], &["--procs", "2"]];
    let bare = neither.iter().copied().chain([&["--protocol", "tcpstore"][..]]).map(|extra| ("--bare", extra));
    for (client, extra) in bare.chain(neither.iter().map(|extra| ("--raw", *extra))) {
        let out = Command::new(BIN)
            .args(["barrier", client, "--clients", "4", "--rounds", "1"])
            .args(extra)
            .output()
            .expect("run rallypoint bench");
        let err = String::from_utf8_lossy(&out.stderr);
        let refused = format!("{client} is for ");
        assert!(!out.status.success() && err.contains(&refused), "{client} {extra:?}: {err}");
    }
}

/// `--names-before K`: every client passes K barriers named afresh before the rounds,
/// in one process and spread over blocking children alike, and the report says how
/// long each took; what cannot run them is refused by name.
#[test]
fn barriers_named_afresh_run_before_the_rounds() {
    for procs in [&["--procs", "1"][..], &["--procs", "4", "--blocking"]] {
        let mut args = vec!["barrier", "--clients", "4", "--rounds", "3", "--warmup", "1", "--names-before", "20"];
        args.extend(procs);
        let report = bench(&args);
        assert_eq!(report["names_before"].as_u64(), Some(20), "{report}");
        assert!(report["names_before_ms_each"].as_f64().is_some_and(|ms| ms > 0.0), "{report}");
    }
    let report = bench(&["barrier", "--clients", "2", "--rounds", "2"]);
    assert!(report["names_before_ms_each"].is_null(), "{report}");
    for extra in [&["--bare"][..], &["--protocol", "tcpstore"], &["--op", "ping"]] {
        let out = Command::new(BIN)
            .args(["barrier", "--clients", "2", "--rounds", "1", "--names-before", "3"])
            .args(extra)
            .output()
            .expect("run rallypoint bench");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains("--names-before is for barrier rounds"), "{extra:?}: {err}");
    }
}

#[test]
fn tcpstore_barrier_of_4096_clients_from_two_processes() {
    let n = clients().to_string();
    let report = bench(&[
        "barrier",
        "--protocol",
        "tcpstore",
        "--procs",
        "2",
        "--clients",
        &n,
        "--rounds",
        "3",
        "--warmup",
        "1",
    ]);
    assert_eq!((report["procs"].as_u64(), report["clients"].to_string()), (Some(2), n));
    assert!(report["median_us"].as_f64().is_some_and(|us| us > 0.0), "{report}");
}

#[test]
fn storm_of_4096_clients_admits_all_without_resets() {
    let n = clients();
    let report = bench(&["storm", "--clients", &n.to_string(), "--timeout", "120"]);
    assert_eq!(report["admitted"].as_u64(), Some(u64::from(n)), "{report}");
    assert_eq!(report["failed"].as_u64(), Some(0), "{report}");
    assert_eq!(report["resets"].as_u64(), Some(0), "{report}");
    assert_eq!(report["refused"].as_u64(), Some(0), "{report}");
}

#[test]
fn benches_report_json() {
    let report = bench(&["barrier", "--clients", "4", "--rounds", "20"]);
    assert_eq!(report["clients"], 4);
    assert_eq!(report["rounds"], 20);
    for field in ["median_us", "p99_us", "mean_us", "min_us", "max_us", "connect_ms"] {
        assert!(report[field].as_f64().is_some_and(|v| v > 0.0), "{field}: {report}");
    }
    assert!(report["p99_us"].as_f64() >= report["median_us"].as_f64());
    assert!(report["server_rss_per_conn_bytes"].is_u64(), "{report}");

    let report = bench(&["kv", "--clients", "2", "--ops", "20", "--adds", "40"]);
    for op in ["set", "get", "add", "check", "compare_set", "multi_get"] {
        assert_eq!(report["latency"][op]["count"], 20, "{op}: {report}");
    }
    // One throughput run per `--clients` count.
    assert_eq!(report["add_throughput"][0]["clients"], 2, "{report}");
    assert_eq!(report["add_throughput"][0]["ops"], 40, "{report}");
}

/// The floor under a barrier of processes: every round of 64 processes released by
/// its last arrival, and no shared file left behind.
#[test]
fn wake_floor_runs_its_processes_through_every_round() {
    let leftovers = || {
        std::fs::read_dir(std::env::temp_dir())
            .map(|dir| {
                dir.flatten().filter(|e| e.file_name().to_string_lossy().starts_with("rallypoint-wake-floor-")).count()
            })
            .unwrap_or(0)
    };
    let before = leftovers();
    let report = bench(&["barrier", "--op", "wake-floor", "--procs", "64", "--rounds", "25", "--warmup", "2"]);
    assert_eq!(report["op"], "wake-floor", "{report}");
    assert_eq!((report["procs"].as_u64(), report["rounds"].as_u64()), (Some(64), Some(25)), "{report}");
    for field in ["median_us", "min_us", "max_us"] {
        assert!(report[field].as_f64().is_some_and(|v| v > 0.0), "{field}: {report}");
    }
    assert!(leftovers() <= before, "the shared file was left in {}", std::env::temp_dir().display());
}

/// Runs `rallypoint bench hierarchy --channels` of `ranks` ranks over two agents
/// and two load generators, with `extra` flags; returns its report.
fn hierarchy_through_channels(ranks: &str, extra: &[&str]) -> Value {
    let mut args = vec!["hierarchy", "--ranks", ranks, "--agents", "2", "--generators", "2", "--channels"];
    args.extend_from_slice(&["--rounds", "3", "--warmup", "1", "--timeout", "120"]);
    args.extend_from_slice(extra);
    bench(&args)
}

#[test]
fn hierarchy_ranks_arrive_through_barrier_channels_or_fall_back_to_messages() {
    let report = hierarchy_through_channels("512", &[]);
    assert_eq!(report["channels"], true, "{report}");
    assert_eq!(report["ranks_through_channels"], 512, "{report}");
    assert!(report["median_us"].as_f64().is_some_and(|us| us > 0.0), "{report}");
    for group in ["coordinator", "agents", "generators"] {
        assert!(report["cpu_us_per_rank_round"][group].is_f64(), "{group}: {report}");
    }
    // Over TCP the agents give no channel: every rank goes through messages.
    let report = hierarchy_through_channels("64", &["--transport", "tcp"]);
    assert_eq!(report["ranks_through_channels"], 0, "{report}");
    assert!(report["median_us"].as_f64().is_some_and(|us| us > 0.0), "{report}");
}

/// A job's start (`hierarchy --start`): every rank registered, through the barrier and
/// given the all-gather's result, the phases in order; its floor the same way; and
/// the TCPStore anchor against `rallypoint serve`, whose ranks check every address.
#[test]
fn a_jobs_start_reports_its_phases_in_order_and_its_floor_and_anchor_run() {
    let phases_in_order = |report: &Value| {
        let at: Vec<f64> = ["registered_ms", "barrier_ms", "all_gather_ms"]
            .iter()
            .map(|phase| report[phase].as_f64().unwrap_or_else(|| panic!("{phase}: {report}")))
            .collect();
        assert!(0.0 < at[0] && at[0] <= at[1] && at[1] <= at[2], "{report}");
    };
    // 6,000 ranks: the result (6,000 addresses) is large enough to go as shared memory.
    let start = ["hierarchy", "--start", "--ranks", "6000", "--agents", "3", "--generators", "2", "--timeout", "150"];
    let report = bench(&start);
    assert_eq!((report["op"].as_str(), report["floor"].as_bool()), (Some("start"), Some(false)), "{report}");
    assert_eq!(report["ranks_with_shared_result"], 6000, "{report}");
    phases_in_order(&report);
    assert!(report["cpu_ms"]["coordinator"].is_f64(), "{report}");
    let report = bench(&[&start[..], &["--floor"]].concat());
    assert_eq!(report["floor"], true, "{report}");
    assert_eq!(report["ranks_with_shared_result"], 6000, "{report}");
    phases_in_order(&report);
    // A small start takes its result on the socket.
    let report = bench(&["hierarchy", "--start", "--ranks", "50", "--agents", "2"]);
    assert_eq!(report["ranks_with_shared_result"], 0, "{report}");
    phases_in_order(&report);

    let mut serve = Command::new(std::path::Path::new(BIN).with_file_name("rallypoint"))
        .args(["serve", "--listen", "127.0.0.1:0", "--print-addr"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .expect("start rallypoint serve");
    let mut addr = String::new();
    let mut stdout = serve.stdout.take().expect("piped stdout");
    let mut byte = [0u8; 1];
    while stdout.read(&mut byte).expect("read the address") == 1 && byte[0] != b'\n' {
        addr.push(byte[0] as char);
    }
    let report = bench(&["tcpstore-start", "--addr", addr.trim(), "--ranks", "300", "--timeout", "120"]);
    let _ = serve.kill();
    let _ = serve.wait();
    assert_eq!((report["op"].as_str(), report["ranks"].as_u64()), (Some("start"), Some(300)), "{report}");
    phases_in_order(&report);
}

/// The children of process `pid` with their command lines.
fn children(pid: u32) -> Vec<(u32, String)> {
    let list = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    list.split_whitespace()
        .filter_map(|child| child.parse::<u32>().ok())
        .map(|child| {
            let cmdline = std::fs::read(format!("/proc/{child}/cmdline")).unwrap_or_default();
            (child, String::from_utf8_lossy(&cmdline).replace('\0', " "))
        })
        .collect()
}

/// A node agent killed while its ranks wait in barrier channels fails the run with
/// the rank and what happened, well before the run's own timeout.
#[test]
fn hierarchy_through_channels_fails_clearly_when_an_agent_dies() {
    let mut child = Command::new(BIN)
        .args(["hierarchy", "--ranks", "256", "--agents", "2", "--channels", "--rounds", "100000000"])
        .args(["--warmup", "1", "--timeout", "90"])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start rallypoint bench");
    let pid = child.id();
    let started = Instant::now();
    // Once the generator has mapped a channel, its ranks are past their attach calls.
    let agent = loop {
        assert!(started.elapsed() < LIMIT, "the generator never mapped a barrier channel");
        assert!(child.try_wait().expect("wait").is_none(), "rallypoint bench ended before the agent was killed");
        let kids = children(pid);
        let mapped = kids.iter().filter(|(_, cmd)| cmd.contains("--generator")).any(|(generator, _)| {
            std::fs::read_to_string(format!("/proc/{generator}/maps"))
                .is_ok_and(|maps| maps.contains("rallypoint-barrier"))
        });
        if let Some(&(agent, _)) = kids.iter().find(|(_, cmd)| cmd.contains(" agent ")).filter(|_| mapped) {
            break agent;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    // Some rounds through the channels first.
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: kill has no memory-safety preconditions; `agent` is our grandchild.
    assert_eq!(unsafe { libc::kill(agent as libc::pid_t, libc::SIGKILL) }, 0);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for rallypoint bench") {
            break status;
        }
        if started.elapsed() > LIMIT {
            let _ = child.kill();
            panic!("rallypoint bench did not end after its agent was killed");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    child.stderr.take().expect("piped stderr").read_to_string(&mut err).expect("read stderr");
    assert!(!status.success(), "a run whose agent died succeeded; stderr: {err}");
    assert!(!err.contains("did not finish within"), "it hung until its timeout: {err}");
    assert!(err.contains("rank ") && err.contains("barrier round"), "no rank and round named: {err}");
    assert!(err.contains("closed the connection") || err.contains("failed"), "not said what happened: {err}");
}
