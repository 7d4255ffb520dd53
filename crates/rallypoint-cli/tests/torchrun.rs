//! `rallypoint launch` as a drop-in for torchrun: the examples of torchrun's own usage
//! documentation (torch/distributed/run.py, "Usage"), with `torchrun` replaced by
//! `rallypoint launch`, and the effect of every torchrun flag it accepts, in both
//! spellings and with `=`. The workers are a small Python script that writes down
//! what it was given (environment, arguments, interpreter); one test runs torch with
//! gloo when the project's venv is there.

use std::collections::HashMap;
use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

mod common;
use common::{torch_python, SCRUB};

const BIN: &str = env!("CARGO_BIN_EXE_rallypoint");
const LIMIT: Duration = Duration::from_secs(120);

/// What every launcher of a test is given: a job of several nodes needs a token its
/// launchers share (torchrun has none; see README, Authentication).
const SHARED_TOKEN: &str = "torchrun-test-token-shared-by-every-node";

/// Writes what a worker was given to `$OUT/<GROUP_RANK>-<LOCAL_RANK>.json`, prints a
/// line to stdout and one to stderr, and fails on the first attempt if FAIL_ONCE names
/// its rank.
const CHECK_ENV: &str = r#"
import json, os, sys
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
        "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
        "RALLYPOINT_ADDR", "RALLYPOINT_JOB", "RALLYPOINT_COORDINATOR", "PYTHONUNBUFFERED"]
seen = {k: os.environ.get(k) for k in keys}
seen["argv"] = sys.argv
seen["executable"] = sys.executable
seen["unbuffered"] = "-u" in sys.orig_argv[:sys.orig_argv.index(sys.argv[0]) if sys.argv[0] in sys.orig_argv else None]
out = os.environ["OUT"]
name = "%s-%s" % (os.environ["GROUP_RANK"], os.environ["LOCAL_RANK"])
# Written whole under a name of this process's own, then renamed: two jobs stacked on
# one node share the directory and each has a worker of the same name.
tmp = os.path.join(out, "%s.%d.tmp" % (name, os.getpid()))
with open(tmp, "w") as f:
    json.dump(seen, f)
os.rename(tmp, os.path.join(out, name + ".json"))
print("out of rank", os.environ["RANK"])
print("err of rank", os.environ["RANK"], file=sys.stderr)
if os.environ.get("FAIL_ONCE") == os.environ["RANK"] and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    sys.exit(3)
"#;

struct Done {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

struct Test {
    dir: PathBuf,
    out: PathBuf,
}

impl Test {
    fn new(name: &str) -> Test {
        let dir = std::env::temp_dir().join(format!("rp-torchrun-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let out = dir.join("out");
        std::fs::create_dir_all(&out).expect("test dir");
        std::fs::write(dir.join("check_env.py"), CHECK_ENV).expect("script");
        std::fs::create_dir_all(dir.join("pkg")).expect("package");
        std::fs::write(dir.join("pkg/__init__.py"), "").expect("package");
        std::fs::write(dir.join("pkg/check.py"), CHECK_ENV).expect("module");
        Test { dir, out }
    }

    /// `rallypoint launch ARGS` (run in the test's directory, with `env`).
    fn start(&self, args: &[&str], env: &[(&str, &str)]) -> Child {
        let mut cmd = Command::new(BIN);
        for var in SCRUB {
            cmd.env_remove(var);
        }
        cmd.env("RALLYPOINT_TOKEN", SHARED_TOKEN);
        cmd.arg("launch").args(args).current_dir(&self.dir).env("OUT", &self.out).envs(env.iter().copied());
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        cmd.spawn().expect("start rallypoint launch")
    }

    fn run(&self, args: &[&str], env: &[(&str, &str)]) -> Done {
        finish(self.start(args, env))
    }

    /// What worker `node`-`local` wrote.
    fn seen(&self, node: u32, local: u32) -> HashMap<String, serde_json::Value> {
        let path = self.out.join(format!("{node}-{local}.json"));
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        serde_json::from_str(&text).expect("json")
    }

    fn var(&self, node: u32, local: u32, key: &str) -> String {
        match self.seen(node, local).get(key) {
            Some(serde_json::Value::String(s)) => s.clone(),
            other => panic!("{key} of {node}-{local}: {other:?}"),
        }
    }

    fn argv(&self, node: u32, local: u32) -> Vec<String> {
        let seen = self.seen(node, local);
        seen["argv"].as_array().expect("argv").iter().map(|a| a.as_str().unwrap_or_default().to_owned()).collect()
    }

    fn clear(&self) {
        let _ = std::fs::remove_dir_all(&self.out);
        std::fs::create_dir_all(&self.out).expect("out dir");
    }

    fn path(&self, name: &str) -> String {
        self.dir.join(name).to_str().expect("utf-8 path").to_owned()
    }
}

impl Drop for Test {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn finish(mut child: Child) -> Done {
    let mut out = child.stdout.take().expect("piped");
    let mut err = child.stderr.take().expect("piped");
    let stdout = thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let stderr = thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + LIMIT;
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        thread::sleep(Duration::from_millis(20));
    };
    let (stdout, stderr) = (stdout.join().unwrap_or_default(), stderr.join().unwrap_or_default());
    let status = status.unwrap_or_else(|| panic!("ran past {LIMIT:?}\nstdout:\n{stdout}\nstderr:\n{stderr}"));
    Done { code: status.code(), stdout, stderr }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("free port")
}

fn ok(done: &Done) {
    assert_eq!(done.code, Some(0), "stdout:\n{}\nstderr:\n{}", done.stdout, done.stderr);
}

#[test]
fn single_node_multi_worker() {
    // torchrun --standalone --nnodes=1 --nproc-per-node=$NUM_TRAINERS YOUR_TRAINING_SCRIPT.py (--arg1 ...)
    let t = Test::new("standalone");
    let done = t.run(&["--standalone", "--nnodes=1", "--nproc-per-node=3", "check_env.py", "--arg1", "x"], &[]);
    ok(&done);
    for local in 0..3 {
        assert_eq!(t.argv(0, local), ["check_env.py", "--arg1", "x"]);
        assert_eq!(t.var(0, local, "RANK"), local.to_string());
        assert_eq!(t.var(0, local, "WORLD_SIZE"), "3");
        assert_eq!(t.var(0, local, "LOCAL_WORLD_SIZE"), "3");
        assert_eq!(t.var(0, local, "MASTER_ADDR"), "127.0.0.1");
        assert_eq!(t.seen(0, local)["unbuffered"], serde_json::Value::Bool(true), "python -u, as torchrun");
        assert!(done.stdout.contains(&format!("[rank{local}]: out of rank {local}\n")), "{}", done.stdout);
        assert!(done.stderr.contains(&format!("[rank{local}]: err of rank {local}\n")), "{}", done.stderr);
    }
    // The python on PATH (no PYTHON_EXEC, nothing next to the test's binary).
    let exe = t.seen(0, 0)["executable"].as_str().unwrap_or_default().to_owned();
    assert!(exe.contains("python"), "{exe}");
}

#[test]
fn stacked_single_node_jobs_on_free_ports() {
    // torchrun --rdzv-backend=c10d --rdzv-endpoint=localhost:0 --nnodes=1 --nproc-per-node=$NUM_TRAINERS script.py
    let t = Test::new("stacked");
    let args = |job: &'static str| {
        ["--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", "--nnodes=1", "--nproc-per-node=2", "--rdzv-id", job]
    };
    let a = t.start(&[&args("a")[..], &["-m", "pkg.check"]].concat(), &[]);
    let b = t.start(&[&args("b")[..], &["check_env.py"]].concat(), &[]);
    let (a, b) = (finish(a), finish(b));
    ok(&a);
    ok(&b);
    let coordinator =
        |d: &Done| d.stderr.split("coordinator at ").nth(1).map(|r| r.split(' ').next().unwrap_or("").to_owned());
    assert_ne!(coordinator(&a), coordinator(&b), "two instances, two coordinators");
    assert!(coordinator(&a).is_some_and(|c| c.starts_with("127.0.0.1:")), "{}", a.stderr);
}

#[test]
fn fault_tolerant_fixed_size_with_restarts() {
    // torchrun --nnodes=$NUM_NODES --nproc-per-node=$NUM_TRAINERS --max-restarts=3 --rdzv-id=$JOB_ID
    //          --rdzv-backend=c10d --rdzv-endpoint=$HOST_NODE_ADDR YOUR_TRAINING_SCRIPT.py (--arg1 ...)
    // The same command on every node, no node rank: rank 3 fails once, the job restarts.
    let t = Test::new("faulttolerant");
    let endpoint = format!("--rdzv-endpoint=127.0.0.1:{}", free_port());
    let args = [
        "--nnodes=2",
        "--nproc-per-node=2",
        "--max-restarts=3",
        "--rdzv-id=job42",
        "--rdzv-backend=c10d",
        endpoint.as_str(),
        "check_env.py",
        "--arg1",
    ];
    let nodes: Vec<Child> = (0..2).map(|_| t.start(&args, &[("FAIL_ONCE", "3")])).collect();
    let done: Vec<Done> = nodes.into_iter().map(finish).collect();
    for d in &done {
        ok(d);
        assert!(d.stderr.contains("job 'job42' attempt 1 of 4 failed (rank 3 exited with code 3)"), "{}", d.stderr);
    }
    for node in 0..2 {
        for local in 0..2 {
            assert_eq!(t.var(node, local, "RANK"), (node * 2 + local).to_string());
            assert_eq!(t.var(node, local, "WORLD_SIZE"), "4");
            assert_eq!(t.var(node, local, "GROUP_WORLD_SIZE"), "2");
            assert_eq!(t.var(node, local, "TORCHELASTIC_RUN_ID"), "job42");
            assert_eq!(t.var(node, local, "TORCHELASTIC_RESTART_COUNT"), "1", "the files of the last attempt");
            assert_eq!(t.var(node, local, "TORCHELASTIC_MAX_RESTARTS"), "3");
            assert_eq!(t.argv(node, local), ["check_env.py", "--arg1"]);
        }
    }
}

#[test]
fn elastic_membership_is_refused_saying_what_to_use() {
    // torchrun --nnodes=1:4 --nproc-per-node=$NUM_TRAINERS --max-restarts=3 --rdzv-id=$JOB_ID
    //          --rdzv-backend=c10d --rdzv-endpoint=$HOST_NODE_ADDR YOUR_TRAINING_SCRIPT.py
    let t = Test::new("elastic");
    let done = t.run(
        &[
            "--nnodes=1:4",
            "--nproc-per-node=2",
            "--max-restarts=3",
            "--rdzv-id=j",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=127.0.0.1:1",
            "check_env.py",
        ],
        &[],
    );
    assert_eq!(done.code, Some(2), "{}", done.stderr);
    assert!(done.stderr.contains("elastic membership"), "{}", done.stderr);
    assert!(done.stderr.contains("--nnodes 4") && done.stderr.contains("--max-restarts"), "{}", done.stderr);
    // MIN = MAX is a fixed size.
    let done = t.run(&["--nnodes=1:1", "--nproc_per_node=1", "check_env.py"], &[]);
    ok(&done);
}

#[test]
fn log_line_prefix_template_example() {
    // torchrun --nnodes 2 --nproc-per-node 8 --tee 3 --log-line-prefix-template "${hostname}:${rank}: " train.py
    let t = Test::new("prefix");
    let endpoint = format!("127.0.0.1:{}", free_port());
    let args = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--tee",
        "3",
        "--log-line-prefix-template",
        "${hostname}:${rank}: ",
        "--rdzv-endpoint",
        endpoint.as_str(),
        "--local-addr",
        "r12i0n8",
        "check_env.py",
    ];
    let nodes: Vec<Child> = (0..2).map(|_| t.start(&args, &[])).collect();
    let done: Vec<Done> = nodes.into_iter().map(finish).collect();
    let all: String = done.iter().map(|d| d.stdout.clone()).collect();
    for d in &done {
        ok(d);
        // No --log-dir: torchrun writes into a new temporary directory, and so does this.
        let line = d.stderr.lines().find(|l| l.contains(" succeeded (")).unwrap_or_else(|| panic!("{}", d.stderr));
        let dir = line.rsplit("their logs are in ").next().expect("a directory");
        assert!(Path::new(dir).join("rank0.stdout").exists() || Path::new(dir).join("rank2.stdout").exists());
        let _ = std::fs::remove_dir_all(Path::new(dir).parent().expect("the temporary log dir"));
    }
    for rank in 0..4 {
        assert!(all.contains(&format!("r12i0n8:{rank}: out of rank {rank}\n")), "{all}");
    }
}

#[test]
fn flags_unknown_to_rallypoint_are_refused() {
    // torchrun --numa-binding=node --nproc-per-node=8 train.py
    let t = Test::new("numa");
    let done = t.run(&["--numa-binding=node", "--nproc-per-node=8", "check_env.py"], &[]);
    assert_eq!(done.code, Some(2), "{}", done.stderr);
    assert!(done.stderr.contains("--numa-binding"), "{}", done.stderr);
    let done = t.run(&["--nproc-per-node=xpu", "check_env.py"], &[]);
    assert_eq!(done.code, Some(2), "{}", done.stderr);
}

#[test]
fn every_accepted_flag_has_its_effect_in_either_spelling() {
    let t = Test::new("flags");
    for args in [
        &["--nproc_per_node=2", "--max_restarts=1", "--rdzv_id=abc", "--role=trainer", "check_env.py"][..],
        &["--nproc-per-node", "2", "--max-restarts", "1", "--rdzv-id", "abc", "--role", "trainer", "check_env.py"],
    ] {
        t.clear();
        ok(&t.run(args, &[]));
        for local in 0..2 {
            assert_eq!(t.var(0, local, "LOCAL_WORLD_SIZE"), "2", "{args:?}");
            assert_eq!(t.var(0, local, "TORCHELASTIC_MAX_RESTARTS"), "1");
            assert_eq!(t.var(0, local, "TORCHELASTIC_RUN_ID"), "abc");
            assert_eq!(t.var(0, local, "ROLE_NAME"), "trainer");
        }
    }

    // --master_addr/--master_port (one node: exactly that address).
    t.clear();
    let port = free_port().to_string();
    ok(&t.run(&["--master_addr=127.0.0.1", &format!("--master_port={port}"), "check_env.py"], &[]));
    assert_eq!(t.var(0, 0, "MASTER_PORT"), port);
    assert_eq!(t.var(0, 0, "RALLYPOINT_COORDINATOR"), format!("127.0.0.1:{port}"));

    // -m/--module, --no-python, --run-path; PYTHON_EXEC chooses the interpreter.
    t.clear();
    ok(&t.run(&["--module", "pkg.check", "a"], &[]));
    assert!(t.argv(0, 0)[0].ends_with("pkg/check.py") && t.argv(0, 0)[1] == "a", "{:?}", t.argv(0, 0));
    t.clear();
    let python = std::fs::canonicalize(
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
            .map(|d| d.join("python3"))
            .find(|p| p.exists())
            .expect("python3 on PATH"),
    )
    .expect("python3");
    let python = python.to_str().expect("utf-8 path");
    ok(&t.run(&["--no_python", python, "check_env.py", "b"], &[]));
    assert_eq!(t.argv(0, 0), ["check_env.py", "b"]);
    t.clear();
    ok(&t.run(&["--run_path", &t.path("check_env.py")], &[("PYTHON_EXEC", python)]));
    assert_eq!(t.argv(0, 0), [t.path("check_env.py")]);
    t.clear();
    let done = t.run(&["--no-python", "-m", "pkg.check"], &[]);
    assert_eq!(done.code, Some(2), "{}", done.stderr);

    // Accepted and ignored.
    t.clear();
    ok(&t.run(
        &[
            "--rdzv_backend=etcd-v2",
            "--monitor_interval=0.5",
            "--start_method=forkserver",
            "--rdzv_conf=is_host=1",
            "check_env.py",
        ],
        &[],
    ));
    // --rdzv-conf join_timeout is the join timeout.
    let port = free_port().to_string();
    let done = t.run(
        &[
            "--nnodes=2",
            "--node_rank=0",
            &format!("--rdzv_endpoint=127.0.0.1:{port}"),
            "--rdzv_conf=join_timeout=1",
            "check_env.py",
        ],
        &[],
    );
    assert_eq!(done.code, Some(3), "{}", done.stderr);
    assert!(done.stderr.contains("gave up after 1 s (--join-timeout) waiting for node 1 of 2"), "{}", done.stderr);

    // --log_dir with -r/--redirects and -t/--tee, per local rank; --local_ranks_filter.
    t.clear();
    let logs = t.path("logs");
    let done = t.run(&["--nproc_per_node=2", &format!("--log_dir={logs}"), "-r", "0:1,1:3", "check_env.py"], &[]);
    ok(&done);
    let log = |rank: u32, stream: &str| std::fs::read_to_string(format!("{logs}/attempt1/rank{rank}.{stream}")).ok();
    assert_eq!(log(0, "stdout").as_deref(), Some("out of rank 0\n"));
    assert_eq!(log(0, "stderr"), None, "rank 0's stderr stays on the console");
    assert!(done.stderr.contains("[rank0]: err of rank 0") && !done.stdout.contains("out of rank 0"));
    assert_eq!(log(1, "stderr").as_deref(), Some("err of rank 1\n"));
    assert!(!done.stdout.contains("out of rank 1") && !done.stderr.contains("err of rank 1"), "{}", done.stderr);
    let _ = std::fs::remove_dir_all(&logs);
    let done =
        t.run(&["--nproc-per-node=2", "--log-dir", &logs, "-t", "2", "--local_ranks_filter=1", "check_env.py"], &[]);
    ok(&done);
    assert_eq!(log(0, "stderr").as_deref(), Some("err of rank 0\n"));
    assert_eq!(log(0, "stdout"), None);
    assert!(done.stdout.contains("[rank1]: out of rank 1") && done.stderr.contains("[rank1]: err of rank 1"));
    assert!(!done.stdout.contains("rank 0") && !done.stderr.contains("[rank0]"), "filtered out:\n{}", done.stderr);

    // --local_addr names this node in reports.
    let done = t.run(&["--local_addr=node-a", "--", "sh", "-c", "exit 4"], &[]);
    assert_eq!(done.code, Some(4), "{}", done.stderr);
    assert!(done.stderr.contains("node 0, host node-a"), "{}", done.stderr);

    // PET_* variables stand for flags not given, as torchrun reads them.
    t.clear();
    ok(&t.run(&["check_env.py"], &[("PET_NPROC_PER_NODE", "2"), ("PET_RDZV_ID", "pet"), ("PET_STANDALONE", "1")]));
    assert_eq!((t.var(0, 1, "LOCAL_WORLD_SIZE"), t.var(0, 1, "TORCHELASTIC_RUN_ID")), ("2".into(), "pet".into()));
}

#[test]
fn slurm_variables_place_each_launcher() {
    // Two launchers as srun would start them on two nodes (loopback here).
    let t = Test::new("slurm");
    let port = free_port().to_string();
    let slurm = |node: &'static str| {
        [
            ("SLURM_JOB_ID", "9191"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_NNODES", "2"),
            ("SLURM_JOB_NODELIST", "localhost,127.0.0.1"),
            ("SLURM_STEP_NUM_NODES", "2"),
            ("SLURM_STEP_NODELIST", "localhost,127.0.0.1"),
            ("SLURM_STEP_NUM_TASKS", "2"),
            ("SLURM_NODEID", node),
        ]
    };
    let args = ["--nproc-per-node=2", "--master-port", port.as_str(), "check_env.py"];
    let nodes = [t.start(&args, &slurm("0")), t.start(&args, &slurm("1"))];
    for d in nodes.map(finish) {
        ok(&d);
    }
    for node in 0..2 {
        for local in 0..2 {
            assert_eq!(t.var(node, local, "RANK"), (node * 2 + local).to_string());
            assert_eq!(t.var(node, local, "WORLD_SIZE"), "4");
            assert_eq!(t.var(node, local, "TORCHELASTIC_RUN_ID"), "9191", "the job is Slurm's");
            assert_eq!(t.var(node, local, "MASTER_PORT"), port);
        }
    }
    // In a batch script on the first of several nodes, one launcher alone would wait forever.
    let batch = [("SLURM_JOB_ID", "1"), ("SLURM_NNODES", "2"), ("SLURM_JOB_NODELIST", "n[1-2]")];
    let done = t.run(&["check_env.py"], &batch);
    assert_eq!(done.code, Some(2), "{}", done.stderr);
    assert!(done.stderr.contains("srun --ntasks-per-node=1 rallypoint launch"), "{}", done.stderr);
}

// Rank 1 leaves the group before it raises: torch's gloo teardown at interpreter exit
// sometimes aborts ("terminate called without an active exception", under torchrun too),
// which would turn its exit code 1 into SIGABRT. Rank 0 then waits outside gloo, so that a
// closed peer cannot make it fail before rank 1 does.
const GLOO: &str = r#"
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print("sum", t.item())
if dist.get_rank() == 1:
    dist.destroy_process_group()
    raise ValueError("bad batch on purpose")
time.sleep(120)
"#;

#[test]
fn a_gloo_job_and_torch_own_rank_prefix() {
    let Some(python) = torch_python() else {
        eprintln!("skipped: no torch venv at ~/.cache/rallypoint/venv (scripts/test makes it)");
        return;
    };
    let t = Test::new("gloo");
    std::fs::write(t.dir.join("gloo.py"), GLOO).expect("script");
    let done =
        t.run(&["--standalone", "--nproc-per-node=2", "gloo.py"], &[("PYTHON_EXEC", python.to_str().expect("utf-8"))]);
    assert_eq!(done.code, Some(1), "rank 1 raised:\n{}", done.stderr);
    assert!(done.stdout.contains("[rank0]: sum 3.0") && done.stdout.contains("[rank1]: sum 3.0"), "{}", done.stdout);
    // torch prefixes its traceback with [rank1]: itself: shown once.
    assert!(done.stderr.contains("\n[rank1]: Traceback (most recent call last):\n"), "{}", done.stderr);
    assert!(done.stderr.contains("[rank1]: ValueError: bad batch on purpose"), "{}", done.stderr);
    assert!(!done.stderr.contains("[rank1]: [rank1]:"), "{}", done.stderr);
    assert!(done.stderr.contains("rank 1 exited with code 1"), "{}", done.stderr);
}
