//! `/metrics`: what the engine counted per job, what the connections moved, and
//! this process's memory, file descriptors and CPU, in the OpenMetrics text format
//! (encoded by `prometheus-client`; docs/METRICS.md lists every metric).
//!
//! Jobs are named by their users, so the `job` label is bounded: the
//! [`MAX_LABELLED_JOBS`] oldest jobs get their own series, the others are summed
//! into `rallypoint_job="_other"` (whose counters may then go down when one of those jobs is
//! forgotten, which Prometheus takes as a reset).

use std::fmt;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeCounterValue, EncodeGaugeValue, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};
use rallypoint_core::counters::{JobCounters, WaitHistogram, KV_OPS, WAIT_BUCKETS_MS, WAIT_OPS};
use rallypoint_core::snapshot::{RankSummary, SessionCounts};
use rallypoint_core::JobMetrics;
use rallypoint_net::meter::OTHER_JOBS;
use rallypoint_server::ServerMetrics;

/// Jobs with series of their own; the rest are summed into `rallypoint_job="_other"`.
pub const MAX_LABELLED_JOBS: usize = 50;

/// Barriers and collectives, whose generations can fail for a lost peer.
const COLLECTIVE_OPS: usize = 3;
/// Operations that count arrivals (collectives and TCPStore store barriers).
const ARRIVING_OPS: usize = 4;

type Labels = Vec<(&'static str, String)>;

/// The metrics text of `metrics` and of this process.
pub(crate) fn render(metrics: &ServerMetrics) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Scrape { jobs: labelled(&metrics.jobs), metrics: metrics.clone() }));
    let mut text = String::new();
    if let Err(error) = prometheus_client::encoding::text::encode(&mut text, &registry) {
        return format!("# the metrics could not be encoded: {error}\n# EOF\n");
    }
    text
}

/// The jobs as labelled: the oldest [`MAX_LABELLED_JOBS`], then the rest summed.
fn labelled(jobs: &[JobMetrics]) -> Vec<JobMetrics> {
    let mut out: Vec<JobMetrics> = jobs.iter().take(MAX_LABELLED_JOBS).cloned().collect();
    let rest = &jobs[jobs.len().min(MAX_LABELLED_JOBS)..];
    if let Some(first) = rest.first() {
        let mut other = JobMetrics { name: OTHER_JOBS.to_owned(), ..first.clone() };
        for m in &rest[1..] {
            add(&mut other, m);
        }
        out.push(other);
    }
    out
}

fn add(into: &mut JobMetrics, m: &JobMetrics) {
    let s: &mut SessionCounts = &mut into.sessions;
    s.native += m.sessions.native;
    s.tcpstore += m.sessions.tcpstore;
    s.via_agent += m.sessions.via_agent;
    let r: &mut RankSummary = &mut into.ranks;
    r.connected += m.ranks.connected;
    r.left += m.ranks.left;
    r.lost += m.ranks.lost;
    r.finished += m.ranks.finished;
    r.never_connected += m.ranks.never_connected;
    r.reconnecting += m.ranks.reconnecting;
    let c: &mut JobCounters = &mut into.counters;
    for (mine, theirs) in c.ops.iter_mut().zip(&m.counters.ops) {
        mine.arrivals += theirs.arrivals;
        mine.releases += theirs.releases;
        mine.timeouts += theirs.timeouts;
        mine.peer_lost += theirs.peer_lost;
        for (a, b) in mine.wait.buckets.iter_mut().zip(&theirs.wait.buckets) {
            *a += b;
        }
        mine.wait.count += theirs.wait.count;
        mine.wait.sum_ms = mine.wait.sum_ms.saturating_add(theirs.wait.sum_ms);
    }
    c.ranks_lost_disconnected += m.counters.ranks_lost_disconnected;
    c.ranks_lost_lease += m.counters.ranks_lost_lease;
    c.ranks_lost_exited += m.counters.ranks_lost_exited;
    for (a, b) in c.kv_ops.iter_mut().zip(&m.counters.kv_ops) {
        *a += b;
    }
}

/// One scrape's data, encoded by `prometheus-client`.
#[derive(Debug)]
struct Scrape {
    jobs: Vec<JobMetrics>,
    metrics: ServerMetrics,
}

/// The label naming a job: not `job`, which Prometheus gives every scraped target.
const JOB_LABEL: &str = "rallypoint_job";

fn job(m: &JobMetrics) -> Labels {
    vec![(JOB_LABEL, m.name.clone())]
}

fn with(mut labels: Labels, key: &'static str, value: &str) -> Labels {
    labels.push((key, value.to_owned()));
    labels
}

/// One metric family of counters (`_total` is appended to `name`, after the unit).
fn counters<V: EncodeCounterValue>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    rows: Vec<(Labels, V)>,
) -> fmt::Result {
    let mut family = encoder.encode_descriptor(name, help, unit, MetricType::Counter)?;
    for (labels, value) in &rows {
        if labels.is_empty() {
            family.encode_counter::<NoLabelSet, V, u64>(value, None)?;
        } else {
            family.encode_family(labels)?.encode_counter::<NoLabelSet, V, u64>(value, None)?;
        }
    }
    Ok(())
}

fn gauges<V: EncodeGaugeValue>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    rows: Vec<(Labels, V)>,
) -> fmt::Result {
    let mut family = encoder.encode_descriptor(name, help, unit, MetricType::Gauge)?;
    for (labels, value) in &rows {
        if labels.is_empty() {
            family.encode_gauge(value)?;
        } else {
            family.encode_family(labels)?.encode_gauge(value)?;
        }
    }
    Ok(())
}

fn histograms(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: Vec<(Labels, &WaitHistogram)>,
) -> fmt::Result {
    let mut family = encoder.encode_descriptor(name, help, Some(&Unit::Seconds), MetricType::Histogram)?;
    for (labels, h) in &rows {
        let mut buckets: Vec<(f64, u64)> =
            WAIT_BUCKETS_MS.iter().zip(&h.buckets).map(|(&bound, &n)| (bound as f64 / 1000.0, n)).collect();
        buckets.push((f64::INFINITY, h.buckets[WAIT_BUCKETS_MS.len()]));
        family.encode_family(labels)?.encode_histogram::<NoLabelSet>(
            h.sum_ms as f64 / 1000.0,
            h.count,
            &buckets,
            None,
        )?;
    }
    Ok(())
}

impl Collector for Scrape {
    fn encode(&self, mut e: DescriptorEncoder) -> fmt::Result {
        let jobs = &self.jobs;
        let per_job = |f: &dyn Fn(&JobMetrics) -> Vec<(Labels, u64)>| jobs.iter().flat_map(f).collect::<Vec<_>>();

        gauges(
            &mut e,
            "rallypoint_jobs",
            "Jobs the coordinator holds.",
            None,
            vec![(Labels::new(), self.metrics.jobs.len() as u64)],
        )?;
        gauges(
            &mut e,
            "rallypoint_ranks",
            "Ranks of the job by state (never_connected: below the world size its ranks stated).",
            None,
            per_job(&|m| {
                let r = &m.ranks;
                [
                    ("connected", r.connected),
                    ("left", r.left),
                    ("lost", r.lost),
                    ("finished", r.finished),
                    ("never_connected", r.never_connected),
                ]
                .into_iter()
                .map(|(state, n)| (with(job(m), "state", state), n))
                .collect()
            }),
        )?;
        gauges(
            &mut e,
            "rallypoint_ranks_reconnecting",
            "Of the connected ranks, those whose connection dropped and that wait for their process to resume \
             within the reconnect grace.",
            None,
            per_job(&|m| vec![(job(m), m.ranks.reconnecting)]),
        )?;
        gauges(
            &mut e,
            "rallypoint_sessions",
            "Open sessions of the job by protocol (agent: native sessions a node agent carries).",
            None,
            per_job(&|m| {
                let s = &m.sessions;
                let direct = s.native.saturating_sub(s.via_agent) as u64;
                [("native", direct), ("agent", s.via_agent as u64), ("tcpstore", s.tcpstore as u64)]
                    .into_iter()
                    .map(|(protocol, n)| (with(job(m), "protocol", protocol), n))
                    .collect()
            }),
        )?;
        let ops = |range: std::ops::Range<usize>, value: fn(&rallypoint_core::counters::OpCounters) -> u64| {
            per_job(&|m| range.clone().map(|i| (with(job(m), "op", WAIT_OPS[i]), value(&m.counters.ops[i]))).collect())
        };
        counters(
            &mut e,
            "rallypoint_arrivals",
            "Calls of barriers, all-gathers, broadcasts and TCPStore store barriers.",
            None,
            ops(0..ARRIVING_OPS, |c| c.arrivals),
        )?;
        counters(
            &mut e,
            "rallypoint_releases",
            "Generations released (store barriers, gets, waits, multi-gets: calls answered, those that waited).",
            None,
            ops(0..WAIT_OPS.len(), |c| c.releases),
        )?;
        counters(
            &mut e,
            "rallypoint_timeouts",
            "Generations (gets, waits, multi-gets: requests) that reached their deadline.",
            None,
            ops(0..WAIT_OPS.len(), |c| c.timeouts),
        )?;
        counters(
            &mut e,
            "rallypoint_peer_lost",
            "Generations of barriers and collectives failed because a member was lost.",
            None,
            ops(0..COLLECTIVE_OPS, |c| c.peer_lost),
        )?;
        counters(
            &mut e,
            "rallypoint_ranks_lost",
            "Ranks lost, by why (the first seen): their last connection dropped, silent for a whole lease, or \
             their launcher saw their process end.",
            None,
            per_job(&|m| {
                vec![
                    (with(job(m), "reason", "disconnected"), m.counters.ranks_lost_disconnected),
                    (with(job(m), "reason", "lease_expired"), m.counters.ranks_lost_lease),
                    (with(job(m), "reason", "exited"), m.counters.ranks_lost_exited),
                ]
            }),
        )?;
        histograms(
            &mut e,
            "rallypoint_wait",
            "How long released generations waited from their first arrival (gets, waits, multi-gets, store \
             barriers: each request that had to wait).",
            jobs.iter()
                .flat_map(|m| {
                    (0..WAIT_OPS.len()).map(move |i| (with(job(m), "op", WAIT_OPS[i]), &m.counters.ops[i].wait))
                })
                .collect(),
        )?;
        counters(
            &mut e,
            "rallypoint_kv_operations",
            "Key-value requests by type.",
            None,
            per_job(&|m| KV_OPS.iter().zip(&m.counters.kv_ops).map(|(op, &n)| (with(job(m), "op", op), n)).collect()),
        )?;

        let traffic = &self.metrics.traffic;
        let by_protocol = |value: fn(&rallypoint_server::ProtocolCounts) -> u64| {
            traffic.protocols.iter().map(|c| (vec![("protocol", c.protocol.label().to_owned())], value(c))).collect()
        };
        gauges(&mut e, "rallypoint_connections", "Connections open now, by protocol.", None, by_protocol(|c| c.open))?;
        counters(
            &mut e,
            "rallypoint_connections_opened",
            "Connections accepted, by protocol (unrecognised: closed or refused before telling).",
            None,
            by_protocol(|c| c.opened),
        )?;
        counters(
            &mut e,
            "rallypoint_received",
            "Bytes received, by protocol.",
            Some(&Unit::Bytes),
            by_protocol(|c| c.received),
        )?;
        counters(&mut e, "rallypoint_sent", "Bytes sent, by protocol.", Some(&Unit::Bytes), by_protocol(|c| c.sent))?;
        let labelled_job = |name: &str| {
            if jobs.iter().any(|m| m.name == name) {
                name.to_owned()
            } else {
                OTHER_JOBS.to_owned()
            }
        };
        let mut job_bytes: Vec<(String, u64, u64)> = Vec::new();
        for (name, received, sent) in &traffic.jobs {
            let name = labelled_job(name);
            match job_bytes.iter_mut().find(|(n, _, _)| *n == name) {
                Some((_, r, s)) => {
                    *r += received;
                    *s += sent;
                }
                None => job_bytes.push((name, *received, *sent)),
            }
        }
        counters(
            &mut e,
            "rallypoint_job_received",
            "Bytes received on connections carrying one session of the job (native and TCPStore; not node agents').",
            Some(&Unit::Bytes),
            job_bytes.iter().map(|(n, r, _)| (vec![(JOB_LABEL, n.clone())], *r)).collect(),
        )?;
        counters(
            &mut e,
            "rallypoint_job_sent",
            "Bytes sent on connections carrying one session of the job (native and TCPStore; not node agents').",
            Some(&Unit::Bytes),
            job_bytes.iter().map(|(n, _, s)| (vec![(JOB_LABEL, n.clone())], *s)).collect(),
        )?;

        let process = Process::read();
        let bytes = Some(&Unit::Bytes);
        for (name, help, unit, value) in [
            ("process_resident_memory", "Resident memory size.", bytes, process.rss_bytes),
            ("process_virtual_memory", "Virtual memory size.", bytes, process.virtual_bytes),
            ("process_open_fds", "Open file descriptors.", None, process.open_fds),
            ("process_max_fds", "Most file descriptors this process may open.", None, process.max_fds),
        ] {
            if let Some(value) = value {
                gauges(&mut e, name, help, unit, vec![(Labels::new(), value)])?;
            }
        }
        if let Some(cpu) = process.cpu_seconds {
            counters(
                &mut e,
                "process_cpu",
                "User and system CPU time.",
                Some(&Unit::Seconds),
                vec![(Labels::new(), cpu)],
            )?;
        }
        if let Some(start) = process.start_time_seconds {
            gauges(
                &mut e,
                "process_start_time",
                "Start time since the Unix epoch.",
                Some(&Unit::Seconds),
                vec![(Labels::new(), start)],
            )?;
        }
        Ok(())
    }
}

/// This process, as /proc tells it (each part absent if it cannot be read).
#[derive(Debug, Default)]
struct Process {
    rss_bytes: Option<u64>,
    virtual_bytes: Option<u64>,
    open_fds: Option<u64>,
    max_fds: Option<u64>,
    cpu_seconds: Option<f64>,
    start_time_seconds: Option<f64>,
}

impl Process {
    fn read() -> Process {
        let mut p = Process {
            open_fds: std::fs::read_dir("/proc/self/fd").ok().map(|dir| dir.count() as u64),
            ..Process::default()
        };
        let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit writes only into the struct given.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0 {
            p.max_fds = Some(limit.rlim_cur);
        }
        // SAFETY: sysconf has no preconditions.
        let (ticks, page) = unsafe { (libc::sysconf(libc::_SC_CLK_TCK), libc::sysconf(libc::_SC_PAGESIZE)) };
        let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else { return p };
        // The fields after the command, which is in parentheses and may hold anything.
        let Some((_, rest)) = stat.rsplit_once(") ") else { return p };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        // Field n of stat(5) is fields[n - 3] here.
        let field = |n: usize| fields.get(n - 3).and_then(|f| f.parse::<u64>().ok());
        if ticks > 0 {
            let ticks = ticks as f64;
            if let (Some(utime), Some(stime)) = (field(14), field(15)) {
                p.cpu_seconds = Some((utime + stime) as f64 / ticks);
            }
            let boot = std::fs::read_to_string("/proc/stat").ok().and_then(|s| {
                s.lines().find_map(|l| l.strip_prefix("btime ").and_then(|t| t.trim().parse::<u64>().ok()))
            });
            if let (Some(boot), Some(start)) = (boot, field(22)) {
                p.start_time_seconds = Some(boot as f64 + start as f64 / ticks);
            }
        }
        p.virtual_bytes = field(23);
        if page > 0 {
            p.rss_bytes = field(24).map(|pages| pages * page as u64);
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job_named(name: &str, order: u64) -> JobMetrics {
        let mut counters = JobCounters::default();
        counters.ops[0].arrivals = 2;
        JobMetrics {
            name: name.to_owned(),
            order,
            sessions: SessionCounts::default(),
            ranks: RankSummary { connected: 1, reconnecting: 1, ..RankSummary::default() },
            counters,
        }
    }

    #[test]
    fn jobs_past_the_cap_are_summed_into_other() {
        let jobs: Vec<JobMetrics> = (0..MAX_LABELLED_JOBS as u64 + 3).map(|i| job_named(&format!("j{i}"), i)).collect();
        let labelled = labelled(&jobs);
        assert_eq!(labelled.len(), MAX_LABELLED_JOBS + 1);
        let other = labelled.last().expect("other");
        assert_eq!((other.name.as_str(), other.ranks.connected, other.counters.ops[0].arrivals), ("_other", 3, 6));
        let text = render(&ServerMetrics { jobs, traffic: Default::default() });
        assert!(text.contains("rallypoint_arrivals_total{rallypoint_job=\"_other\",op=\"barrier\"} 6"), "{text}");
        assert!(text.contains("rallypoint_arrivals_total{rallypoint_job=\"j0\",op=\"barrier\"} 2"), "{text}");
        assert!(text.contains("rallypoint_ranks_reconnecting{rallypoint_job=\"_other\"} 3"), "{text}");
        assert!(text.contains("rallypoint_ranks_reconnecting{rallypoint_job=\"j0\"} 1"), "{text}");
        assert!(text.contains("# TYPE rallypoint_wait_seconds histogram"), "{text}");
        assert!(
            text.contains("rallypoint_wait_seconds_bucket{le=\"+Inf\",rallypoint_job=\"j0\",op=\"barrier\"} 0"),
            "{text}"
        );
        assert!(text.contains("process_resident_memory_bytes "), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
