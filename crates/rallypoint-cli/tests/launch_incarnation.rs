//! `rallypoint launch` starts a fresh job incarnation for each attempt, on every node
//! alike, and its workers belong to it (RALLYPOINT_JOB_INCARNATION).

use std::collections::BTreeSet;
use std::io::Read;
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_rallypoint");
const LIMIT: Duration = Duration::from_secs(60);

/// Runs one node's launcher of a two-node job on `master` to its end: (exit code, stdout, stderr).
fn node(rank: u32, master: &str, script: &str) -> thread::JoinHandle<(Option<i32>, String, String)> {
    let mut command = Command::new(BIN);
    for var in ["RALLYPOINT_ADDR", "RALLYPOINT_JOB", "RALLYPOINT_JOB_INCARNATION", "RANK", "WORLD_SIZE", "RUST_LOG"] {
        command.env_remove(var);
    }
    command.args(["launch", "--nnodes", "2", "--nproc-per-node", "1", "--master", master, "--job", "inc"]);
    command.args(["--max-restarts", "1", "--grace", "2", "--node-rank", &rank.to_string(), "--", "sh", "-c", script]);
    // The nodes of a job share its token.
    command.env("RALLYPOINT_TOKEN", "launch-incarnation-test-token").env_remove("RALLYPOINT_TOKEN_FILE");
    command.env("RP", BIN).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = command.spawn().expect("start a launcher");
    thread::spawn(move || {
        let (mut out, mut err) = (child.stdout.take().expect("piped"), child.stderr.take().expect("piped"));
        let stderr = thread::spawn(move || {
            let mut text = String::new();
            let _ = err.read_to_string(&mut text);
            text
        });
        let mut stdout = String::new();
        let _ = out.read_to_string(&mut stdout);
        let deadline = Instant::now() + LIMIT;
        let code = loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                break status.code();
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("a launcher did not finish within {LIMIT:?}");
            }
            thread::sleep(Duration::from_millis(20));
        };
        (code, stdout, stderr.join().expect("stderr"))
    })
}

#[test]
fn each_attempt_is_a_fresh_job_incarnation_on_every_node() {
    let port = TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
    let master = format!("127.0.0.1:{port}");
    let script = r#"
        echo "incarnation $TORCHELASTIC_RESTART_COUNT $RALLYPOINT_JOB_INCARNATION"
        if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ] && [ "$RANK" = 1 ]; then exit 4; fi
        "$RP" barrier together --timeout 30 || exit 9
        echo "passed"
    "#;
    let (zero, one) = (node(0, &master, script), node(1, &master, script));
    let ((c0, out0, err0), (c1, out1, err1)) = (zero.join().expect("node 0"), one.join().expect("node 1"));
    assert_eq!(c0, Some(0), "node 0:\n{out0}\n{err0}");
    assert_eq!(c1, Some(0), "node 1:\n{out1}\n{err1}");
    let seen = |attempt: &str| -> BTreeSet<String> {
        let prefix = format!("incarnation {attempt} ");
        [&out0, &out1]
            .iter()
            .flat_map(|out| out.lines())
            .filter_map(|line| line.split_once("]: ").map(|(_, rest)| rest))
            .filter_map(|rest| rest.strip_prefix(&prefix).map(str::to_owned))
            .collect()
    };
    let (first, second) = (seen("0"), seen("1"));
    assert_eq!(first.len(), 1, "both nodes' workers of attempt 0 name one incarnation: {first:?}");
    assert_eq!(second.len(), 1, "both nodes' workers of attempt 1 name one incarnation: {second:?}");
    let incarnation = second.iter().next().expect("one");
    assert!(incarnation.len() == 16 && incarnation.chars().all(|c| c.is_ascii_hexdigit()), "{incarnation}");
    assert_ne!(first, second, "a restart starts a new incarnation");
    assert!(out0.contains("[rank0]: passed") && out1.contains("[rank1]: passed"), "{out0}\n{out1}");
}
