//! `Jobs`: which jobs a coordinator holds, so that a tool can list them and tell a
//! job name nobody uses from a job that is only quiet.

mod common;

use common::{b, ok, Harness};
use rallypoint_core::{Identity, Request, Response, MAX_JOBS_LISTED};

fn jobs(h: &mut Harness, asking_as: &str) -> Vec<String> {
    let tool = h.open(Identity::anonymous(asking_as));
    let Response::Values(names) = ok(Some(h.call(tool, Request::Jobs))) else { panic!("jobs are values") };
    h.leave(tool);
    names.iter().map(|n| String::from_utf8_lossy(n).into_owned()).collect()
}

#[test]
fn jobs_are_listed_in_order_and_asking_creates_none() {
    let mut h = Harness::new();
    assert!(jobs(&mut h, "nobody").is_empty(), "the asking session's empty job is not a job");
    h.rank("train", 0, 2);
    h.rank("train/launch", 0, 1);
    let tool = h.open(Identity::anonymous("kv-only"));
    ok(Some(h.call(tool, Request::Set { key: b("k"), value: b("v") })));
    h.leave(tool);
    assert_eq!(jobs(&mut h, "other"), ["kv-only", "train", "train/launch"]);
    // Asking from inside a job that has more than the asking session lists it.
    assert_eq!(jobs(&mut h, "train"), ["kv-only", "train", "train/launch"]);
}

#[test]
fn the_list_is_capped() {
    let mut h = Harness::new();
    for i in 0..MAX_JOBS_LISTED + 5 {
        h.rank(&format!("job{i:05}"), 0, 1);
    }
    let names = jobs(&mut h, "x");
    assert_eq!(names.len(), MAX_JOBS_LISTED);
    assert_eq!(names[0], "job00000");
}

#[test]
fn a_job_aborted_with_nothing_else_in_it_is_held() {
    let mut h = Harness::new();
    let tool = h.open(Identity::anonymous("stopped"));
    ok(Some(h.call(tool, Request::Abort { reason: "disk full".into() })));
    h.leave(tool);
    // A launcher names its job's incarnation before any worker runs: that alone is not
    // held (`status` tells a launched job nobody joined yet by its absence).
    let tool = h.open(Identity::anonymous("fresh"));
    ok(Some(h.call(tool, Request::Reset { incarnation: 7 })));
    h.leave(tool);
    // A later call of the aborted job fails for the abort: `status` must find it.
    assert_eq!(jobs(&mut h, "other"), ["stopped"]);
}
