//! Every `rallypoint_client::Error` as a Python exception of `rallypoint._errors`, carrying
//! the facts of the Rust error as attributes so that Python code matches on them
//! instead of parsing the message (which is the Rust error's Display).
//!
//! The classes are defined in Python: `BarrierTimeout` must subclass both
//! `RallypointError` and the built-in `TimeoutError`, and exceptions built from a
//! message plus attributes pickle as they are (`spawn` sends them between processes).

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use pyo3::IntoPyObjectExt;
use rallypoint_client::{
    AbortInfo, AuthFailure, AuthRefusal, CallShape, Error, JobIncarnation, OpError, OpRef, ProcessInfo, RankInfo,
    RankState,
};

/// Python attributes of one exception, by name.
type Attrs<'py> = Vec<(&'static str, Bound<'py, PyAny>)>;

fn obj<'py>(py: Python<'py>, value: impl IntoPyObject<'py>) -> PyResult<Bound<'py, PyAny>> {
    value.into_bound_py_any(py)
}

/// `cls(message)` from `rallypoint._errors`, with `attrs` set on the instance.
fn exception(py: Python<'_>, class: &str, message: String, attrs: Attrs<'_>) -> PyResult<PyErr> {
    let class = py.import("rallypoint._errors")?.getattr(class)?;
    let instance = class.call1((message,))?;
    for (name, value) in attrs {
        instance.setattr(name, value)?;
    }
    Ok(PyErr::from_value(instance))
}

/// The Python exception for a client error. If building it fails (the package is
/// broken), that failure is what the caller sees.
pub fn to_py(py: Python<'_>, error: Error) -> PyErr {
    build(py, error).unwrap_or_else(|failure| failure)
}

/// An invalid argument the bindings catch before anything is sent (a `ValueError`).
pub fn invalid(py: Python<'_>, message: String) -> PyErr {
    to_py(py, Error::Config(message))
}

/// A `TypeError` for a value of the wrong type.
pub fn wrong_type(what: &str, value: &Bound<'_, PyAny>) -> PyErr {
    not_of("str, bytes, bytearray or memoryview", what, value)
}

/// A TypeError: `what` must be `expected`, and `value` is not ("ranks must be a
/// sequence of ints, not str").
pub fn not_of(expected: &str, what: &str, value: &Bound<'_, PyAny>) -> PyErr {
    let type_name = value.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".to_owned());
    PyTypeError::new_err(format!("{what} must be {expected}, not {type_name}"))
}

fn build(py: Python<'_>, error: Error) -> PyResult<PyErr> {
    let message = error.to_string();
    match error {
        Error::Op(op) => op_error(py, message, op),
        Error::Connect { addr, waited, .. } => exception(
            py,
            "ConnectionError",
            message,
            vec![("addr", obj(py, addr)?), ("waited", obj(py, waited.as_secs_f64())?)],
        ),
        Error::Disconnected(_) => exception(py, "ConnectionError", message, vec![]),
        Error::Timeout(waited) => {
            exception(py, "ReplyTimeout", message, vec![("waited", obj(py, waited.as_secs_f64())?)])
        }
        Error::Config(_) => exception(py, "InvalidArgument", message, vec![]),
        Error::Protocol(_) => exception(py, "RallypointError", message, vec![]),
        Error::Auth { addr, failure } => {
            let reason = match &failure {
                AuthFailure::Refused(why) => refusal(*why),
                AuthFailure::Unproven(_) => "server_unproven",
                AuthFailure::Tls(_) => "tls",
            };
            exception(py, "AuthError", message, vec![("addr", obj(py, Some(addr))?), ("reason", obj(py, reason)?)])
        }
    }
}

/// The word `AuthError.reason` holds for a coordinator's refusal.
fn refusal(why: AuthRefusal) -> &'static str {
    match why {
        AuthRefusal::TokenRequired => "token_required",
        AuthRefusal::WrongToken => "wrong_token",
        AuthRefusal::TlsRequired => "tls_required",
        AuthRefusal::NoTokenHere => "no_token_here",
    }
}

fn op_error(py: Python<'_>, message: String, error: OpError) -> PyResult<PyErr> {
    match error {
        OpError::CollectiveTimeout { op, waited_ms, members, missing, before_call_ms } => {
            let missing_ranks: Vec<u32> = missing.iter().map(|r| r.rank).collect();
            let details = missing.iter().map(|r| rank_info(py, r)).collect::<PyResult<Vec<_>>>()?;
            let mut attrs = op_attrs(py, &op)?;
            attrs.extend([
                ("waited", obj(py, secs(waited_ms))?),
                ("member_count", obj(py, members)?),
                ("missing_ranks", obj(py, missing_ranks)?),
                ("missing", obj(py, details)?),
                ("missing_count", obj(py, missing.count())?),
                ("more_ranges", obj(py, missing.rest().ranges.clone())?),
                ("late_by", obj(py, before_call_ms.map(secs))?),
            ]);
            exception(py, "BarrierTimeout", message, attrs)
        }
        OpError::KeyTimeout { waited_ms, missing } => {
            let keys: Vec<Bound<'_, PyBytes>> = missing.iter().map(|k| PyBytes::new(py, k)).collect();
            let attrs = vec![("waited", obj(py, secs(waited_ms))?), ("missing_keys", obj(py, keys)?)];
            exception(py, "KeyTimeout", message, attrs)
        }
        OpError::PeerLost { op, peer } => {
            let attrs = lost_attrs(py, &op, &peer, "peer")?;
            exception(py, "PeerLost", message, attrs)
        }
        OpError::ThisRankLost { op, this } => {
            let attrs = lost_attrs(py, &op, &this, "this")?;
            exception(py, "ThisRankLost", message, attrs)
        }
        OpError::Aborted { job, by } => {
            let AbortInfo { by_rank, host, pid, reason } = by;
            let attrs = vec![
                ("job", obj(py, job)?),
                ("by_rank", obj(py, by_rank)?),
                ("host", obj(py, host)?),
                ("pid", obj(py, pid)?),
                ("reason", obj(py, reason)?),
            ];
            exception(py, "Aborted", message, attrs)
        }
        OpError::Mismatch { op, mine, theirs } => {
            let mut attrs = op_attrs(py, &op)?;
            attrs.extend([("mine", call_shape(py, &mine)?), ("theirs", call_shape(py, &theirs)?)]);
            exception(py, "MismatchError", message, attrs)
        }
        OpError::BadMembers { kind, name, reason } => {
            // A MismatchError's attributes too, so that a handler of MismatchError reads
            // them: no other call and no generation are involved.
            let none = || obj(py, None::<u64>);
            let attrs = vec![
                ("op", obj(py, kind.to_string())?),
                ("name", obj(py, name)?),
                ("reason", obj(py, reason)?),
                ("generation", none()?),
                ("mine", none()?),
                ("theirs", none()?),
            ];
            exception(py, "BadMembers", message, attrs)
        }
        OpError::Closed(_) => exception(py, "ConnectionError", message, vec![]),
        OpError::RankHeld { rank, holder, since_unix_ms, claimant } => {
            let attrs = vec![
                ("rank", obj(py, rank)?),
                ("holder", process(py, &holder)?),
                ("since", obj(py, secs(since_unix_ms))?),
                ("claimant", process(py, &claimant)?),
            ];
            exception(py, "RankHeld", message, attrs)
        }
        OpError::TakenOver { rank, by, at_unix_ms, this } => {
            let attrs = vec![
                ("rank", obj(py, rank)?),
                ("by", process(py, &by)?),
                ("at", obj(py, secs(at_unix_ms))?),
                ("this", process(py, &this)?),
            ];
            exception(py, "RankTakenOver", message, attrs)
        }
        OpError::JobReset { job, to } => {
            let mut attrs = vec![("job", obj(py, job)?)];
            attrs.extend(job_incarnation(py, &to)?);
            exception(py, "JobReset", message, attrs)
        }
        OpError::StaleIncarnation { job, mine, current } => {
            let mut attrs = vec![("job", obj(py, job)?), ("mine", obj(py, mine)?)];
            attrs.extend(job_incarnation(py, &current)?);
            exception(py, "StaleIncarnation", message, attrs)
        }
        OpError::Unauthorized(why) => {
            let attrs = vec![("addr", obj(py, None::<String>)?), ("reason", obj(py, refusal(why))?)];
            exception(py, "AuthError", message, attrs)
        }
        OpError::NoRank { .. }
        | OpError::NotANumber { .. }
        | OpError::Overflow { .. }
        | OpError::TooLarge { .. }
        | OpError::Invalid(_) => exception(py, "InvalidArgument", message, vec![]),
    }
}

fn secs(ms: u64) -> f64 {
    // Exact for any realistic duration (below 2^53 ms).
    ms as f64 / 1000.0
}

/// Which collective, which name, which generation.
fn op_attrs<'py>(py: Python<'py>, op: &OpRef) -> PyResult<Attrs<'py>> {
    Ok(vec![
        ("op", obj(py, op.kind.to_string())?),
        ("name", obj(py, op.name.clone())?),
        ("generation", obj(py, op.generation)?),
    ])
}

/// The lost (or finished) rank `info` of a failed collective `op`, as attributes:
/// its facts flat, and whole under `whole` (`peer`, or `this` for the caller's own).
fn lost_attrs<'py>(py: Python<'py>, op: &OpRef, info: &RankInfo, whole: &'static str) -> PyResult<Attrs<'py>> {
    let mut attrs = op_attrs(py, op)?;
    let (_, reason) = state(&info.state);
    attrs.extend([
        ("rank", obj(py, info.rank)?),
        ("host", obj(py, info.host.clone())?),
        ("pid", obj(py, info.pid)?),
        ("reason", obj(py, reason)?),
        ("last_seen", obj(py, info.last_seen_ms_ago.map(secs))?),
        (whole, rank_info(py, info)?),
    ]);
    Ok(attrs)
}

/// The state as a short word, and for a lost or finished rank what became of it.
fn state(state: &RankState) -> (&'static str, Option<String>) {
    match state {
        RankState::NeverConnected => ("never_connected", None),
        RankState::Connected => ("connected", None),
        RankState::Left => ("left", None),
        RankState::Lost(reason) => ("lost", Some(reason.to_string())),
        RankState::Finished { pid } => ("finished", Some(format!("worker pid {pid} exited with code 0"))),
    }
}

fn rank_info<'py>(py: Python<'py>, info: &RankInfo) -> PyResult<Bound<'py, PyAny>> {
    let (state, reason) = state(&info.state);
    let kwargs = PyDict::new(py);
    kwargs.set_item("rank", info.rank)?;
    kwargs.set_item("host", info.host.clone())?;
    kwargs.set_item("pid", info.pid)?;
    kwargs.set_item("state", state)?;
    kwargs.set_item("reason", reason)?;
    kwargs.set_item("last_seen", info.last_seen_ms_ago.map(secs))?;
    py.import("rallypoint._errors")?.getattr("RankInfo")?.call((), Some(&kwargs))
}

/// A process as `rallypoint.ProcessInfo`: pid, host, incarnation (an int, or None).
fn process<'py>(py: Python<'py>, info: &ProcessInfo) -> PyResult<Bound<'py, PyAny>> {
    let kwargs = PyDict::new(py);
    kwargs.set_item("pid", info.pid)?;
    kwargs.set_item("host", info.host.clone())?;
    kwargs.set_item("incarnation", info.incarnation)?;
    py.import("rallypoint._errors")?.getattr("ProcessInfo")?.call((), Some(&kwargs))
}

/// The attributes of a job incarnation: which, since when, by whom, whether by a reset.
fn job_incarnation<'py>(py: Python<'py>, job: &JobIncarnation) -> PyResult<Attrs<'py>> {
    Ok(vec![
        ("incarnation", obj(py, job.incarnation)?),
        ("since", obj(py, secs(job.since_unix_ms))?),
        ("by", process(py, &job.by)?),
        ("by_reset", obj(py, job.reset)?),
    ])
}

fn call_shape<'py>(py: Python<'py>, shape: &CallShape) -> PyResult<Bound<'py, PyAny>> {
    let dict = PyDict::new(py);
    dict.set_item("rank", shape.rank)?;
    dict.set_item("members", shape.members.to_string())?;
    dict.set_item("world_size", shape.world_size)?;
    dict.set_item("root", shape.root)?;
    Ok(dict.into_any())
}
