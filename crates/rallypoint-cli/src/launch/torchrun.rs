//! torchrun's flag values, read with torchrun's meaning (torch/distributed/run.py):
//! worker counts (`gpu`, `cpu`, `auto`), node counts (`MIN:MAX`), rendezvous
//! endpoints and configuration, and the command a script path stands for.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// `--nproc-per-node`: a number, or what to count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Nproc {
    Count(u32),
    /// One worker per visible NVIDIA GPU.
    Gpu,
    /// One worker per CPU this process may run on (its affinity, as torch counts).
    Cpu,
    /// `Gpu` if there is one, else `Cpu`.
    Auto,
}

pub fn nproc(text: &str) -> Result<Nproc, String> {
    match text.trim() {
        "gpu" => Ok(Nproc::Gpu),
        "cpu" => Ok(Nproc::Cpu),
        "auto" => Ok(Nproc::Auto),
        "xpu" => Err("'xpu': Intel GPUs are not counted by rallypoint; give a number of workers".into()),
        n => match n.parse::<u32>() {
            Ok(0) => Err("at least 1 worker per node".into()),
            Ok(n) => Ok(Nproc::Count(n)),
            Err(_) => Err(format!("'{text}' is not a number of workers, gpu, cpu or auto")),
        },
    }
}

/// Where NVIDIA's driver lists the GPUs of this machine, one directory each.
pub const NVIDIA_GPUS: &str = "/proc/driver/nvidia/gpus";

impl Nproc {
    /// The number of workers; `gpus` is where the GPUs are listed, `visible` the value
    /// of `CUDA_VISIBLE_DEVICES`.
    pub fn resolve(self, gpus: &Path, visible: Option<&str>) -> Result<u32, String> {
        match self {
            Nproc::Count(n) => Ok(n),
            Nproc::Cpu => Ok(cpu_count()),
            Nproc::Gpu => match gpu_count(gpus, visible) {
                Ok(0) | Err(_) if visible.is_some_and(|v| v.trim().is_empty()) => {
                    Err("--nproc-per-node gpu: CUDA_VISIBLE_DEVICES is empty, so no GPU is visible".into())
                }
                Ok(0) => Err(format!(
                    "--nproc-per-node gpu: CUDA_VISIBLE_DEVICES={} names no GPU of this machine",
                    visible.unwrap_or_default()
                )),
                Ok(n) => Ok(n),
                Err(why) => Err(format!("--nproc-per-node gpu: no NVIDIA GPU is visible ({why}); give a number")),
            },
            Nproc::Auto => match gpu_count(gpus, visible) {
                Ok(n) if n > 0 => Ok(n),
                _ => Ok(cpu_count()),
            },
        }
    }
}

/// GPUs the driver lists, narrowed to those `CUDA_VISIBLE_DEVICES` names: CUDA reads
/// its entries (indices, or `GPU-`/`MIG-` UUIDs) up to the first invalid one.
pub fn gpu_count(gpus: &Path, visible: Option<&str>) -> Result<u32, String> {
    let physical = match std::fs::read_dir(gpus) {
        Ok(entries) => u32::try_from(entries.flatten().count()).unwrap_or(u32::MAX),
        Err(_) => return Err(format!("no {}: no NVIDIA driver is loaded", gpus.display())),
    };
    let Some(visible) = visible else { return Ok(physical) };
    let mut count = 0;
    for entry in visible.split(',') {
        let entry = entry.trim();
        let valid = match entry.parse::<u32>() {
            Ok(index) => index < physical,
            Err(_) => entry.starts_with("GPU-") || entry.starts_with("MIG-"),
        };
        if !valid {
            break;
        }
        count += 1;
    }
    Ok(count.min(physical))
}

/// CPUs this process may run on (`sched_getaffinity`), as torch's `cpu_count`.
fn cpu_count() -> u32 {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; sched_getaffinity fills it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0 {
            let n = libc::CPU_COUNT(&set);
            if n > 0 {
                return u32::try_from(n).unwrap_or(u32::MAX);
            }
        }
    }
    std::thread::available_parallelism().map_or(1, |n| u32::try_from(n.get()).unwrap_or(u32::MAX))
}

/// `--nnodes`: N, or torchrun's MIN:MAX, accepted only as a fixed size.
pub fn nnodes(text: &str) -> Result<u32, String> {
    let count = |part: &str| match part.trim().parse::<u32>() {
        Ok(0) | Err(_) => Err(format!("'{text}' is not a number of nodes (N, or MIN:MAX with MIN = MAX)")),
        Ok(n) => Ok(n),
    };
    match text.split_once(':') {
        None => count(text),
        Some((min, max)) => {
            let (min, max) = (count(min)?, count(max)?);
            if min == max {
                Ok(min)
            } else {
                Err(format!(
                    "'{text}' asks for elastic membership (between {min} and {max} nodes, admitted as they come and \
                     go), which rallypoint does not support: give a fixed number, --nnodes {max}, and \
                     --max-restarts N to survive failures (the whole job restarts on the same nodes)"
                ))
            }
        }
    }
}

/// torchrun's default port of a `--rdzv-endpoint` without one.
pub const RDZV_PORT: u16 = 29400;
/// torchrun's default `--master-port`.
pub const MASTER_PORT: u16 = 29500;

/// `--rdzv-endpoint HOST[:PORT]` as HOST:PORT (port 29400 when absent, as torchrun).
pub fn endpoint(text: &str) -> Result<String, String> {
    let text = text.trim();
    if text.is_empty() {
        return Err("an empty endpoint: give HOST[:PORT]".into());
    }
    // [v6]:port, [v6], host:port, host, or a bare IPv6 address.
    let (host, port) = if let Some(rest) = text.strip_prefix('[') {
        let (host, after) = rest.split_once(']').ok_or_else(|| format!("'{text}': unclosed '['"))?;
        (format!("[{host}]"), after.strip_prefix(':'))
    } else if text.matches(':').count() > 1 {
        (format!("[{text}]"), None)
    } else {
        match text.split_once(':') {
            Some((host, port)) => (host.to_owned(), Some(port)),
            None => (text.to_owned(), None),
        }
    };
    let port = match port {
        None => RDZV_PORT,
        Some(port) => port.parse().map_err(|_| format!("'{port}' in '{text}' is not a port"))?,
    };
    Ok(format!("{host}:{port}"))
}

/// `HOST` and `PORT` as HOST:PORT, bracketing an IPv6 address.
pub fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// `--rdzv-conf key=value,...`: only `join_timeout` has a meaning here (seconds to
/// wait for every node); the rest configure torchrun's own rendezvous and are
/// ignored. Returns the join timeout, if given.
pub fn rdzv_conf(text: &str) -> Result<Option<f64>, String> {
    let mut join_timeout = None;
    for entry in text.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let (key, value) = entry.split_once('=').ok_or_else(|| format!("--rdzv-conf: '{entry}' is not key=value"))?;
        if key.trim() == "join_timeout" {
            let secs = crate::parse::secs(value).map_err(|e| format!("--rdzv-conf join_timeout: {e}"))?;
            join_timeout = Some(secs);
        }
    }
    Ok(join_timeout)
}

/// What the worker command is, given the program words and how they were written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Program {
    /// Written after `--`: rallypoint's own form, a command run as it is.
    pub after_dashes: bool,
    pub words: Vec<OsString>,
    /// `-m`: the first word is a Python module.
    pub module: bool,
    /// `--no-python`: the first word is the program.
    pub no_python: bool,
    /// `--run-path`: the first word is a Python script (torchrun runs it with runpy).
    pub run_path: bool,
}

impl Program {
    /// The command to run: `python -u SCRIPT ARGS` for a script path (torchrun's
    /// way), `python -u -m MODULE ARGS` with `-m`, the words as they are after `--`
    /// or with `--no-python`. `python` is found by `python`.
    pub fn command(&self, python: impl FnOnce() -> Result<OsString, String>) -> Result<Vec<OsString>, String> {
        if self.module && self.no_python && !self.run_path {
            return Err("don't use both --no-python and -m/--module: a module runs in python".into());
        }
        let in_python = self.module || self.run_path || !(self.after_dashes || self.no_python);
        if !in_python {
            return Ok(self.words.clone());
        }
        let mut command = vec![python()?, OsString::from("-u")];
        if self.module && !self.run_path {
            command.push(OsString::from("-m"));
        }
        command.extend(self.words.iter().cloned());
        Ok(command)
    }
}

/// The python torchrun would use: `PYTHON_EXEC` if set (torchrun's override), else
/// the interpreter of the environment this command is installed in (the `python3`
/// next to it, as in a venv's `bin/`: torchrun uses its own interpreter), else
/// `python3`, then `python`, on PATH.
pub fn python(
    exec_override: Option<OsString>,
    exe: Option<PathBuf>,
    path: Option<OsString>,
) -> Result<OsString, String> {
    if let Some(python) = exec_override.filter(|p| !p.is_empty()) {
        return Ok(python);
    }
    let executable = |p: &Path| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if let Some(dir) = exe.as_deref().and_then(Path::parent) {
        for name in ["python3", "python"] {
            let candidate = dir.join(name);
            if executable(&candidate) {
                return Ok(candidate.into_os_string());
            }
        }
    }
    for name in ["python3", "python"] {
        for dir in std::env::split_paths(path.as_deref().unwrap_or_default()) {
            if executable(&dir.join(name)) {
                return Ok(OsString::from(name));
            }
        }
    }
    Err("no python found (no PYTHON_EXEC, no python3 or python on PATH): set PYTHON_EXEC, or run a program with \
         --no-python or after --"
        .into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_counts() {
        assert_eq!(nproc("4"), Ok(Nproc::Count(4)));
        assert_eq!(nproc("gpu"), Ok(Nproc::Gpu));
        assert!(nproc("0").is_err());
        assert!(nproc("xpu").unwrap_err().contains("give a number"));
        assert!(nproc("many").unwrap_err().contains("'many'"));
        assert!(Nproc::Cpu.resolve(Path::new("/nonexistent"), None).unwrap() >= 1);
    }

    #[test]
    fn gpus_are_counted_from_the_driver_and_cuda_visible_devices() {
        let dir = std::env::temp_dir().join(format!("rp-gpus-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for bus in ["0000:01:00.0", "0000:02:00.0", "0000:03:00.0"] {
            std::fs::create_dir_all(dir.join(bus)).expect("fake gpu");
        }
        assert_eq!(gpu_count(&dir, None), Ok(3));
        assert_eq!(gpu_count(&dir, Some("0,2")), Ok(2));
        assert_eq!(gpu_count(&dir, Some("1,7,0")), Ok(1), "CUDA stops at the first invalid index");
        assert_eq!(gpu_count(&dir, Some("GPU-8d9a,GPU-77")), Ok(2));
        assert_eq!(gpu_count(&dir, Some("-1")), Ok(0));
        assert_eq!(Nproc::Gpu.resolve(&dir, Some("0")), Ok(1));
        assert!(Nproc::Gpu.resolve(&dir, Some("")).unwrap_err().contains("CUDA_VISIBLE_DEVICES is empty"));
        assert!(Nproc::Gpu.resolve(&dir, Some("-1")).unwrap_err().contains("names no GPU"));
        let none = dir.join("absent");
        let e = Nproc::Gpu.resolve(&none, None).unwrap_err();
        assert!(e.contains("no NVIDIA GPU is visible") && e.contains("no NVIDIA driver"), "{e}");
        assert!(Nproc::Auto.resolve(&none, None).unwrap() >= 1, "auto falls back to the CPUs");
        assert_eq!(Nproc::Auto.resolve(&dir, None), Ok(3));
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn node_counts() {
        assert_eq!(nnodes("2"), Ok(2));
        assert_eq!(nnodes("4:4"), Ok(4));
        let e = nnodes("1:4").unwrap_err();
        assert!(e.contains("elastic membership") && e.contains("--nnodes 4") && e.contains("--max-restarts"), "{e}");
        assert!(nnodes("0").is_err() && nnodes("a:b").is_err() && nnodes("1:2:3").is_err());
    }

    #[test]
    fn endpoints() {
        assert_eq!(endpoint("node1.example.com:29400").as_deref(), Ok("node1.example.com:29400"));
        assert_eq!(endpoint("node1").as_deref(), Ok("node1:29400"));
        assert_eq!(endpoint("localhost:0").as_deref(), Ok("localhost:0"));
        assert_eq!(endpoint("[::1]:5").as_deref(), Ok("[::1]:5"));
        assert_eq!(endpoint("[::1]").as_deref(), Ok("[::1]:29400"));
        assert_eq!(endpoint("fe80::1").as_deref(), Ok("[fe80::1]:29400"));
        assert!(endpoint("h:port").is_err() && endpoint("").is_err());
        assert_eq!(host_port("::1", 7), "[::1]:7");
    }

    #[test]
    fn rendezvous_configuration() {
        assert_eq!(rdzv_conf("join_timeout=600,close_timeout=10"), Ok(Some(600.0)));
        assert_eq!(rdzv_conf("is_host=False"), Ok(None));
        assert_eq!(rdzv_conf(""), Ok(None));
        assert!(rdzv_conf("join_timeout").is_err());
        assert!(rdzv_conf("join_timeout=soon").is_err());
    }

    #[test]
    fn commands() {
        let program = |after_dashes, words: &[&str]| Program {
            after_dashes,
            words: words.iter().map(OsString::from).collect(),
            module: false,
            no_python: false,
            run_path: false,
        };
        let py = || Ok(OsString::from("/venv/bin/python3"));
        let words = |c: Vec<OsString>| c.into_iter().map(|w| w.into_string().unwrap()).collect::<Vec<_>>();
        assert_eq!(
            words(program(false, &["train.py", "--lr", "3"]).command(py).unwrap()),
            ["/venv/bin/python3", "-u", "train.py", "--lr", "3"]
        );
        assert_eq!(words(program(true, &["./worker", "x"]).command(py).unwrap()), ["./worker", "x"]);
        let module = Program { module: true, ..program(false, &["pkg.train", "-x"]) };
        assert_eq!(words(module.command(py).unwrap()), ["/venv/bin/python3", "-u", "-m", "pkg.train", "-x"]);
        let module_after_dashes = Program { module: true, ..program(true, &["pkg.train"]) };
        assert_eq!(words(module_after_dashes.command(py).unwrap()), ["/venv/bin/python3", "-u", "-m", "pkg.train"]);
        let no_python = Program { no_python: true, ..program(false, &["./run.sh"]) };
        assert_eq!(words(no_python.command(py).unwrap()), ["./run.sh"]);
        let both = Program { no_python: true, module: true, ..program(false, &["m"]) };
        assert!(both.command(py).unwrap_err().contains("--no-python"));
        // torchrun: --run-path wins over --no-python.
        let run_path = Program { run_path: true, no_python: true, ..program(false, &["/abs/train.py"]) };
        assert_eq!(words(run_path.command(py).unwrap()), ["/venv/bin/python3", "-u", "/abs/train.py"]);
    }

    #[test]
    fn which_python() {
        let dir = std::env::temp_dir().join(format!("rp-python-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let bin = dir.join("venv/bin");
        std::fs::create_dir_all(&bin).expect("bin");
        let fake = |p: &Path| {
            use std::os::unix::fs::PermissionsExt;
            std::fs::write(p, "#!/bin/sh\n").expect("write");
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        };
        let exe = bin.join("rallypoint");
        fake(&exe);
        let path = Some(OsString::from("/nonexistent"));
        assert_eq!(python(Some("/opt/py".into()), Some(exe.clone()), path.clone()), Ok(OsString::from("/opt/py")));
        assert!(python(None, Some(exe.clone()), path.clone()).unwrap_err().contains("PYTHON_EXEC"));
        fake(&bin.join("python3"));
        assert_eq!(python(None, Some(exe.clone()), path.clone()), Ok(bin.join("python3").into_os_string()));
        let elsewhere = dir.join("elsewhere");
        std::fs::create_dir_all(&elsewhere).expect("dir");
        fake(&elsewhere.join("python"));
        assert_eq!(python(None, None, Some(elsewhere.into_os_string())), Ok(OsString::from("python")));
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}

/// torchrun's flags that `rallypoint launch` refuses, because each would change what
/// the job does; taken (hidden) so that each is refused by name and why, rather than
/// as an unknown argument the parser would suggest passing to the program.
#[derive(clap::Args, Debug, Default)]
pub struct Refused {
    #[arg(long, alias = "virtual_local_rank", hide = true)]
    virtual_local_rank: bool,
    #[arg(long, alias = "numa_binding", hide = true, value_name = "V")]
    numa_binding: Option<String>,
    #[arg(long, alias = "signals_to_handle", hide = true, value_name = "V")]
    signals_to_handle: Option<String>,
    #[arg(long, alias = "logs_specs", hide = true, value_name = "V")]
    logs_specs: Option<String>,
    #[arg(long, alias = "event_log_handler", hide = true, value_name = "V")]
    event_log_handler: Option<String>,
    #[arg(long, alias = "duplicate_stdout_filters", hide = true, value_name = "V")]
    duplicate_stdout_filters: Option<String>,
    #[arg(long, alias = "duplicate_stderr_filters", hide = true, value_name = "V")]
    duplicate_stderr_filters: Option<String>,
}

impl Refused {
    /// The first refused flag given, and why it is refused.
    pub fn check(&self) -> Result<(), String> {
        let why = if self.virtual_local_rank {
            Some((
                "--virtual-local-rank",
                "every worker would see LOCAL_RANK 0 and one GPU; here LOCAL_RANK counts the node's workers",
            ))
        } else if self.numa_binding.is_some() {
            Some(("--numa-binding", "workers are not bound to NUMA nodes; run the program under numactl for that"))
        } else if self.signals_to_handle.is_some() {
            Some(("--signals-to-handle", "SIGINT, SIGTERM and SIGHUP are forwarded to the workers, and no other set"))
        } else if self.logs_specs.is_some() || self.event_log_handler.is_some() {
            let flag = if self.logs_specs.is_some() { "--logs-specs" } else { "--event-log-handler" };
            Some((flag, "torchrun's logging plug-ins have no counterpart; --log-dir, --redirects and --tee choose where output goes"))
        } else if self.duplicate_stdout_filters.is_some() || self.duplicate_stderr_filters.is_some() {
            let flag = if self.duplicate_stdout_filters.is_some() {
                "--duplicate-stdout-filters"
            } else {
                "--duplicate-stderr-filters"
            };
            Some((flag, "output is not filtered; --tee with --log-dir keeps it on the console and in files"))
        } else {
            None
        };
        match why {
            Some((flag, why)) => Err(format!("{flag} is torchrun's and not accepted by rallypoint launch: {why}")),
            None => Ok(()),
        }
    }
}
