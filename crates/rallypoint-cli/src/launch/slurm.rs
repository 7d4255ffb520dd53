//! `rallypoint launch` under Slurm: one launcher per node (`srun --ntasks-per-node=1
//! rallypoint launch ...`) takes the number of nodes, its node rank and the host of
//! node 0 from Slurm's variables, for what its flags do not say. Inside an `srun`
//! step the step's own variables count (a step may use part of the allocation);
//! in a batch script, the job's.

use rallypoint_client::env::expand_nodelist;

/// What Slurm says about this launcher's place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slurm {
    pub job_id: String,
    pub nnodes: u32,
    /// This node's index among them.
    pub node_id: u32,
    /// The first host of the node list: node 0, where the coordinator runs.
    pub first_host: String,
}

/// Slurm's view, if this process runs under Slurm (`SLURM_JOB_ID` set); an error
/// names the variable that is missing or wrong, or a layout that cannot work.
pub fn from_env(var: &dyn Fn(&str) -> Option<String>) -> Result<Option<Slurm>, String> {
    let Some(job_id) = var("SLURM_JOB_ID") else { return Ok(None) };
    let in_step = var("SLURM_STEP_ID").is_some();
    let first = |names: &[&'static str]| names.iter().find_map(|n| var(n).map(|v| (*n, v)));
    let number = |names: &[&'static str]| -> Result<Option<u32>, String> {
        match first(names) {
            None => Ok(None),
            Some((name, value)) => {
                value.trim().parse().map(Some).map_err(|_| format!("{name}='{value}' is not a number"))
            }
        }
    };
    let nodes_vars: &[&str] =
        if in_step { &["SLURM_STEP_NUM_NODES", "SLURM_NNODES"] } else { &["SLURM_NNODES", "SLURM_JOB_NUM_NODES"] };
    let list_vars: &[&str] = if in_step {
        &["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"]
    } else {
        &["SLURM_JOB_NODELIST", "SLURM_NODELIST"]
    };
    let Some(nnodes) = number(nodes_vars)? else {
        return Err(format!("under Slurm (SLURM_JOB_ID={job_id}) but {} is not set", nodes_vars[0]));
    };
    let node_id = number(&["SLURM_NODEID"])?.unwrap_or(0);
    let Some((list_var, list)) = first(list_vars) else {
        return Err(format!("under Slurm (SLURM_JOB_ID={job_id}) but {} is not set", list_vars[0]));
    };
    let hosts = expand_nodelist(&list).map_err(|e| format!("{list_var}: {e}"))?;
    if hosts.len() != nnodes as usize {
        return Err(format!("{list_var}='{list}' names {} hosts but Slurm says {nnodes} nodes", hosts.len()));
    }
    if node_id >= nnodes {
        return Err(format!("SLURM_NODEID={node_id} is not below the {nnodes} nodes of the job"));
    }
    if in_step {
        if let Some(tasks) = number(&["SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"])?.filter(|&t| t != nnodes) {
            return Err(format!(
                "srun started {tasks} tasks on {nnodes} nodes: run one launcher per node \
                 (srun --ntasks-per-node=1 rallypoint launch ...); it starts the workers"
            ));
        }
    } else if nnodes > 1 {
        return Err(format!(
            "this is Slurm's batch script, on the first of {nnodes} nodes: start one launcher on every node with \
             srun --ntasks-per-node=1 rallypoint launch ..., or give --nnodes 1 to run on this node only"
        ));
    }
    Ok(Some(Slurm { job_id, nnodes, node_id, first_host: hosts[0].clone() }))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn slurm(vars: &[(&str, &str)]) -> Result<Option<Slurm>, String> {
        let vars: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        from_env(&|name| vars.get(name).cloned())
    }

    #[test]
    fn an_srun_step_gives_nodes_rank_and_the_first_host() {
        let step = [
            ("SLURM_JOB_ID", "4242"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_NNODES", "8"),
            ("SLURM_JOB_NODELIST", "gpu[01-08]"),
            ("SLURM_STEP_NUM_NODES", "3"),
            ("SLURM_STEP_NODELIST", "gpu[03-04],gpu07"),
            ("SLURM_STEP_NUM_TASKS", "3"),
            ("SLURM_NODEID", "2"),
        ];
        let s = slurm(&step).unwrap().unwrap();
        assert_eq!(s, Slurm { job_id: "4242".into(), nnodes: 3, node_id: 2, first_host: "gpu03".into() });
        assert_eq!(slurm(&[]), Ok(None));
    }

    #[test]
    fn layouts_that_cannot_work_are_refused() {
        let mut step = vec![
            ("SLURM_JOB_ID", "1"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_STEP_NUM_NODES", "2"),
            ("SLURM_STEP_NODELIST", "n[1-2]"),
            ("SLURM_STEP_NUM_TASKS", "8"),
            ("SLURM_NODEID", "0"),
        ];
        assert!(slurm(&step).unwrap_err().contains("srun --ntasks-per-node=1"));
        step[4] = ("SLURM_STEP_NUM_TASKS", "2");
        step[3] = ("SLURM_STEP_NODELIST", "n[1-3]");
        assert!(slurm(&step).unwrap_err().contains("names 3 hosts but Slurm says 2 nodes"));
        step[3] = ("SLURM_STEP_NODELIST", "n[1-");
        assert!(slurm(&step).unwrap_err().starts_with("SLURM_STEP_NODELIST: bad Slurm host list"));
        let batch = [("SLURM_JOB_ID", "1"), ("SLURM_NNODES", "4"), ("SLURM_JOB_NODELIST", "n[1-4]")];
        assert!(slurm(&batch).unwrap_err().contains("batch script"));
        let single = [("SLURM_JOB_ID", "1"), ("SLURM_NNODES", "1"), ("SLURM_JOB_NODELIST", "n1")];
        assert_eq!(slurm(&single).unwrap().unwrap().first_host, "n1");
        assert!(slurm(&[("SLURM_JOB_ID", "1"), ("SLURM_NNODES", "x")]).unwrap_err().contains("SLURM_NNODES='x'"));
    }
}
