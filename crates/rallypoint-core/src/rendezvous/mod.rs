//! torchrun's c10d rendezvous, as its store shows it: torch's
//! `C10dRendezvousBackend` keeps each run's `_RendezvousState` at
//! `torch.rendezvous.<run id>`, pickled and base64-encoded (an empty round holds a
//! sentinel). This decodes what it can of that state (round, whether it is complete
//! or closed, the deadline, the participants with their node ranks, the wait and
//! redundancy lists, and every node's last heartbeat) with a reader that never runs
//! what a pickle names ([`pickle`]); anything else is reported as undecodable, with
//! the reason.

mod pickle;

use base64::Engine as _;

use crate::snapshot::{RendezvousNode, RendezvousState, RendezvousView};

use pickle::{Id, Pickle, Value};

/// The prefix of a rendezvous state's key; the run id follows.
const KEY_PREFIX: &[u8] = b"torch.rendezvous.";

/// Whether `key` holds a rendezvous state: `torch.rendezvous.<run id>`, with the
/// `/` torch's TCPStore client puts before every key (or several, through prefix
/// stores of an empty prefix).
pub(crate) fn is_state_key(key: &[u8]) -> bool {
    unslashed(key).strip_prefix(KEY_PREFIX).is_some_and(|run_id| !run_id.is_empty())
}

fn unslashed(key: &[u8]) -> &[u8] {
    let start = key.iter().position(|&b| b != b'/').unwrap_or(key.len());
    &key[start..]
}

/// What torch stores before any state ("canimadam", base64-encoded).
const NULL_SENTINEL: &[u8] = b"Y2FuaW1hZGFt";

/// Longest value decoded: a state of thousands of nodes is well below it.
const MAX_STATE_LEN: usize = 4 << 20;

/// The rendezvous at `key` (see [`is_state_key`]) whose value is `value`.
pub(crate) fn view(key: &[u8], value: &[u8]) -> RendezvousView {
    let run_id = unslashed(key).strip_prefix(KEY_PREFIX).unwrap_or_default();
    let run_id = String::from_utf8_lossy(run_id).into_owned();
    let key = String::from_utf8_lossy(key).into_owned();
    match decode(value) {
        Ok(state) => RendezvousView { key, run_id, state: Some(state), error: None },
        Err(error) => RendezvousView { key, run_id, state: None, error: Some(error) },
    }
}

/// Decodes a stored state; `Err`: why it is undecodable.
pub(crate) fn decode(value: &[u8]) -> Result<RendezvousState, String> {
    if value == NULL_SENTINEL {
        return Err("no state written yet (torch's empty sentinel)".into());
    }
    if value.len() > MAX_STATE_LEN {
        return Err(format!("{} bytes, more than the {MAX_STATE_LEN} decoded", value.len()));
    }
    let bytes = base64::engine::general_purpose::STANDARD.decode(value).map_err(|e| format!("not base64: {e}"))?;
    let pickle = pickle::read(&bytes).map_err(|e| format!("not a pickle this reads: {e}"))?;
    state(&pickle)
}

fn state(p: &Pickle) -> Result<RendezvousState, String> {
    let root = p.root();
    match p.callable(root) {
        Some((_, "_RendezvousState")) => {}
        Some((module, name)) => return Err(format!("a pickled {module}.{name}, not torch's _RendezvousState")),
        None => return Err("not a pickled object".into()),
    }
    let Value::Call { state: Some(fields), .. } = p.get(root) else {
        return Err("a _RendezvousState without its fields".into());
    };
    let fields = *fields;
    let field = |name: &str| p.field(fields, name).ok_or_else(|| format!("no field '{name}'"));
    let round = p.int(field("round")?).ok_or("'round' is not an integer")?;
    let complete = p.int(field("complete")?).is_some_and(|b| b != 0);
    let closed = p.int(field("closed")?).is_some_and(|b| b != 0);
    let deadline_unix_ms = match p.get(field("deadline")?) {
        Value::None => None,
        _ => Some(datetime_ms(p, field("deadline")?).ok_or("'deadline' is not a datetime")?),
    };
    let heartbeats = p.field(fields, "last_heartbeats");
    let heartbeat = |node: Id| -> Option<i64> {
        let Value::Dict(entries) = p.get(heartbeats?) else { return None };
        let desc = node_desc(p, node)?;
        let (_, at) = entries.iter().find(|(k, _)| node_desc(p, *k).as_ref() == Some(&desc))?;
        datetime_ms(p, *at)
    };
    let node = |id: Id, rank: Option<i64>| -> Result<RendezvousNode, String> {
        let (addr, pid, local_id) = node_desc(p, id).ok_or("a node that is not a _NodeDesc")?;
        Ok(RendezvousNode {
            node: format!("{addr}_{pid}_{local_id}"),
            addr,
            pid,
            local_id,
            rank,
            last_heartbeat_unix_ms: heartbeat(id),
        })
    };
    let mut participants = Vec::new();
    if let Value::Dict(entries) = p.get(field("participants")?) {
        for &(desc, rank) in entries {
            participants.push(node(desc, p.int(rank))?);
        }
    }
    participants.sort_by_key(|n| (n.rank, n.node.clone()));
    let set = |name: &str| -> Result<Vec<RendezvousNode>, String> {
        let Some(id) = p.field(fields, name) else { return Ok(Vec::new()) };
        let items = match p.get(id) {
            Value::Set(items) | Value::List(items) | Value::Tuple(items) => items.clone(),
            _ => return Err(format!("'{name}' is not a set")),
        };
        let mut nodes = items.into_iter().map(|i| node(i, None)).collect::<Result<Vec<_>, _>>()?;
        nodes.sort_by(|a, b| a.node.cmp(&b.node));
        Ok(nodes)
    };
    Ok(RendezvousState {
        round,
        complete,
        closed,
        deadline_unix_ms,
        participants,
        wait_list: set("wait_list")?,
        redundancy_list: set("redundancy_list")?,
    })
}

/// A `_NodeDesc`'s (addr, pid, local_id).
fn node_desc(p: &Pickle, id: Id) -> Option<(String, i64, i64)> {
    let Value::Call { state: Some(fields), .. } = p.get(id) else { return None };
    let fields = *fields;
    // A frozen dataclass pickles its fields as a dict; with slots, as (None, dict).
    let fields = match p.get(fields) {
        Value::Tuple(items) if items.len() == 2 => items[1],
        _ => fields,
    };
    Some((
        p.str(p.field(fields, "addr")?)?.to_owned(),
        p.int(p.field(fields, "pid")?)?,
        p.int(p.field(fields, "local_id")?)?,
    ))
}

/// A pickled `datetime.datetime` as milliseconds since the Unix epoch: its first
/// argument is 10 bytes (year high and low, month, day, hour, minute, second,
/// microseconds in 3), the second, if any, its `timezone` (an offset from UTC);
/// without one the time is taken as UTC, which is what torch writes.
fn datetime_ms(p: &Pickle, id: Id) -> Option<i64> {
    let (_, "datetime") = p.callable(id)? else { return None };
    let Value::Call { args, .. } = p.get(id) else { return None };
    let Value::Tuple(args) = p.get(*args) else { return None };
    let Value::Bytes(b) = p.get(*args.first()?) else { return None };
    if b.len() != 10 {
        return None;
    }
    let year = i64::from(b[0]) << 8 | i64::from(b[1]);
    // The month's high bit is `fold`.
    let (month, day) = (i64::from(b[2] & 0x7f), i64::from(b[3]));
    let (hour, minute, second) = (i64::from(b[4]), i64::from(b[5]), i64::from(b[6]));
    let micros = i64::from(b[7]) << 16 | i64::from(b[8]) << 8 | i64::from(b[9]);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) {
        return None;
    }
    let days = days_from_civil(year, month, day);
    let local_ms = ((days * 24 + hour) * 60 + minute) * 60_000 + second * 1000 + micros / 1000;
    let offset_ms = args.get(1).and_then(|&tz| timezone_offset_ms(p, tz)).unwrap_or(0);
    Some(local_ms - offset_ms)
}

/// A pickled `datetime.timezone(timedelta(days, seconds, microseconds))`'s offset.
fn timezone_offset_ms(p: &Pickle, id: Id) -> Option<i64> {
    let (_, "timezone") = p.callable(id)? else { return None };
    let Value::Call { args, .. } = p.get(id) else { return None };
    let Value::Tuple(args) = p.get(*args) else { return None };
    let delta = *args.first()?;
    let (_, "timedelta") = p.callable(delta)? else { return None };
    let Value::Call { args, .. } = p.get(delta) else { return None };
    let Value::Tuple(parts) = p.get(*args) else { return None };
    let part = |i: usize| parts.get(i).and_then(|&v| p.int(v)).unwrap_or(0);
    Some(part(0) * 86_400_000 + part(1) * 1000 + part(2) / 1000)
}

/// Days from 1970-01-01 to a date of the proleptic Gregorian calendar.
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A state written by torch 2.15's own code (`b64encode(pickle.dumps(state))`):
    /// round 3, complete, participants node-a (rank 0) and node-b (rank 1), node-c
    /// waiting, heartbeats of node-a at 2026-01-02T03:04:05.678Z and node-b at
    /// 2026-01-02T03:04:06Z, deadline None.
    const STATE: &[u8] = include_bytes!("testdata/state-round3.b64");

    #[test]
    fn decodes_a_state_torch_wrote() {
        let state = decode(STATE.trim_ascii()).expect("decodable");
        assert_eq!((state.round, state.complete, state.closed, state.deadline_unix_ms), (3, true, false, None));
        let names: Vec<(&str, Option<i64>)> = state.participants.iter().map(|n| (n.node.as_str(), n.rank)).collect();
        assert_eq!(names, [("node-a_123_0", Some(0)), ("node-b_456_0", Some(1))]);
        assert_eq!(state.participants[0].last_heartbeat_unix_ms, Some(1_767_323_045_678));
        assert_eq!(state.participants[1].last_heartbeat_unix_ms, Some(1_767_323_046_000));
        assert_eq!(state.wait_list.len(), 1);
        assert_eq!((state.wait_list[0].addr.as_str(), state.wait_list[0].pid), ("node-c", 789));
        assert_eq!(state.wait_list[0].last_heartbeat_unix_ms, None);
    }

    #[test]
    fn says_why_a_value_is_undecodable() {
        assert!(decode(NULL_SENTINEL).unwrap_err().contains("sentinel"));
        assert!(decode(b"%%%").unwrap_err().contains("base64"));
        // base64 of pickle.dumps({"round": 1}): a pickle, but not the state.
        assert!(decode(b"gASVDgAAAAAAAAB9lIwFcm91bmSUSwFzLg==").unwrap_err().contains("not a pickled object"));
    }

    #[test]
    fn state_keys_with_or_without_the_slashes_torch_adds() {
        for key in [&b"torch.rendezvous.run7"[..], b"/torch.rendezvous.run7", b"//torch.rendezvous.run7"] {
            assert!(is_state_key(key), "{}", key.escape_ascii());
            assert_eq!(view(key, NULL_SENTINEL).run_id, "run7");
        }
        for key in [&b"torch.rendezvous."[..], b"/x/torch.rendezvous.run7", b"torch.rendezvous"] {
            assert!(!is_state_key(key), "{}", key.escape_ascii());
        }
    }

    #[test]
    fn civil_days() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        assert_eq!(days_from_civil(2026, 1, 2), 20_455);
    }
}
