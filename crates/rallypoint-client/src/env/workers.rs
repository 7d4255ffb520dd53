//! The environment of each worker: torchrun's variables, so torch and tools that
//! read them work unchanged, plus rallypoint's own.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::PathBuf;

use rallypoint_net::auth::{TOKEN_FILE_VAR, TOKEN_VAR};

use rallypoint_core::Incarnation;

/// Where one worker sits in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub rank: u32,
    pub local_rank: u32,
    pub world_size: u32,
    pub local_world_size: u32,
    pub node_rank: u32,
    pub nnodes: u32,
}

/// What every worker of one attempt shares.
#[derive(Debug, Clone)]
pub struct JobEnv {
    /// MASTER_ADDR/MASTER_PORT always (torch's TCPStore must reach the coordinator
    /// itself), and RALLYPOINT_ADDR unless the node has a node agent.
    pub coordinator: SocketAddr,
    /// This node's node agent (`unix:PATH` or `IP:PORT`): RALLYPOINT_ADDR, so the
    /// workers' native connections go through it.
    pub node_agent: Option<String>,
    /// The user's job name (TORCHELASTIC_RUN_ID).
    pub run_id: String,
    /// The workers' role (ROLE_NAME; torchrun's `--role`, "default" unless given).
    pub role: String,
    /// The coordinator job of this attempt (RALLYPOINT_JOB): new at each restart, so no
    /// key or barrier generation of a failed attempt leaks into the next.
    pub attempt_job: String,
    pub restart_count: u32,
    pub max_restarts: u32,
    /// The job incarnation of this attempt (RALLYPOINT_JOB_INCARNATION): the workers of
    /// an earlier attempt, should one still run, are refused by name.
    pub job_incarnation: Option<u64>,
    /// The job's token, in a file only this user can read: RALLYPOINT_TOKEN_FILE.
    /// `None`: a job without authentication (`launch --insecure`).
    pub token_file: Option<PathBuf>,
}

pub fn worker_env(job: &JobEnv, p: &Placement, inherited_omp: bool) -> Vec<(&'static str, OsString)> {
    let s = |v: &dyn ToString| OsString::from(v.to_string());
    let mut env = vec![
        ("RANK", s(&p.rank)),
        ("LOCAL_RANK", s(&p.local_rank)),
        ("WORLD_SIZE", s(&p.world_size)),
        ("LOCAL_WORLD_SIZE", s(&p.local_world_size)),
        ("GROUP_RANK", s(&p.node_rank)),
        ("GROUP_WORLD_SIZE", s(&p.nnodes)),
        ("ROLE_RANK", s(&p.rank)),
        ("ROLE_NAME", s(&job.role)),
        ("ROLE_WORLD_SIZE", s(&p.world_size)),
        ("MASTER_ADDR", s(&job.coordinator.ip())),
        ("MASTER_PORT", s(&job.coordinator.port())),
        ("TORCHELASTIC_RUN_ID", s(&job.run_id)),
        ("TORCHELASTIC_RESTART_COUNT", s(&job.restart_count)),
        ("TORCHELASTIC_MAX_RESTARTS", s(&job.max_restarts)),
        ("TORCHELASTIC_USE_AGENT_STORE", s(&"True")),
        ("RALLYPOINT_ADDR", job.node_agent.as_ref().map_or_else(|| s(&job.coordinator), OsString::from)),
        ("RALLYPOINT_JOB", s(&job.attempt_job)),
        // The file, never the token itself: environments get copied into logs and
        // reports. A token from the launcher's own environment is not passed on.
        (TOKEN_FILE_VAR, job.token_file.as_ref().map_or_else(OsString::new, |path| path.clone().into_os_string())),
        (TOKEN_VAR, OsString::new()),
        // The coordinator itself, also where RALLYPOINT_ADDR is a node agent:
        // `rallypoint status --addr $RALLYPOINT_COORDINATOR` from a worker's shell.
        ("RALLYPOINT_COORDINATOR", s(&job.coordinator)),
    ];
    if let Some(incarnation) = job.job_incarnation {
        env.push(("RALLYPOINT_JOB_INCARNATION", s(&Incarnation(incarnation))));
    }
    // As torchrun does: many workers each spawning a thread per core oversubscribe the node.
    if !inherited_omp && p.local_world_size > 1 {
        env.push(("OMP_NUM_THREADS", s(&1)));
    }
    env
}

/// What makes workers' output live although it goes to a pipe: Python buffers
/// stdout that is not a terminal, so without `PYTHONUNBUFFERED` a script's prints
/// would show only at its end, or never if it is killed. A user's own setting
/// (`user_set`) is kept.
pub fn live_output_env(user_set: bool) -> Vec<(&'static str, OsString)> {
    if user_set {
        Vec::new()
    } else {
        vec![("PYTHONUNBUFFERED", OsString::from("1"))]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torchrun_compatible_variables() {
        let job = JobEnv {
            coordinator: "127.0.0.1:29500".parse().expect("literal address"),
            node_agent: None,
            run_id: "train".into(),
            role: "trainer".into(),
            attempt_job: "train.restart1".into(),
            restart_count: 1,
            max_restarts: 3,
            job_incarnation: Some(0xbbb),
            token_file: Some("/tmp/rp/token".into()),
        };
        let p = Placement { rank: 5, local_rank: 1, world_size: 8, local_world_size: 4, node_rank: 1, nnodes: 2 };
        let env: std::collections::HashMap<_, _> = worker_env(&job, &p, false).into_iter().collect();
        let get = |k: &str| env.get(k).and_then(|v| v.to_str()).unwrap_or("<unset>");
        assert_eq!(get("RANK"), "5");
        assert_eq!(get("LOCAL_RANK"), "1");
        assert_eq!(get("GROUP_RANK"), "1");
        assert_eq!(get("MASTER_ADDR"), "127.0.0.1");
        assert_eq!(get("MASTER_PORT"), "29500");
        assert_eq!(get("RALLYPOINT_ADDR"), "127.0.0.1:29500");
        assert_eq!(get("RALLYPOINT_JOB"), "train.restart1");
        assert_eq!(get("TORCHELASTIC_RUN_ID"), "train");
        assert_eq!(get("ROLE_NAME"), "trainer");
        assert_eq!(get("TORCHELASTIC_USE_AGENT_STORE"), "True");
        assert_eq!(get("RALLYPOINT_JOB_INCARNATION"), "0000000000000bbb");
        assert_eq!(get("OMP_NUM_THREADS"), "1");
        assert_eq!(get("RALLYPOINT_TOKEN_FILE"), "/tmp/rp/token");
        assert_eq!(get("RALLYPOINT_TOKEN"), "", "the token itself stays out of the environment");
        let env = worker_env(&job, &p, true);
        assert!(env.iter().all(|(k, _)| *k != "OMP_NUM_THREADS"), "a user's OMP_NUM_THREADS is kept");

        // Behind a node agent only the native protocol's address moves.
        let job = JobEnv { node_agent: Some("unix:/tmp/rp/agent.sock".into()), ..job };
        let env: std::collections::HashMap<_, _> = worker_env(&job, &p, false).into_iter().collect();
        let get = |k: &str| env.get(k).and_then(|v| v.to_str()).unwrap_or("<unset>");
        assert_eq!(get("RALLYPOINT_ADDR"), "unix:/tmp/rp/agent.sock");
        assert_eq!(get("RALLYPOINT_COORDINATOR"), "127.0.0.1:29500");
        assert_eq!(get("MASTER_ADDR"), "127.0.0.1");
        assert_eq!(get("MASTER_PORT"), "29500");
    }

    #[test]
    fn python_output_is_unbuffered_unless_the_user_said_otherwise() {
        assert_eq!(live_output_env(false), [("PYTHONUNBUFFERED", OsString::from("1"))]);
        assert!(live_output_env(true).is_empty());
    }
}
