//! What rallypoint infers about a PyTorch job from its TCPStore traffic, where a
//! connection carries no rank (docs/TCPSTORE.md says what is inferred and how):
//! gloo address keys name the rank that writes them and the ranks others wait for,
//! `init/` counts the processes that connected, store-barrier counters count arrivals.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;

use bytes::Bytes;

use crate::error::{Secs, Show};
use crate::ranges::{gaps, runs, RankList};
use crate::rendezvous;
use crate::snapshot::{ProcessGroupView, RangeSet, RendezvousView, StoreBarrierView, TorchView};
use crate::{Identity, LossReason, Millis, Missing, OpError, Outgoing, RankState, SessionId};

use super::job::Job;
use super::store::{KeyWait, WaitId, WaitKind};
use super::{HashMap, Sessions};

/// A torch wait blocked this long on an address key or a store barrier is reported.
pub(crate) const STALL_REPORT_MS: Millis = 5_000;
/// ...and again at this interval while it stays blocked.
pub(crate) const STALL_REPEAT_MS: Millis = 30_000;
/// Sweeps for stalls run at most this often: each looks at every blocked wait of the
/// job, and waits that come and go just short of the report time must not make it
/// sweep at every arrival.
const STALL_SWEEP_MIN_MS: Millis = 1_000;

/// The key every torch client with a world size adds 1 to when it connects.
const INIT_KEY: &[u8] = b"init/";

/// A process group's address key, `<prefix>//<device>//<n>/<rank>` as gloo writes it
/// (e.g. `/default_pg/0//cpu//0/3`): its prefix (through the last `/`) and rank.
pub(crate) fn address_key(key: &[u8]) -> Option<(&[u8], u32)> {
    let slash = key.iter().rposition(|&b| b == b'/')?;
    let (prefix, rank) = key.split_at(slash + 1);
    let rank = decimal(rank)?;
    // "...//<device>//<n>": a number, then an alphanumeric device, each after "//".
    let inner = prefix.strip_suffix(b"/")?;
    let n_at = inner.iter().rposition(|&b| b == b'/')? + 1;
    decimal(&inner[n_at..])?;
    let before_n = inner[..n_at].strip_suffix(b"//")?;
    let device_at = before_n.iter().rposition(|&b| b == b'/')? + 1;
    let device = &before_n[device_at..];
    if device.is_empty() || !device.iter().all(u8::is_ascii_alphanumeric) || !before_n[..device_at].ends_with(b"//") {
        return None;
    }
    Some((prefix, rank))
}

fn decimal(digits: &[u8]) -> Option<u32> {
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(digits).ok()?.parse().ok()
}

/// Ranks whose address key under `prefix` exists.
fn written(job: &Job, prefix: &[u8]) -> BTreeSet<u32> {
    job.store.list(prefix).iter().filter_map(|k| address_key(k).filter(|(p, _)| *p == prefix).map(|(_, r)| r)).collect()
}

/// Address-key prefixes and ranks a wait is blocked on.
fn missing_addresses(job: &Job, wait: &KeyWait) -> Vec<(Bytes, BTreeSet<u32>)> {
    let mut groups: Vec<(Bytes, BTreeSet<u32>)> = Vec::new();
    for key in job.store.absent(&wait.keys) {
        let Some((prefix, rank)) = address_key(&key) else { continue };
        match groups.iter_mut().find(|(p, _)| p == prefix) {
            Some((_, ranks)) => {
                ranks.insert(rank);
            }
            None => groups.push((Bytes::copy_from_slice(prefix), BTreeSet::from([rank]))),
        }
    }
    groups
}

fn arrived_at_init(job: &Job) -> Option<String> {
    job.store.get(INIT_KEY).map(|v| String::from_utf8_lossy(v).into_owned())
}

fn who(session: SessionId, identity: &Identity) -> String {
    let mut s = match identity.rank {
        Some(rank) => format!("rank {rank}"),
        None => format!("unattributed {session}"),
    };
    let _ = write!(s, " (host {}, pid {})", identity.host, identity.pid);
    s
}

/// Ranks as text, bounded however many there are (see `RankList`).
fn ranks(set: &BTreeSet<u32>) -> String {
    format!("[{}]", RankList::new(runs(set.iter().copied()), ", "))
}

/// The ranks of a world of `world_size` (as torch states it) not among `arrived`,
/// as text; computed from those that arrived, whatever the world size.
fn ranks_not_in(world_size: i64, arrived: &BTreeSet<u32>) -> String {
    let world = u32::try_from(world_size).unwrap_or(0);
    format!("[{}]", RankList::new(gaps(world, arrived.iter().copied()), ", "))
}

/// Ranks that wait at store barrier `key`, and the ranks of the world not among them,
/// when every waiter is attributed.
fn barrier_arrivals(
    job: &Job,
    key: &Bytes,
    rank_of: &dyn Fn(SessionId) -> Option<u32>,
) -> (usize, Option<i64>, BTreeSet<u32>, bool) {
    let mut waiting = 0;
    let mut world = None;
    let mut arrived = BTreeSet::new();
    let mut all_known = true;
    // By world size, smallest first: the largest stated speaks for the key.
    for (world_size, (session, _)) in job.store.barrier_waiters(key) {
        waiting += 1;
        world = Some(world_size);
        match rank_of(*session) {
            Some(rank) => {
                arrived.insert(rank);
            }
            None => all_known = false,
        }
    }
    (waiting, world, arrived, all_known)
}

/// Reports every key (first key waited on) that a torch wait has been blocked on for
/// `STALL_REPORT_MS`: one notice per key and `STALL_REPEAT_MS`, not one per waiting
/// rank, since every rank stalled at one barrier or address key has the same story.
/// Returns when to sweep again, or None when no torch wait is blocked.
pub(crate) fn sweep_stalls(
    job: &mut Job,
    sessions: &Sessions,
    now: Millis,
    notices: &mut Vec<String>,
    out: &mut Vec<Outgoing>,
) -> Option<Millis> {
    let next = note_stalls(job, sessions, now, notices);
    fail_waits_for_the_gone(job, sessions, now, out);
    next
}

/// Ends the torch waits for an address key of a rank whose worker process its
/// launcher saw end ([`ended`]): it will never write it, and torch would wait for its own
/// timeout (half an hour by default). The error closes the waiting connection (the
/// TCPStore protocol has no error reply), so the peers fail and their launcher
/// names the rank that ended first. Looks at every blocked wait: the stall sweep's
/// (at most once a second), which finds the waits that began after the rank ended,
/// and notes the address prefixes still waited on (`Job::address_prefixes`).
fn fail_waits_for_the_gone(job: &mut Job, sessions: &Sessions, now: Millis, out: &mut Vec<Outgoing>) {
    let mut doomed = Vec::new();
    let mut prefixes = BTreeSet::new();
    for (&id, wait) in job.store.waits() {
        if matches!(wait.kind, WaitKind::Barrier { .. }) || !sessions.get(&id.0).is_some_and(|s| s.torch) {
            continue;
        }
        let missing = missing_addresses(job, wait);
        let gone = missing
            .iter()
            .find_map(|(prefix, ranks)| ranks.iter().find_map(|&r| Some((prefix.clone(), r, ended(job, r, now)?))));
        prefixes.extend(missing.into_iter().map(|(prefix, _)| prefix));
        if let Some(gone) = gone {
            doomed.push((id, gone));
        }
    }
    job.address_prefixes = prefixes;
    for (id, (prefix, rank, how)) in doomed {
        fail_wait_for(job, id, &prefix, rank, &how, out);
    }
}

/// [`fail_waits_for_the_gone`] for one rank whose end its launcher just reported:
/// the waits on its address key under each prefix waited on, found by key.
pub(crate) fn fail_waits_for_rank(job: &mut Job, sessions: &Sessions, rank: u32, now: Millis, out: &mut Vec<Outgoing>) {
    if job.address_prefixes.is_empty() {
        return;
    }
    let Some(how) = ended(job, rank, now) else { return };
    let (digits, mut key) = (rank.to_string(), Vec::new());
    let torch = |id: &WaitId| sessions.get(&id.0).is_some_and(|s| s.torch);
    let mut doomed = Vec::new();
    for prefix in &job.address_prefixes {
        key.clear();
        key.extend_from_slice(prefix);
        key.extend_from_slice(digits.as_bytes());
        doomed.extend(job.store.waiting_on(&key).filter(torch).map(|id| (id, prefix.clone())));
    }
    // In the order of their ids, as the sweep fails them.
    doomed.sort_unstable_by_key(|(id, _)| *id);
    doomed.dedup_by_key(|(id, _)| *id);
    for (id, prefix) in doomed {
        fail_wait_for(job, id, &prefix, rank, &how, out);
    }
}

/// Fails wait `id` for rank `rank`'s address key under `prefix`; `how` the rank ended.
fn fail_wait_for(job: &mut Job, id: WaitId, prefix: &Bytes, rank: u32, how: &str, out: &mut Vec<Outgoing>) {
    // Its end stranded its peers: a launcher names it first, not the peers.
    job.collectives.failed_for_rank(rank);
    let why = format!(
        "PyTorch job '{}': {how}, so it will never write its address key of process group {}: the wait for it ends",
        job.name,
        Show(prefix)
    );
    job.store.fail_wait(id, OpError::Closed(why), out);
}

/// Notes the address-key prefixes of torch wait `id`, just blocked, for
/// [`fail_waits_for_rank`].
pub(crate) fn note_address_prefixes(job: &mut Job, id: WaitId) {
    let Some(wait) = job.store.wait(id) else { return };
    for key in &wait.keys {
        if let Some((prefix, _)) = address_key(key) {
            if !job.address_prefixes.contains(prefix) {
                job.address_prefixes.insert(Bytes::copy_from_slice(prefix));
            }
        }
    }
}

/// "rank 2 has finished (worker pid 102 exited with code 0)", if its launcher saw
/// rank `rank`'s worker process end (a dropped connection alone is not enough: its
/// process may live on).
fn ended(job: &Job, rank: u32, now: Millis) -> Option<String> {
    match job.ranks.info(rank, now).state {
        RankState::Finished { pid } => Some(format!("rank {rank} has finished (worker pid {pid} exited with code 0)")),
        RankState::Lost(reason @ LossReason::Exited { .. }) => Some(format!("rank {rank} is lost ({reason})")),
        _ => None,
    }
}

/// The stall notices due (see [`sweep_stalls`]); when to look again.
fn note_stalls(job: &mut Job, sessions: &Sessions, now: Millis, notices: &mut Vec<String>) -> Option<Millis> {
    // The oldest torch wait on each key speaks for that key.
    let mut oldest: HashMap<&Bytes, (SessionId, &KeyWait)> = HashMap::default();
    for ((session, _), wait) in job.store.waits() {
        let Some(subject) = wait.keys.first() else { continue };
        if !sessions.get(session).is_some_and(|s| s.torch) {
            continue;
        }
        let entry = oldest.entry(subject).or_insert((*session, wait));
        if wait.started < entry.1.started {
            *entry = (*session, wait);
        }
    }
    job.stall_noted.retain(|key, _| oldest.contains_key(key));
    let rank_of = |s: SessionId| sessions.get(&s).and_then(|s| s.identity.rank);
    let mut noted = Vec::new();
    let mut next: Option<Millis> = None;
    for (subject, (session, wait)) in &oldest {
        let mut due = wait.started.saturating_add(STALL_REPORT_MS);
        // Noted after the oldest wait began: the same stall, told again a period later.
        // Noted before it: that stall ended, and this is a new one.
        if let Some(&at) = job.stall_noted.get(*subject).filter(|&&at| at >= wait.started) {
            due = due.max(at.saturating_add(STALL_REPEAT_MS));
        }
        if due <= now {
            let identity = sessions.get(session).map(|s| &s.identity);
            if let Some(notice) =
                identity.and_then(|identity| stall_notice(job, *session, identity, wait, &rank_of, now))
            {
                notices.push(notice);
                noted.push((*subject).clone());
            }
            // Looked at now, told or not: again in a period (what torch tells us may change).
            due = now.saturating_add(STALL_REPEAT_MS);
        }
        next = Some(next.map_or(due, |n| n.min(due)));
    }
    for subject in noted {
        job.stall_noted.insert(subject, now);
    }
    next.map(|at| at.max(now.saturating_add(STALL_SWEEP_MIN_MS)))
}

/// The warning for a torch wait blocked since `wait.started`, or None if it waits on
/// nothing torch tells us about.
pub(crate) fn stall_notice(
    job: &Job,
    session: SessionId,
    identity: &Identity,
    wait: &KeyWait,
    rank_of: &dyn Fn(SessionId) -> Option<u32>,
    now: Millis,
) -> Option<String> {
    let waited = Secs(now.saturating_sub(wait.started));
    let mut text = format!("PyTorch job '{}': {} has waited {waited}", job.name, who(session, identity));
    if let WaitKind::Barrier { world_size } = wait.kind {
        let key = wait.keys.first()?;
        let counter = job.store.get(key).map(|v| String::from_utf8_lossy(v).into_owned()).unwrap_or_default();
        let _ = write!(text, " at store barrier {} (counter {counter} of world size {world_size})", Show(key));
        let (_, _, arrived, all_known) = barrier_arrivals(job, key, rank_of);
        if all_known {
            let _ = write!(text, "; ranks not waiting there: {}", ranks_not_in(world_size, &arrived));
        }
        return Some(text);
    }
    let groups = missing_addresses(job, wait);
    if groups.is_empty() {
        return None;
    }
    for (prefix, missing) in &groups {
        let _ = write!(
            text,
            " for process group {}: ranks {} never wrote their address key (written by ranks {})",
            Show(prefix),
            ranks(missing),
            ranks(&written(job, prefix))
        );
        // A missing rank whose worker already ended will never write it: the wait
        // lasts until torch's own timeout (half an hour by default) unless said.
        let gone: Vec<String> =
            missing.iter().take(crate::Missing::NAMED).filter_map(|&r| ended(job, r, now)).collect();
        if !gone.is_empty() {
            let _ = write!(text, "; {}, so it never will", gone.join(", "));
        }
    }
    if let Some(count) = arrived_at_init(job) {
        let _ = write!(text, "; {count} process(es) arrived at init/");
    }
    Some(text)
}

/// The native connections, counted, with those of no rank (launchers reporting their
/// workers' ends, CLI verbs, `status` itself) said apart: they are not ranks missing.
fn native(sessions: &[(SessionId, &Identity, bool)]) -> String {
    let native = sessions.iter().filter(|(_, _, torch)| !torch);
    let (all, rankless) =
        native.fold((0, 0), |(all, rankless), (_, i, _)| (all + 1, rankless + usize::from(i.rank.is_none())));
    match rankless {
        0 => format!("{all} native"),
        _ => format!("{all} native ({rankless} of no rank: launchers, tools)"),
    }
}

/// `rallypoint status`: everything known or inferred about the job's torch processes
/// (for a job without any, only its connections).
pub(crate) fn report(job: &Job, sessions: &[(SessionId, &Identity, bool)], now: Millis, now_unix_ms: u64) -> String {
    let mut out = format!("job '{}'\n", job.name);
    let torch: Vec<(SessionId, &Identity)> = sessions.iter().filter(|(_, _, t)| *t).map(|(s, i, _)| (*s, *i)).collect();
    if torch.is_empty() && arrived_at_init(job).is_none() {
        let _ = writeln!(out, "connections: {}", native(sessions));
        rendezvous_lines(job, &mut out, now_unix_ms);
        return out;
    }
    let attributed: BTreeSet<u32> = torch.iter().filter_map(|(_, i)| i.rank).collect();
    let by_session: HashMap<SessionId, &Identity> = torch.iter().copied().collect();
    let rank_of = |session: SessionId| by_session.get(&session).and_then(|i| i.rank);
    let _ = writeln!(
        out,
        "connections: {} TCPStore ({} attributed to ranks {}), {}",
        torch.len(),
        torch.iter().filter(|(_, i)| i.rank.is_some()).count(),
        ranks(&attributed),
        native(sessions)
    );
    match arrived_at_init(job) {
        Some(count) => {
            let _ = writeln!(out, "init/: {count} process(es) arrived");
        }
        None => out.push_str("init/: no arrivals\n"),
    }
    // Process groups: ranks written, and ranks waited for but never written.
    let mut prefixes: Vec<Bytes> = Vec::new();
    for key in job.store.list(b"") {
        if let Some((prefix, _)) = address_key(&key) {
            if !prefixes.iter().any(|p| p == prefix) {
                prefixes.push(Bytes::copy_from_slice(prefix));
            }
        }
    }
    let mut missing_by_group: Vec<(Bytes, BTreeSet<u32>)> = Vec::new();
    for (_, wait) in job.store.waits_in_any_order() {
        for (prefix, missing) in missing_addresses(job, wait) {
            match missing_by_group.iter_mut().find(|(p, _)| *p == prefix) {
                Some((_, set)) => set.extend(missing),
                None => missing_by_group.push((prefix, missing)),
            }
        }
    }
    for (prefix, _) in &missing_by_group {
        if !prefixes.contains(prefix) {
            prefixes.push(prefix.clone());
        }
    }
    prefixes.sort();
    rendezvous_lines(job, &mut out, now_unix_ms);
    for prefix in &prefixes {
        let _ =
            write!(out, "process group {}: address written by ranks {}", Show(prefix), ranks(&written(job, prefix)));
        if let Some((_, missing)) = missing_by_group.iter().find(|(p, _)| p == prefix) {
            let _ = write!(out, "; MISSING (waited for, never written): ranks {}", ranks(missing));
        }
        out.push('\n');
    }
    for key in job.store.barrier_keys() {
        let counter = job.store.get(key).map(|v| String::from_utf8_lossy(v).into_owned()).unwrap_or_default();
        let (waiting, world, arrived, all_known) = barrier_arrivals(job, key, &rank_of);
        let _ = write!(out, "store barrier {}: counter {counter}", Show(key));
        if let Some(world) = world {
            let _ = write!(out, ", {waiting} waiting for world size {world} (ranks {})", ranks(&arrived));
            if all_known {
                let _ = write!(out, "; MISSING ranks {}", ranks_not_in(world, &arrived));
            }
        }
        out.push('\n');
    }
    for ((session, _), wait) in job.store.waits() {
        let Some(identity) = by_session.get(session) else { continue };
        out.push_str(&waiting_line(*session, identity, true, wait, now));
    }
    out
}

/// A request of `session` (a TCPStore client's if `tcpstore`) blocked on keys, as
/// the text report says it: who, for how long, on which keys (the first few).
pub(crate) fn waiting_line(
    session: SessionId,
    identity: &Identity,
    tcpstore: bool,
    wait: &KeyWait,
    now: Millis,
) -> String {
    let keys: Vec<String> = wait.keys.iter().take(4).map(|k| Show(k).to_string()).collect();
    let who = match identity.rank {
        // A native session without a rank: a tool, or a CLI verb, which states none.
        None if !tcpstore => format!("{session} (host {}, pid {})", identity.host, identity.pid),
        _ => who(session, identity),
    };
    format!(
        "waiting: {} for {} on {}{}\n",
        who,
        Secs(now.saturating_sub(wait.started)),
        keys.join(", "),
        if wait.keys.len() > 4 { format!(" and {} more", wait.keys.len() - 4) } else { String::new() }
    )
}

/// The job's torch processes as data (the snapshot's `torch`), or None for a job
/// without TCPStore clients or torch's keys. `sessions`: the job's open sessions
/// (the one asking excluded) with whether each is a TCPStore connection.
pub(crate) fn view(job: &Job, sessions: &[(SessionId, &Identity, bool)]) -> Option<TorchView> {
    let torch: Vec<(SessionId, &Identity)> = sessions.iter().filter(|(_, _, t)| *t).map(|(s, i, _)| (*s, *i)).collect();
    let rendezvous: Vec<RendezvousView> = rendezvous_keys(job)
        .iter()
        .filter_map(|key| job.store.get(key).map(|value| rendezvous::view(key, value)))
        .collect();
    if torch.is_empty() && arrived_at_init(job).is_none() && rendezvous.is_empty() {
        return None;
    }
    let by_session: HashMap<SessionId, &Identity> = torch.iter().copied().collect();
    let rank_of = |session: SessionId| by_session.get(&session).and_then(|i| i.rank);
    let attributed: BTreeSet<u32> = torch.iter().filter_map(|(_, i)| i.rank).collect();
    // By prefix, so that a store of many keys costs a lookup per key, not a scan.
    let mut groups: BTreeMap<Bytes, (BTreeSet<u32>, BTreeSet<u32>)> = BTreeMap::new();
    for key in job.store.list(b"") {
        if let Some((prefix, rank)) = address_key(&key) {
            groups.entry(Bytes::copy_from_slice(prefix)).or_default().0.insert(rank);
        }
    }
    for (_, wait) in job.store.waits_in_any_order() {
        for (prefix, missing) in missing_addresses(job, wait) {
            groups.entry(prefix).or_default().1.extend(missing);
        }
    }
    let process_groups = groups
        .into_iter()
        .take(MAX_TORCH_LISTED)
        .map(|(prefix, (written, missing))| ProcessGroupView {
            prefix: text(&prefix),
            written: RangeSet::of_ranks(written),
            missing: RangeSet::of_ranks(missing),
        })
        .collect();
    let store_barriers = job
        .store
        .barrier_keys()
        .take(MAX_TORCH_LISTED)
        .map(|key| {
            let counter = job.store.get(key).map(|v| String::from_utf8_lossy(v).into_owned()).unwrap_or_default();
            let (waiting, world, arrived, all_known) = barrier_arrivals(job, key, &rank_of);
            let missing = match (world, all_known && waiting > 0) {
                (Some(world), true) => {
                    let world = u32::try_from(world).unwrap_or(0);
                    Some(RangeSet::collect(gaps(world, arrived.iter().copied())))
                }
                _ => None,
            };
            StoreBarrierView {
                key: text(key),
                counter,
                waiting,
                world_size: world,
                arrived: RangeSet::of_ranks(arrived),
                missing,
            }
        })
        .collect();
    Some(TorchView {
        tcpstore_connections: torch.len(),
        attributed: RangeSet::of_ranks(attributed),
        init_arrivals: arrived_at_init(job),
        process_groups,
        store_barriers,
        rendezvous,
    })
}

/// Most process groups and store barriers a snapshot lists (in key order): a
/// snapshot stays cheap whatever keys a job writes.
const MAX_TORCH_LISTED: usize = 64;

/// Most rendezvous states a snapshot decodes.
const MAX_RENDEZVOUS_LISTED: usize = 16;

/// The keys holding torchrun rendezvous states, in key order (at most
/// [`MAX_RENDEZVOUS_LISTED`]).
fn rendezvous_keys(job: &Job) -> Vec<Bytes> {
    let mut keys = job.store.keys_where(rendezvous::is_state_key);
    keys.truncate(MAX_RENDEZVOUS_LISTED);
    keys
}

/// A key as text: printable ASCII as it is, other bytes escaped; long keys cut.
pub(crate) fn text(key: &[u8]) -> String {
    const SHOWN: usize = 256;
    let mut out = key[..key.len().min(SHOWN)].escape_ascii().to_string();
    if key.len() > SHOWN {
        out.push_str(&format!("... ({} bytes)", key.len()));
    }
    out
}

/// The rendezvous rounds of the job, for the text report.
fn rendezvous_lines(job: &Job, out: &mut String, now_unix_ms: u64) {
    for key in &rendezvous_keys(job) {
        let Some(value) = job.store.get(key) else { continue };
        let view = rendezvous::view(key, value);
        let _ = write!(out, "torchrun rendezvous '{}': ", view.run_id);
        let Some(state) = view.state else {
            let _ = writeln!(out, "undecodable ({})", view.error.unwrap_or_default());
            continue;
        };
        let _ = write!(
            out,
            "round {}, {}{}, {} participant(s)",
            state.round,
            if state.complete { "complete" } else { "incomplete" },
            if state.closed { ", closed" } else { "" },
            state.participants.len()
        );
        let ago = |at: Option<i64>| match at {
            Some(at) => {
                format!("last heartbeat {} ago", Secs(now_unix_ms.saturating_sub(u64::try_from(at).unwrap_or(0))))
            }
            None => "no heartbeat".to_owned(),
        };
        let nodes: Vec<String> = state
            .participants
            .iter()
            .take(Missing::NAMED)
            .map(|n| format!("{} (rank {}, {})", n.node, n.rank.unwrap_or(-1), ago(n.last_heartbeat_unix_ms)))
            .collect();
        if !nodes.is_empty() {
            let _ = write!(out, ": {}", nodes.join(", "));
        }
        if !state.wait_list.is_empty() {
            let waiting: Vec<&str> = state.wait_list.iter().take(Missing::NAMED).map(|n| n.node.as_str()).collect();
            let _ = write!(out, "; waiting for the next round: {}", waiting.join(", "));
        }
        out.push('\n');
    }
}

#[cfg(test)]
mod tests {
    use super::address_key;

    #[test]
    fn gloo_address_keys() {
        assert_eq!(address_key(b"/default_pg/0//cpu//0/3"), Some((&b"/default_pg/0//cpu//0/"[..], 3)));
        assert_eq!(address_key(b"/default_pg/0//1//cpu//0/12"), Some((&b"/default_pg/0//1//cpu//0/"[..], 12)));
        assert_eq!(address_key(b"/default_pg/0//cuda//0/0"), Some((&b"/default_pg/0//cuda//0/"[..], 0)));
        for no in [
            &b"/k"[..],
            b"init/",
            b"/default_pg/0//cpu//0/",
            b"/a/0/1",
            b"/x//cpu//a/1",
            b"/x/cpu//0/1",
            b"/x//c-u//0/1",
        ] {
            assert_eq!(address_key(no), None, "{}", no.escape_ascii());
        }
    }
}
