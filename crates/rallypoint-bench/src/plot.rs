//! `rallypoint bench plot`: barrier round time against N, one line per system, on
//! log-log axes, drawn to a PNG from the JSON lines the benchmarks print.
//!
//! Rendering is pure Rust (plotters' bitmap backend and its `ab_glyph` text), so it
//! needs no system library; only a TrueType/OpenType font file for the labels, found
//! at run time (`--font`, or the usual font directories).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{bail, ensure, Context};
use plotters::prelude::*;
use serde_json::Value;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// JSON lines, one measurement each: `{"system": "rallypoint", "n": 1024,
    /// "median_us": ..., "mean_us": ...}`; lines without these fields are skipped
    #[arg(long, value_name = "PATH")]
    input: PathBuf,
    /// The PNG to write
    #[arg(long, value_name = "PATH")]
    output: PathBuf,
    /// Which round time to plot
    #[arg(long, value_enum, default_value_t = Stat::Median)]
    stat: Stat,
    /// Title above the chart
    #[arg(long, default_value = "Barrier round time vs N")]
    title: String,
    /// TrueType/OpenType font for the labels [default: the first suitable one under
    /// /usr/share/fonts, /usr/local/share/fonts, ~/.local/share/fonts or ~/.fonts]
    #[arg(long, value_name = "PATH", env = "RALLYPOINT_PLOT_FONT")]
    font: Option<PathBuf>,
    /// Width of the image, in pixels
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(200..=10_000))]
    width: u32,
    /// Height of the image, in pixels
    #[arg(long, default_value_t = 650, value_parser = clap::value_parser!(u32).range(150..=10_000))]
    height: u32,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
enum Stat {
    /// Median round time (`median_us`)
    Median,
    /// Mean round time (`mean_us`)
    Mean,
}

impl Stat {
    fn field(self) -> &'static str {
        match self {
            Stat::Median => "median_us",
            Stat::Mean => "mean_us",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Stat::Median => "median",
            Stat::Mean => "mean",
        }
    }
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&args.input).with_context(|| format!("reading {}", args.input.display()))?;
    let (series, skipped) = parse(&text, args.stat);
    ensure!(
        !series.is_empty(),
        "{} has no line with \"system\", \"n\" and \"{}\" to plot",
        args.input.display(),
        args.stat.field()
    );
    if skipped > 0 {
        let (input, field) = (args.input.display(), args.stat.field());
        eprintln!("rallypoint: skipped {skipped} line(s) of {input} without a system, n and {field}");
    }
    let extension = args.output.extension().and_then(|e| e.to_str()).unwrap_or_default();
    ensure!(extension.eq_ignore_ascii_case("png"), "the output must be a .png file, not {}", args.output.display());
    let font = load_font(args.font.as_deref())?;
    let root = BitMapBackend::new(&args.output, (args.width, args.height)).into_drawing_area();
    draw(&root, &series, args.stat, &args.title)?;
    root.present().with_context(|| format!("writing {}", args.output.display()))?;
    let points: usize = series.iter().map(|s| s.points.len()).sum();
    eprintln!(
        "rallypoint: wrote {} ({} system(s), {points} point(s), font {})",
        args.output.display(),
        series.len(),
        font.display()
    );
    Ok(())
}

/// One line of the chart.
#[derive(Debug, Clone, PartialEq)]
struct Series {
    system: String,
    /// (N, round time in µs), by N.
    points: Vec<(f64, f64)>,
}

/// The series in `text`, in the order their systems first appear, and how many
/// non-blank lines were skipped (not JSON, or without `system`, a positive `n`, or a
/// positive `stat`). Several values for one system and N (repeated runs) are
/// plotted as their median.
fn parse(text: &str, stat: Stat) -> (Vec<Series>, usize) {
    let mut order: Vec<String> = Vec::new();
    let mut values: BTreeMap<String, BTreeMap<u64, Vec<f64>>> = BTreeMap::new();
    let mut skipped = 0;
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let Ok(record) = serde_json::from_str::<Value>(line) else {
            skipped += 1;
            continue;
        };
        let system = record.get("system").and_then(Value::as_str);
        let n = record.get("n").and_then(Value::as_u64).filter(|&n| n > 0);
        let value = record.get(stat.field()).and_then(Value::as_f64).filter(|v| v.is_finite() && *v > 0.0);
        let (Some(system), Some(n), Some(value)) = (system, n, value) else {
            skipped += 1;
            continue;
        };
        if !values.contains_key(system) {
            order.push(system.to_owned());
        }
        values.entry(system.to_owned()).or_default().entry(n).or_default().push(value);
    }
    let series = order
        .into_iter()
        .map(|system| {
            let points = values
                .remove(&system)
                .unwrap_or_default()
                .into_iter()
                .map(|(n, mut runs)| (n as f64, median(&mut runs)))
                .collect();
            Series { system, points }
        })
        .collect();
    (series, skipped)
}

/// The median of a non-empty set (the mean of the middle two for an even count).
fn median(values: &mut [f64]) -> f64 {
    values.sort_unstable_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len() % 2 == 1 {
        values[mid]
    } else {
        (values[mid - 1] + values[mid]) / 2.0
    }
}

/// Line colours, in order of the systems (Tableau 10: distinct, and readable in print).
const COLOURS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, plotters::coord::Shift>,
    series: &[Series],
    stat: Stat,
    title: &str,
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let points = || series.iter().flat_map(|s| s.points.iter().copied());
    let x_range = log_range(points().map(|p| p.0)).context("no points to plot")?;
    let y_range = log_range(points().map(|p| p.1)).context("no points to plot")?;

    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 28))
        .margin(16)
        .x_label_area_size(56)
        .y_label_area_size(84)
        .build_cartesian_2d(x_range.log_scale(), y_range.log_scale())?;
    chart
        .configure_mesh()
        .x_desc("N (ranks in the barrier)")
        .y_desc(format!("round time ({}, log scale)", stat.name()))
        .x_labels(30)
        .y_labels(30)
        .x_label_formatter(&|&n| if is_125(n) { count(n) } else { String::new() })
        .y_label_formatter(&|&us| if is_125(us) { duration(us) } else { String::new() })
        .label_style(("sans-serif", 16))
        .axis_desc_style(("sans-serif", 18))
        .light_line_style(RGBColor(235, 235, 235))
        .bold_line_style(RGBColor(200, 200, 200))
        .draw()?;

    for (i, s) in series.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let line = ShapeStyle::from(&colour).stroke_width(3);
        chart
            .draw_series(LineSeries::new(s.points.iter().copied(), line))?
            .label(s.system.as_str())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 24, y)], line));
        chart.draw_series(s.points.iter().map(|&p| Circle::new(p, 5, colour.filled())))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font(("sans-serif", 18))
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .margin(12)
        .draw()?;
    Ok(())
}

/// An axis range around `values` with some room on a log scale, never empty.
fn log_range(values: impl Iterator<Item = f64>) -> Option<std::ops::Range<f64>> {
    let (lo, hi) = values.fold((f64::INFINITY, 0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if !(lo.is_finite() && lo > 0.0) {
        return None;
    }
    // A quarter of a decade either side: points stay clear of the frame.
    let pad = 10f64.powf(0.25);
    Some(lo / pad..hi * pad)
}

/// Whether `v` is 1, 2 or 5 times a power of ten: the labelled grid lines.
fn is_125(v: f64) -> bool {
    if !(v.is_finite() && v > 0.0) {
        return false;
    }
    let mantissa = v / 10f64.powf(v.log10().floor());
    [1.0, 2.0, 5.0, 10.0].iter().any(|m| (mantissa - m).abs() < 1e-6 * m)
}

/// `n` as an integer with thousands separators: `16,384`.
fn count(n: f64) -> String {
    let digits = format!("{:.0}", n.round());
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Microseconds in the unit that reads best: `50 µs`, `2 ms`, `1.5 s`.
fn duration(us: f64) -> String {
    let (value, unit) = match us {
        us if us < 1e3 => (us, "µs"),
        us if us < 1e6 => (us / 1e3, "ms"),
        us => (us / 1e6, "s"),
    };
    let mut text = String::new();
    // Up to three significant digits, without trailing zeros.
    let decimals = if value >= 100.0 {
        0
    } else if value >= 10.0 {
        1
    } else {
        2
    };
    let _ = write!(text, "{value:.decimals$}");
    if text.contains('.') {
        let trimmed = text.trim_end_matches('0').trim_end_matches('.').len();
        text.truncate(trimmed);
    }
    format!("{text} {unit}")
}

/// Directories searched for a font when none is given.
fn font_dirs() -> Vec<PathBuf> {
    let mut dirs = vec![PathBuf::from("/usr/share/fonts"), PathBuf::from("/usr/local/share/fonts")];
    if let Some(data) = std::env::var_os("XDG_DATA_HOME") {
        dirs.push(PathBuf::from(data).join("fonts"));
    }
    if let Some(home) = std::env::var_os("HOME") {
        let home = PathBuf::from(home);
        dirs.push(home.join(".local/share/fonts"));
        dirs.push(home.join(".fonts"));
    }
    dirs
}

/// Font files under `dir` (a few levels deep), best candidates for chart labels first.
fn font_candidates(dirs: &[PathBuf]) -> Vec<PathBuf> {
    fn walk(dir: &Path, depth: u32, found: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                if depth < 6 {
                    walk(&path, depth + 1, found);
                }
            } else {
                let extension = path.extension().and_then(|e| e.to_str()).unwrap_or_default();
                if extension.eq_ignore_ascii_case("ttf") || extension.eq_ignore_ascii_case("otf") {
                    found.push(path);
                }
            }
        }
    }
    let mut found = Vec::new();
    for dir in dirs {
        walk(dir, 0, &mut found);
    }
    // Plain upright sans-serif faces first, DejaVu Sans (Debian's default) above all.
    let rank = |path: &PathBuf| {
        let name = path.file_stem().and_then(|s| s.to_str()).unwrap_or_default().to_ascii_lowercase();
        let styled =
            ["bold", "italic", "oblique", "light", "thin", "condensed", "mono", "math", "serif-", "extralight"]
                .iter()
                .any(|s| name.contains(s));
        let preferred = ["dejavusans", "liberationsans-regular", "notosans-regular", "freesans", "arial"]
            .iter()
            .position(|p| name == *p)
            .unwrap_or(usize::MAX);
        (styled, preferred, !name.contains("sans"), name)
    };
    found.sort_by_cached_key(rank);
    found
}

/// Registers a font as plotters' "sans-serif" (once per process); returns its path.
fn load_font(explicit: Option<&Path>) -> anyhow::Result<&'static Path> {
    static LOADED: OnceLock<PathBuf> = OnceLock::new();
    if let Some(path) = LOADED.get() {
        return Ok(path);
    }
    let candidates = match explicit {
        Some(path) => vec![path.to_owned()],
        None => font_candidates(&font_dirs()),
    };
    let mut rejected = Vec::new();
    for path in candidates {
        let bytes = match std::fs::read(&path) {
            Ok(bytes) => bytes,
            Err(err) => {
                rejected.push(format!("{}: {err}", path.display()));
                continue;
            }
        };
        // TrueType (0x00010000 or "true") or OpenType ("OTTO") outlines.
        if !matches!(bytes.get(..4), Some([0, 1, 0, 0] | b"true" | b"OTTO")) {
            rejected.push(format!("{}: not a TrueType or OpenType font", path.display()));
            continue;
        }
        // plotters keeps fonts for the life of the process; this happens once.
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        match plotters::style::register_font("sans-serif", FontStyle::Normal, bytes) {
            Ok(()) => return Ok(LOADED.get_or_init(|| path)),
            Err(_) => rejected.push(format!("{}: its font tables cannot be read", path.display())),
        }
    }
    if let Some(path) = explicit {
        bail!("cannot use the font {}: {}", path.display(), rejected.join("; "));
    }
    let searched: Vec<String> = font_dirs().iter().map(|d| d.display().to_string()).collect();
    let mut message = format!(
        "no usable TrueType/OpenType font under {}: pass one with --font PATH (or RALLYPOINT_PLOT_FONT), \
         or install one (Debian/Ubuntu: apt-get install fonts-dejavu-core)",
        searched.join(", ")
    );
    if !rejected.is_empty() {
        let _ = write!(message, "; rejected: {}", rejected.join("; "));
    }
    bail!(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = r#"
{"system":"rallypoint","n":2,"median_us":60.0,"mean_us":70.0}
{"system":"torch-server","n":2,"median_us":400.0,"mean_us":420.0}
not json at all
{"op":"barrier","clients":64,"median_us":800.0}
{"system":"rallypoint","n":1024,"median_us":17000.0,"mean_us":17300.0}
{"system":"rallypoint","n":64,"median_us":800.0,"mean_us":850.0}
{"system":"rallypoint","n":64,"median_us":900.0,"mean_us":950.0}
{"system":"rallypoint","n":64,"median_us":1300.0,"mean_us":1000.0}
{"system":"torch-server","n":1024,"median_us":900000.0}
{"system":"torch-server","n":0,"median_us":5.0,"mean_us":5.0}
"#;

    #[test]
    fn parses_series_in_order_and_skips_the_rest() {
        let (series, skipped) = parse(SAMPLE, Stat::Median);
        assert_eq!(skipped, 3, "the text line, the line without system/n, and n = 0");
        assert_eq!(
            series,
            vec![
                Series { system: "rallypoint".into(), points: vec![(2.0, 60.0), (64.0, 900.0), (1024.0, 17000.0)] },
                Series { system: "torch-server".into(), points: vec![(2.0, 400.0), (1024.0, 900000.0)] },
            ]
        );
        // Without a mean, torch's 1,024 line no longer counts.
        let (series, skipped) = parse(SAMPLE, Stat::Mean);
        assert_eq!(skipped, 4);
        assert_eq!(series[0].points[1], (64.0, 950.0));
        assert_eq!(series[1].points, vec![(2.0, 420.0)]);
    }

    #[test]
    fn labels() {
        assert_eq!(count(2.0), "2");
        assert_eq!(count(1024.0), "1,024");
        assert_eq!(count(100_000.0), "100,000");
        assert_eq!(duration(50.0), "50 µs");
        assert_eq!(duration(2.5), "2.5 µs");
        assert_eq!(duration(1000.0), "1 ms");
        assert_eq!(duration(20_000.0), "20 ms");
        assert_eq!(duration(1_500_000.0), "1.5 s");
        assert!(is_125(1.0) && is_125(20.0) && is_125(5000.0) && is_125(0.2));
        assert!(!is_125(3.0) && !is_125(700.0) && !is_125(0.0));
    }

    #[test]
    fn ranges_are_padded_and_never_empty() {
        let r = log_range([64.0, 64.0].into_iter()).unwrap();
        assert!(r.start < 64.0 && r.end > 64.0);
        assert!(log_range(std::iter::empty()).is_none());
    }

    #[test]
    fn fonts_rank_plain_sans_first() {
        let dir = std::env::temp_dir().join(format!("rallypoint-fonts-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        for name in ["DejaVuSans-Bold.ttf", "sub/DejaVuSans.ttf", "Zeta-Serif.otf", "readme.txt"] {
            std::fs::write(dir.join(name), b"").unwrap();
        }
        let found = font_candidates(std::slice::from_ref(&dir));
        let names: Vec<_> = found.iter().map(|p| p.file_name().unwrap().to_str().unwrap()).collect();
        assert_eq!(names, ["DejaVuSans.ttf", "Zeta-Serif.otf", "DejaVuSans-Bold.ttf"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn draws_a_chart() {
        // Rendering needs a font file; machines without any skip this test.
        if let Err(err) = load_font(None) {
            eprintln!("skipped: {err}");
            return;
        }
        let (series, _) = parse(SAMPLE, Stat::Median);
        let (w, h) = (640u32, 400u32);
        let mut pixels = vec![0u8; (w * h * 3) as usize];
        {
            let root = BitMapBackend::with_buffer(&mut pixels, (w, h)).into_drawing_area();
            draw(&root, &series, Stat::Median, "test").unwrap();
            root.present().unwrap();
        }
        let colour = |c: RGBColor| pixels.chunks(3).filter(|p| p == &[c.0, c.1, c.2]).count();
        assert!(colour(COLOURS[0]) > 100, "the first series is drawn");
        assert!(colour(COLOURS[1]) > 100, "the second series is drawn");
        let dark = pixels.chunks(3).filter(|p| p[0] < 60 && p[1] < 60 && p[2] < 60).count();
        assert!(dark > 500, "text and axes are drawn");
    }
}
