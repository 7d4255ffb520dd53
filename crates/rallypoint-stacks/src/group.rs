//! Folding the stacks of many ranks into a screenful: identical stacks become one
//! group with its rank ranges, the smallest group first (in a hang, the rank that
//! is somewhere else than all the others is the one to look at), and each stack is
//! one line, innermost frame first, without the frames every Python program has
//! (the interpreter's start-up, `runpy`, `importlib`, a thread's bootstrap).

use std::collections::HashMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::stack::{Captured, Frame, RankStack, ThreadChoice};

/// Ranks that share one stack.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Group {
    /// In increasing order.
    pub ranks: Vec<u32>,
    /// The stack of the group's first rank (the others' differ only in their pids).
    pub stack: Captured,
    /// The stack as one line (what the ranks were grouped by).
    pub text: String,
}

/// The stacks of a job's ranks, grouped.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grouped {
    /// Ranks whose stacks were captured (a stack that could not be read counts too).
    pub ranks: u32,
    /// The smallest group first; among groups of one size, the one with the lowest rank.
    pub groups: Vec<Group>,
}

/// How [`render`] draws a [`Grouped`].
#[derive(Debug, Clone)]
pub struct Render {
    /// Lines of groups at most: the smallest groups, then the largest one (the bulk of
    /// the job), with a line saying how many are not shown between them.
    pub max_groups: usize,
    /// Frames of one stack at most: the innermost and the outermost ones, with a
    /// count of those left out between them.
    pub max_frames: usize,
    /// Put before every line.
    pub indent: String,
}

impl Default for Render {
    fn default() -> Self {
        Render { max_groups: 12, max_frames: 12, indent: "  ".into() }
    }
}

/// Runs of ranks shown in a group's label before the rest is left out.
const MAX_RUNS: usize = 8;
/// A label this long or longer is not padded to align the stacks after it.
const MAX_LABEL_PAD: usize = 40;

impl Grouped {
    /// The groups of several parts of a job (each node's) as one: groups of the
    /// same stack become one.
    pub fn merge(parts: impl IntoIterator<Item = Grouped>) -> Grouped {
        let mut merged = Grouped::default();
        let mut by_text: HashMap<String, usize> = HashMap::new();
        for part in parts {
            merged.ranks += part.ranks;
            for group in part.groups {
                match by_text.get(&group.text) {
                    Some(&index) => merged.groups[index].ranks.extend(group.ranks),
                    None => {
                        by_text.insert(group.text.clone(), merged.groups.len());
                        merged.groups.push(group);
                    }
                }
            }
        }
        merged.order();
        merged
    }

    /// Smallest group first, ties by lowest rank; each group's ranks increasing.
    fn order(&mut self) {
        for group in &mut self.groups {
            group.ranks.sort_unstable();
            group.ranks.dedup();
        }
        self.groups.sort_by_key(|g| (g.ranks.len(), g.ranks.first().copied()));
    }
}

/// Groups ranks by identical stacks.
pub fn group(stacks: impl IntoIterator<Item = RankStack>) -> Grouped {
    let mut groups: Vec<Group> = Vec::new();
    let mut by_text: HashMap<String, usize> = HashMap::new();
    let mut ranks = 0u32;
    for stack in stacks {
        ranks += 1;
        let text = describe(&stack.captured, usize::MAX);
        match by_text.get(&text) {
            Some(&index) => groups[index].ranks.push(stack.rank),
            None => {
                by_text.insert(text.clone(), groups.len());
                groups.push(Group { ranks: vec![stack.rank], stack: stack.captured, text });
            }
        }
    }
    let mut grouped = Grouped { ranks, groups };
    grouped.order();
    grouped
}

/// The groups, one line each: `rank 2 (1 of 4):      load_batch (data.py:17) ← train (train.py:40)`.
pub fn render(grouped: &Grouped, how: &Render) -> String {
    let groups = &grouped.groups;
    let max = how.max_groups.max(1);
    // Too many: the smallest ones, a line for those left out, then the largest one.
    let (shown, left_out): (Vec<&Group>, Option<(usize, usize)>) = if groups.len() > max {
        let mut shown: Vec<&Group> = groups[..max - 1].iter().collect();
        let hidden = &groups[max - 1..groups.len() - 1];
        shown.push(&groups[groups.len() - 1]);
        (shown, Some((hidden.len(), hidden.iter().map(|g| g.ranks.len()).sum())))
    } else {
        (groups.iter().collect(), None)
    };
    let labels: Vec<String> = shown.iter().map(|g| label(&g.ranks, grouped.ranks)).collect();
    let width = labels.iter().map(|l| l.chars().count()).filter(|&n| n < MAX_LABEL_PAD).max().unwrap_or(0);
    let mut text = String::new();
    for (i, (group, label)) in shown.iter().zip(&labels).enumerate() {
        if i == shown.len() - 1 {
            if let Some((count, ranks)) = left_out {
                let _ = writeln!(
                    text,
                    "{}… {count} more group{} ({ranks} rank{}) not shown",
                    how.indent,
                    plural(count),
                    plural(ranks)
                );
            }
        }
        let stack = describe(&group.stack, how.max_frames);
        let _ = writeln!(text, "{}{label:<width$} {stack}", how.indent);
    }
    text
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

/// `rank 2 (1 of 4):`, `ranks 0-1,3 (3 of 4):`.
fn label(ranks: &[u32], total: u32) -> String {
    let word = if ranks.len() == 1 { "rank" } else { "ranks" };
    format!("{word} {} ({} of {total}):", rank_list(ranks), ranks.len())
}

/// Increasing ranks as ranges: `0-1,3`; after a few runs, `…`.
pub fn rank_list(ranks: &[u32]) -> String {
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for &rank in ranks {
        match runs.last_mut() {
            Some((_, last)) if last.checked_add(1) == Some(rank) => *last = rank,
            _ => runs.push((rank, rank)),
        }
    }
    let mut text = String::new();
    for (i, &(first, last)) in runs.iter().enumerate() {
        if i == MAX_RUNS {
            text.push_str(",…");
            break;
        }
        if i > 0 {
            text.push(',');
        }
        if first == last {
            let _ = write!(text, "{first}");
        } else {
            let _ = write!(text, "{first}-{last}");
        }
    }
    text
}

/// Before the stack of a process that was stopped when read.
const STOPPED: &str = "[stopped] ";

/// A stack as one line, with at most `max_frames` frames.
fn describe(captured: &Captured, max_frames: usize) -> String {
    match captured {
        Captured::Python { thread, thread_name, frames, stopped, .. } => {
            let folded = fold(frames);
            let mut text = String::new();
            if *stopped {
                text.push_str(STOPPED);
            }
            if *thread != ThreadChoice::Main {
                let why = match thread {
                    ThreadChoice::GilHolder => ", holding the GIL",
                    _ => "",
                };
                let name = thread_name.as_deref().unwrap_or("?");
                let _ = write!(text, "[thread '{name}'{why}; the main thread runs no Python] ");
            }
            if folded.is_empty() {
                text.push_str("(no Python frames: the thread runs no Python code now)");
            } else {
                text.push_str(&frames_text(&folded, max_frames));
            }
            text
        }
        Captured::Native { program, frames, .. } => {
            let folded = fold(frames);
            format!("not a Python process ({program}): {}", frames_text(&folded, max_frames))
        }
        Captured::NotPython { program, detail, stopped, .. } => {
            let stopped = if *stopped { STOPPED } else { "" };
            match detail {
                Some(detail) => format!("{stopped}not a Python process ({program}; {detail})"),
                None => format!("{stopped}not a Python process ({program})"),
            }
        }
        Captured::Gone => "exited before its stack was read".into(),
        Captured::TimedOut { after_ms } => {
            format!("its stack could not be read within {:.1} s (given up)", *after_ms as f64 / 1000.0)
        }
        Captured::Refused { reason } => format!("its stack cannot be read: {reason}"),
        Captured::Failed { error } => format!("its stack could not be read: {error}"),
    }
}

/// A stack as one string per frame, innermost first, as [`render`] shows them (all of
/// them); a stack that could not be read is one string saying why.
pub fn frame_texts(captured: &Captured) -> Vec<String> {
    match captured {
        Captured::Python { frames, .. } | Captured::Native { frames, .. } if !frames.is_empty() => {
            fold(frames).iter().map(|(frame, times)| frame_text(frame, *times)).collect()
        }
        other => vec![describe(other, usize::MAX)],
    }
}

fn frames_text(folded: &[(Frame, u32)], max_frames: usize) -> String {
    let shown: Vec<String> = folded.iter().map(|(frame, times)| frame_text(frame, *times)).collect();
    let max = max_frames.max(2);
    if shown.len() <= max {
        return shown.join(" ← ");
    }
    // The innermost frames say where it is stuck, the outermost which code of the
    // program got it there.
    let inner = max.div_ceil(2);
    let outer = max - inner;
    let left_out = shown.len() - inner - outer;
    let mut parts: Vec<String> = shown[..inner].to_vec();
    parts.push(format!("… {left_out} frames …"));
    parts.extend_from_slice(&shown[shown.len() - outer..]);
    parts.join(" ← ")
}

fn frame_text(frame: &Frame, times: u32) -> String {
    let function = if frame.native { short_symbol(&frame.function) } else { frame.function.clone() };
    let mut text = match (&frame.file, frame.line) {
        (Some(file), Some(line)) if line > 0 => format!("{function} ({file}:{line})"),
        (Some(file), _) => format!("{function} ({file})"),
        (None, _) => function,
    };
    if times > 1 {
        let _ = write!(text, " ×{times}");
    }
    text
}

/// A native symbol without its argument list and template arguments:
/// `c10d::ProcessGroupGloo::AsyncWork::wait` rather than a line of its own.
fn short_symbol(symbol: &str) -> String {
    let mut out = String::with_capacity(symbol.len());
    let mut depth = 0usize;
    let mut chars = symbol.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            // `operator()`, `operator<` and the like keep their name.
            '(' if out.ends_with("operator") && chars.peek() == Some(&')') => {
                out.push_str("()");
                chars.next();
            }
            '<' | '(' => depth += 1,
            '>' | ')' => depth = depth.saturating_sub(1),
            _ if depth == 0 => out.push(c),
            _ => {}
        }
    }
    let out = out.trim();
    out.strip_suffix(" const").unwrap_or(out).split(" [clone").next().unwrap_or(out).trim().to_owned()
}

/// The frames worth showing, innermost first, each with how many times it repeats
/// in a row (recursion): without the interpreter's start-up (`runpy`, `importlib`,
/// a thread's bootstrap), without the wrappers of decorators that only pass a call
/// on (`_exception_logger.<locals>.wrapper` around torch's collectives; the
/// innermost frame is kept whatever it is) and, when native frames are merged in,
/// without the native frames outside the outermost Python frame (`main`,
/// `Py_RunMain`, `start_thread`).
pub fn fold(frames: &[Frame]) -> Vec<(Frame, u32)> {
    let python = frames.iter().any(|f| !f.native);
    let outermost_python = frames.iter().rposition(|f| !f.native);
    let mut folded: Vec<(Frame, u32)> = Vec::new();
    for (i, frame) in frames.iter().enumerate() {
        let outside = python && frame.native && outermost_python.is_some_and(|o| i > o);
        if is_bootstrap(frame) || outside || (i > 0 && is_decorator_wrapper(frame)) {
            continue;
        }
        match folded.last_mut() {
            Some((last, times)) if last == frame => *times += 1,
            _ => folded.push((frame.clone(), 1)),
        }
    }
    folded
}

/// A function a decorator defined to wrap another: `deco.<locals>.wrapper`.
fn is_decorator_wrapper(frame: &Frame) -> bool {
    let Some((outer, name)) = frame.function.rsplit_once('.') else { return false };
    !frame.native && outer.ends_with("<locals>") && matches!(name, "wrapper" | "wrapped" | "inner" | "_wrapper")
}

fn is_bootstrap(frame: &Frame) -> bool {
    if frame.native {
        return false;
    }
    let file = frame.file.as_deref().unwrap_or("");
    let base = file.rsplit('/').next().unwrap_or(file);
    file.starts_with("<frozen importlib")
        || file.starts_with("<frozen runpy")
        || base == "runpy.py"
        || (base == "threading.py" && frame.function.ends_with("_bootstrap"))
        || (base == "threading.py" && frame.function.ends_with("_bootstrap_inner"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn py(frames: &[(&str, &str, u32)]) -> Captured {
        Captured::Python {
            pid: 1,
            thread: ThreadChoice::Main,
            thread_name: Some("MainThread".into()),
            threads: 1,
            native: false,
            frames: frames.iter().map(|&(f, file, line)| Frame::python(f, file, line)).collect(),
            stopped: false,
        }
    }

    fn rank(rank: u32, captured: Captured) -> RankStack {
        RankStack { rank, pid: 1000 + rank, captured }
    }

    fn all_reduce() -> Captured {
        py(&[
            ("all_reduce", "torch/distributed/distributed_c10d.py", 2950),
            ("train", "train.py", 42),
            ("<module>", "train.py", 60),
            ("_run_code", "<frozen runpy>", 88),
            ("_run_module_as_main", "<frozen runpy>", 198),
        ])
    }

    #[test]
    fn the_odd_rank_out_comes_first_and_identical_stacks_fold_with_their_rank_ranges() {
        let sleeping = py(&[("load_batch", "data.py", 17), ("train", "train.py", 40), ("<module>", "train.py", 60)]);
        let stacks = vec![rank(0, all_reduce()), rank(1, all_reduce()), rank(2, sleeping), rank(3, all_reduce())];
        let grouped = group(stacks);
        assert_eq!(grouped.ranks, 4);
        assert_eq!(grouped.groups.iter().map(|g| g.ranks.clone()).collect::<Vec<_>>(), [vec![2], vec![0, 1, 3]]);
        let text = render(&grouped, &Render { indent: String::new(), ..Render::default() });
        assert_eq!(
            text,
            "rank 2 (1 of 4):      load_batch (data.py:17) ← train (train.py:40) ← <module> (train.py:60)\n\
             ranks 0-1,3 (3 of 4): all_reduce (torch/distributed/distributed_c10d.py:2950) ← train (train.py:42) \
             ← <module> (train.py:60)\n"
        );
    }

    #[test]
    fn the_groups_of_several_nodes_merge_into_one_view() {
        let sleeping = py(&[("load_batch", "data.py", 17)]);
        let node0 = group(vec![rank(0, all_reduce()), rank(1, all_reduce())]);
        let node1 = group(vec![rank(2, sleeping), rank(3, all_reduce())]);
        let merged = Grouped::merge([node1, node0]);
        assert_eq!(merged.ranks, 4);
        assert_eq!(merged.groups.iter().map(|g| g.ranks.clone()).collect::<Vec<_>>(), [vec![2], vec![0, 1, 3]]);
        assert_eq!(
            merged,
            group(vec![
                rank(3, all_reduce()),
                rank(1, all_reduce()),
                rank(0, all_reduce()),
                rank(2, py(&[("load_batch", "data.py", 17)]))
            ])
        );
    }

    #[test]
    fn groups_of_one_size_are_ordered_by_their_lowest_rank() {
        let a = py(&[("a", "x.py", 1)]);
        let b = py(&[("b", "x.py", 2)]);
        let c = py(&[("c", "x.py", 3)]);
        let grouped = group(vec![
            rank(5, c.clone()),
            rank(4, b.clone()),
            rank(1, a.clone()),
            rank(0, b),
            rank(3, a),
            rank(2, c.clone()),
            rank(6, c),
        ]);
        let ranks: Vec<Vec<u32>> = grouped.groups.iter().map(|g| g.ranks.clone()).collect();
        assert_eq!(ranks, [vec![0, 4], vec![1, 3], vec![2, 5, 6]]);
    }

    #[test]
    fn rank_lists_are_ranges_and_stop_after_a_few_runs() {
        assert_eq!(rank_list(&[7]), "7");
        assert_eq!(rank_list(&[0, 1, 3]), "0-1,3");
        assert_eq!(rank_list(&[0, 1, 2, 3, 4, 5, 6, 7]), "0-7");
        assert_eq!(rank_list(&[1, 3, 4, 9, 10, 11]), "1,3-4,9-11");
        let evens: Vec<u32> = (0..100).map(|r| r * 2).collect();
        assert_eq!(rank_list(&evens), "0,2,4,6,8,10,12,14,…");
        assert_eq!(rank_list(&[u32::MAX - 1, u32::MAX]), format!("{}-{}", u32::MAX - 1, u32::MAX));
    }

    #[test]
    fn many_groups_stay_a_screenful_with_the_largest_group_last() {
        // 1,000 ranks: 900 in one all_reduce, 100 each at a line of their own.
        let mut stacks: Vec<RankStack> = (0..900).map(|r| rank(r, all_reduce())).collect();
        stacks.extend((900..1000).map(|r| rank(r, py(&[("step", "loop.py", r)]))));
        let grouped = group(stacks);
        assert_eq!(grouped.groups.len(), 101);
        let how = Render { max_groups: 10, ..Render::default() };
        let text = render(&grouped, &how);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 11, "{text}");
        let words = |line: &str| line.split_whitespace().collect::<Vec<_>>().join(" ");
        assert_eq!(words(lines[0]), "rank 900 (1 of 1000): step (loop.py:900)");
        assert!(words(lines[8]).starts_with("rank 908 (1 of 1000):"), "{text}");
        assert_eq!(lines[9], "  … 91 more groups (91 ranks) not shown");
        assert!(words(lines[10]).starts_with("ranks 0-899 (900 of 1000): all_reduce"), "{text}");
        // The labels line up.
        assert_eq!(lines[0].find("step"), lines[10].find("all_reduce"), "{text}");
    }

    #[test]
    fn start_up_frames_go_recursion_folds_and_long_stacks_lose_their_middle() {
        let mut frames = vec![Frame::python("fib", "r.py", 3); 40];
        frames.insert(0, Frame::python("base", "r.py", 1));
        frames.push(Frame::python("<module>", "r.py", 9));
        frames.push(Frame::python("_call_with_frames_removed", "<frozen importlib._bootstrap>", 241));
        frames.push(Frame::python("_run_code", "/usr/lib/python3.11/runpy.py", 86));
        let folded = fold(&frames);
        assert_eq!(
            folded,
            [
                (Frame::python("base", "r.py", 1), 1),
                (Frame::python("fib", "r.py", 3), 40),
                (Frame::python("<module>", "r.py", 9), 1)
            ]
        );
        let thread = py(&[
            ("wait", "threading.py", 320),
            ("run", "worker.py", 7),
            ("Thread.run", "threading.py", 982),
            ("Thread._bootstrap_inner", "threading.py", 1045),
            ("Thread._bootstrap", "threading.py", 1002),
        ]);
        assert_eq!(
            describe(&thread, 12),
            "wait (threading.py:320) ← run (worker.py:7) ← Thread.run (threading.py:982)"
        );
        let deep: Vec<(&str, &str, u32)> = (1..=30).map(|i| ("f", "d.py", i)).collect();
        let text = describe(&py(&deep), 6);
        assert_eq!(
            text,
            "f (d.py:1) ← f (d.py:2) ← f (d.py:3) ← … 24 frames … ← f (d.py:28) ← f (d.py:29) ← f (d.py:30)"
        );
    }

    #[test]
    fn decorator_wrappers_go_unless_innermost() {
        let wrapped = py(&[
            ("all_reduce", "torch/distributed/distributed_c10d.py", 2950),
            ("_exception_logger.<locals>.wrapper", "torch/distributed/c10d_logger.py", 83),
            ("train", "train.py", 42),
        ]);
        assert_eq!(
            describe(&wrapped, 12),
            "all_reduce (torch/distributed/distributed_c10d.py:2950) ← train (train.py:42)"
        );
        let stuck_in_wrapper = py(&[("retry.<locals>.wrapper", "util.py", 9), ("train", "train.py", 42)]);
        assert_eq!(describe(&stuck_in_wrapper, 12), "retry.<locals>.wrapper (util.py:9) ← train (train.py:42)");
    }

    #[test]
    fn native_frames_are_short_and_the_interpreters_own_start_is_left_out() {
        let native =
            |f: &str, file: &str| Frame { function: f.into(), file: Some(file.into()), line: None, native: true };
        let captured = Captured::Python {
            pid: 1,
            thread: ThreadChoice::Main,
            thread_name: None,
            threads: 3,
            native: true,
            frames: vec![
                native("__futex_abstimed_wait_common", "libc.so.6"),
                native(
                    "c10d::ProcessGroupGloo::AsyncWork::wait(std::chrono::duration<long, std::ratio<1l, 1000l> >)",
                    "libtorch_cpu.so",
                ),
                Frame::python("all_reduce", "torch/distributed/distributed_c10d.py", 2950),
                Frame::python("<module>", "train.py", 9),
                native("Py_RunMain", "libpython3.11.so.1.0"),
                native("__libc_start_main", "libc.so.6"),
            ],
            stopped: false,
        };
        assert_eq!(
            describe(&captured, 12),
            "__futex_abstimed_wait_common (libc.so.6) ← c10d::ProcessGroupGloo::AsyncWork::wait (libtorch_cpu.so) \
             ← all_reduce (torch/distributed/distributed_c10d.py:2950) ← <module> (train.py:9)"
        );
        assert_eq!(short_symbol("std::function<void ()>::operator()() const"), "std::function::operator()");
        assert_eq!(short_symbol("foo [clone .cold]"), "foo");
    }

    #[test]
    fn what_is_not_a_python_stack_is_said_so_and_grouped_apart() {
        let not_python = |pid| Captured::NotPython { pid, program: "sleep".into(), detail: None, stopped: false };
        let grouped = group(vec![
            rank(0, not_python(10)),
            rank(1, not_python(11)),
            rank(2, Captured::Gone),
            rank(3, Captured::Refused { reason: "kernel.yama.ptrace_scope is 3".into() }),
            rank(4, Captured::TimedOut { after_ms: 2000 }),
            rank(5, all_reduce()),
        ]);
        let text = render(&grouped, &Render { indent: String::new(), ..Render::default() });
        let lines: Vec<String> = text.lines().map(|l| l.split_whitespace().collect::<Vec<_>>().join(" ")).collect();
        assert_eq!(lines[0], "rank 2 (1 of 6): exited before its stack was read");
        assert_eq!(lines[1], "rank 3 (1 of 6): its stack cannot be read: kernel.yama.ptrace_scope is 3");
        assert_eq!(lines[2], "rank 4 (1 of 6): its stack could not be read within 2.0 s (given up)");
        assert_eq!(lines[4], "ranks 0-1 (2 of 6): not a Python process (sleep)", "pids do not split a group");
        let frozen = Captured::NotPython { pid: 9, program: "sleep".into(), detail: None, stopped: true };
        assert_eq!(describe(&frozen, 12), "[stopped] not a Python process (sleep)");
        let Captured::Python { frames, .. } = py(&[("main", "train.py", 21)]) else { unreachable!("built above") };
        let frozen = Captured::Python {
            pid: 1,
            thread: ThreadChoice::Main,
            thread_name: None,
            threads: 1,
            native: false,
            frames,
            stopped: true,
        };
        assert_eq!(describe(&frozen, 12), "[stopped] main (train.py:21)");
        let other_thread = Captured::Python {
            pid: 1,
            thread: ThreadChoice::GilHolder,
            thread_name: Some("loader".into()),
            threads: 2,
            native: false,
            frames: vec![Frame::python("spin", "l.py", 4)],
            stopped: false,
        };
        assert_eq!(
            describe(&other_thread, 12),
            "[thread 'loader', holding the GIL; the main thread runs no Python] spin (l.py:4)"
        );
    }

    #[test]
    fn grouped_stacks_are_plain_data() {
        let grouped = group(vec![rank(0, all_reduce()), rank(1, Captured::Gone)]);
        let json = serde_json::to_string(&grouped).expect("serializes");
        assert!(json.contains(r#""kind":"python""#) && json.contains(r#""kind":"gone""#), "{json}");
        let back: Grouped = serde_json::from_str(&json).expect("deserializes");
        assert_eq!(back, grouped);
        assert_eq!(render(&Grouped::default(), &Render::default()), "");
    }
}
