//! Plots of one run or several overlaid: TTFT and ITL distributions (CDFs), latency and throughput
//! against concurrency or request rate, and the cached-token ratio. Every plot is written twice, as SVG
//! (text as text, for documents) and as PNG (for viewers and Markdown).
//!
//! PNG text is rasterised from DejaVu Sans (a subset of the printable ASCII range, embedded from
//! `assets/`, licence in `assets/LICENSE-DejaVu.txt`), so plots need no system fonts.

use std::path::{Path, PathBuf};
use std::sync::Once;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::FontStyle;

use crate::report::{write_file, BenchRun};
use crate::BenchError;

const FONT: &[u8] = include_bytes!("../assets/DejaVuSans-subset.ttf");
const SIZE: (u32, u32) = (960, 600);

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        for style in [FontStyle::Normal, FontStyle::Bold] {
            // The font is compiled in; a failure here is a build defect, not bad input.
            plotters::style::register_font("sans-serif", style, FONT)
                .unwrap_or_else(|_| panic!("embedded DejaVu Sans subset is not a valid font"));
        }
    });
}

/// A vertical line on load plots, e.g. the KV pool size `kura plan` predicts.
#[derive(Debug, Clone, PartialEq)]
pub struct Mark {
    pub concurrency: f64,
    pub label: String,
}

#[derive(Debug, Clone)]
struct Series {
    label: String,
    color: usize,
    dashed: bool,
    markers: bool,
    points: Vec<(f64, f64)>,
}

#[derive(Debug, Clone)]
struct LineChart {
    title: String,
    x_label: String,
    y_label: String,
    series: Vec<Series>,
    mark: Option<Mark>,
}

#[derive(Debug, Clone)]
struct BarChart {
    title: String,
    x_label: String,
    bars: Vec<(String, f64)>,
}

trait Chart {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<(), String>;
}

fn err<E: std::fmt::Debug>(e: E) -> String {
    format!("{e:?}")
}

/// Axis labels without noise digits: 1200, 45, 3.5, 0.25.
fn tick(v: &f64) -> String {
    let a = v.abs();
    if a >= 10.0 || v.fract() == 0.0 {
        format!("{v:.0}")
    } else if a >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// The largest magnitude a plot's axis spans.
const AXIS_LIMIT: f64 = 1e15;

fn range(values: impl Iterator<Item = f64>, from_zero: bool) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    // Values past ±1e15 (an edited run.json, a mark of 1e308) are left off the axis: its margin
    // would overflow to infinity, on which the plotting library's tick search never ends.
    for v in values.filter(|v| v.is_finite() && v.abs() <= AXIS_LIMIT) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    if from_zero {
        lo = lo.min(0.0);
    }
    if hi - lo < 1e-9 {
        hi = lo + 1.0;
    }
    (lo, hi + (hi - lo) * 0.05)
}

impl Chart for LineChart {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<(), String> {
        root.fill(&WHITE).map_err(err)?;
        let mark_x = self.mark.as_ref().map(|m| m.concurrency);
        let (x0, x1) = range(
            self.series
                .iter()
                .flat_map(|s| s.points.iter().map(|p| p.0))
                .chain(mark_x),
            true,
        );
        let (y0, y1) = range(
            self.series
                .iter()
                .flat_map(|s| s.points.iter().map(|p| p.1)),
            true,
        );
        let mut chart = ChartBuilder::on(root)
            .caption(&self.title, ("sans-serif", 22))
            .margin(16)
            .x_label_area_size(48)
            .y_label_area_size(72)
            .build_cartesian_2d(x0..x1, y0..y1)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc(&self.x_label)
            .y_desc(&self.y_label)
            .x_label_formatter(&tick)
            .y_label_formatter(&tick)
            .label_style(("sans-serif", 14))
            .axis_desc_style(("sans-serif", 16))
            .light_line_style(RGBColor(235, 235, 235))
            .draw()
            .map_err(err)?;
        for s in &self.series {
            // Only what the axes span: a point past them would be rasterised across billions of
            // pixels.
            let points: Vec<(f64, f64)> = s
                .points
                .iter()
                .copied()
                .filter(|&(x, y)| (x0..=x1).contains(&x) && (y0..=y1).contains(&y))
                .collect();
            let color = COLORS[s.color % COLORS.len()];
            let style = color.stroke_width(2);
            let legend =
                move |(x, y): (i32, i32)| PathElement::new(vec![(x, y), (x + 20, y)], style);
            if s.dashed {
                let dashes = move |(x, y): (i32, i32)| {
                    EmptyElement::at((x, y))
                        + PathElement::new(vec![(0, 0), (6, 0)], style)
                        + PathElement::new(vec![(10, 0), (16, 0)], style)
                };
                chart
                    .draw_series(DashedLineSeries::new(points.iter().copied(), 6, 4, style))
                    .map_err(err)?
                    .label(&s.label)
                    .legend(dashes);
            } else {
                chart
                    .draw_series(LineSeries::new(points.iter().copied(), style))
                    .map_err(err)?
                    .label(&s.label)
                    .legend(legend);
            }
            if s.markers {
                chart
                    .draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))
                    .map_err(err)?;
            }
        }
        if let Some(mark) = self
            .mark
            .as_ref()
            .filter(|m| (x0..=x1).contains(&m.concurrency))
        {
            let style = BLACK.stroke_width(2);
            let points = vec![(mark.concurrency, y0), (mark.concurrency, y1)];
            chart
                .draw_series(DashedLineSeries::new(points, 8, 6, style))
                .map_err(err)?
                .label(format!("{} ({})", mark.label, mark.concurrency))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(160, 160, 160))
            .label_font(("sans-serif", 13))
            .draw()
            .map_err(err)?;
        root.present().map_err(err)
    }
}

impl Chart for BarChart {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<(), String> {
        root.fill(&WHITE).map_err(err)?;
        let n = self.bars.len();
        let labels: Vec<String> = self.bars.iter().map(|b| b.0.clone()).collect();
        let longest = labels.iter().map(|l| l.chars().count()).max().unwrap_or(4) as u32;
        let mut chart = ChartBuilder::on(root)
            .caption(&self.title, ("sans-serif", 22))
            .margin(16)
            .x_label_area_size(48)
            .y_label_area_size((longest * 8 + 16).clamp(60, 420))
            .build_cartesian_2d(0.0..100.0f64, -0.5..(n as f64 - 0.5))
            .map_err(err)?;
        let label_of = |y: &f64| {
            let i = y.round();
            if (y - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < n {
                labels[i as usize].clone()
            } else {
                String::new()
            }
        };
        chart
            .configure_mesh()
            .x_desc(&self.x_label)
            .y_labels(n.max(1) * 2 + 1)
            .y_label_formatter(&label_of)
            .disable_y_mesh()
            .x_label_formatter(&tick)
            .light_line_style(WHITE)
            .label_style(("sans-serif", 14))
            .axis_desc_style(("sans-serif", 16))
            .draw()
            .map_err(err)?;
        for (i, (_, v)) in self.bars.iter().enumerate() {
            let y = i as f64;
            let color = COLORS[i % COLORS.len()];
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [(0.0, y - 0.35), (v * 100.0, y + 0.35)],
                    color.filled(),
                )))
                .map_err(err)?;
            chart
                .draw_series(std::iter::once(Text::new(
                    format!("{:.1} %", v * 100.0),
                    ((v * 100.0 + 1.0).min(88.0), y + 0.1),
                    ("sans-serif", 14),
                )))
                .map_err(err)?;
        }
        root.present().map_err(err)
    }
}

fn save<C: Chart>(chart: &C, dir: &Path, stem: &str) -> Result<(), BenchError> {
    register_font();
    let plot_err = |detail: String| BenchError::Plot {
        plot: stem.to_string(),
        detail,
    };
    let svg = dir.join(format!("{stem}.svg"));
    {
        let root = SVGBackend::new(&svg, SIZE).into_drawing_area();
        chart.draw(&root).map_err(plot_err)?;
    }
    let (w, h) = SIZE;
    let mut rgb = vec![0u8; (w * h * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut rgb, SIZE).into_drawing_area();
        chart.draw(&root).map_err(plot_err)?;
    }
    let mut png_bytes = Vec::new();
    {
        let mut encoder = png::Encoder::new(&mut png_bytes, w, h);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        encoder.set_compression(png::Compression::Best);
        let mut writer = encoder
            .write_header()
            .map_err(|e| plot_err(e.to_string()))?;
        writer
            .write_image_data(&rgb)
            .map_err(|e| plot_err(e.to_string()))?;
    }
    write_file(&dir.join(format!("{stem}.png")), &png_bytes)
}

/// One distribution per run (per point when a run has several), as an empirical CDF.
fn cdf_series(
    runs: &[&BenchRun],
    values: fn(&crate::report::RequestRecord) -> Vec<f64>,
) -> Vec<Series> {
    let mut out = Vec::new();
    for (r, run) in runs.iter().enumerate() {
        for p in &run.points {
            let mut v: Vec<f64> = p
                .requests
                .iter()
                .filter(|q| q.error.is_none())
                .flat_map(values)
                .filter(|x| x.is_finite())
                .collect();
            if v.is_empty() {
                continue;
            }
            v.sort_by(f64::total_cmp);
            // At most ~400 points per curve keeps the SVG small without changing the picture.
            let step = v.len().div_ceil(400).max(1);
            let n = v.len() as f64;
            // A step curve from (first, 0) to (last, 1).
            let mut points: Vec<(f64, f64)> = Vec::with_capacity(2 * v.len().min(400) + 2);
            for (i, x) in v.iter().enumerate().step_by(step) {
                points.push((*x, i as f64 / n));
                points.push((*x, (i + step).min(v.len()) as f64 / n));
            }
            points.push((*v.last().unwrap_or(&0.0), 1.0));
            let label = if run.points.len() > 1 {
                format!("{} @ {}", run.label, p.load.describe())
            } else {
                run.label.clone()
            };
            out.push(Series {
                label,
                color: r * 3 + out.len() % 3,
                dashed: false,
                markers: false,
                points,
            });
        }
    }
    for (i, s) in out.iter_mut().enumerate() {
        s.color = i;
    }
    out
}

/// Writes the plots for `runs` into `dir`; returns (file stem, caption) of each plot written.
pub fn write_plots(
    runs: &[&BenchRun],
    dir: &Path,
    mark: Option<&Mark>,
) -> Result<Vec<(String, String)>, BenchError> {
    std::fs::create_dir_all(dir).map_err(|e| BenchError::Io {
        what: format!("creating {}", dir.display()),
        source: e,
    })?;
    let mut written = Vec::new();
    let ttft = cdf_series(runs, |q| q.ttft_ms.into_iter().collect());
    if !ttft.is_empty() {
        let chart = LineChart {
            title: "Time to first token (CDF)".into(),
            x_label: "TTFT (ms)".into(),
            y_label: "fraction of requests".into(),
            series: ttft,
            mark: None,
        };
        save(&chart, dir, "ttft_cdf")?;
        written.push(("ttft_cdf".to_string(), "TTFT distribution".to_string()));
    }
    let itl = cdf_series(runs, |q| q.itl_ms.clone());
    if !itl.is_empty() {
        let chart = LineChart {
            title: "Inter-token latency (CDF)".into(),
            x_label: "ITL (ms)".into(),
            y_label: "fraction of gaps".into(),
            series: itl,
            mark: None,
        };
        save(&chart, dir, "itl_cdf")?;
        written.push(("itl_cdf".to_string(), "ITL distribution".to_string()));
    }
    // Load sweeps: one x axis per kind of load (concurrency or rate).
    for (axis, stem) in [
        ("concurrency", "concurrency"),
        ("request rate (req/s)", "rate"),
    ] {
        let swept: Vec<&&BenchRun> = runs
            .iter()
            .filter(|r| {
                r.points
                    .iter()
                    .filter(|p| p.load.x().map(|x| x.1) == Some(axis))
                    .count()
                    >= 2
            })
            .collect();
        if swept.is_empty() {
            continue;
        }
        let mark = if axis == "concurrency" {
            mark.cloned()
        } else {
            None
        };
        let mut latency = Vec::new();
        let mut itl = Vec::new();
        let mut throughput = Vec::new();
        for (i, run) in swept.iter().enumerate() {
            let pts: Vec<(f64, &crate::stats::Summary)> = run
                .points
                .iter()
                .filter_map(|p| {
                    p.load
                        .x()
                        .filter(|x| x.1 == axis)
                        .map(|x| (x.0, &p.summary))
                })
                .collect();
            let line =
                |label: String, dashed: bool, f: &dyn Fn(&crate::stats::Summary) -> Option<f64>| {
                    Series {
                        label,
                        color: i,
                        dashed,
                        markers: true,
                        points: pts.iter().filter_map(|(x, s)| Some((*x, f(s)?))).collect(),
                    }
                };
            latency.push(line(format!("{} TTFT p50", run.label), false, &|s| {
                s.ttft_ms.map(|d| d.p50)
            }));
            latency.push(line(format!("{} TTFT p99", run.label), true, &|s| {
                s.ttft_ms.map(|d| d.p99)
            }));
            itl.push(line(format!("{} ITL p50", run.label), false, &|s| {
                s.itl_ms.map(|d| d.p50)
            }));
            itl.push(line(format!("{} ITL p99", run.label), true, &|s| {
                s.itl_ms.map(|d| d.p99)
            }));
            throughput.push(line(format!("{} output tok/s", run.label), false, &|s| {
                Some(s.output_tok_per_s)
            }));
        }
        let chart = LineChart {
            title: format!("TTFT vs {axis}"),
            x_label: axis.into(),
            y_label: "TTFT (ms)".into(),
            series: latency,
            mark: mark.clone(),
        };
        save(&chart, dir, &format!("latency_vs_{stem}"))?;
        written.push((
            format!("latency_vs_{stem}"),
            format!("TTFT p50/p99 vs {axis}"),
        ));
        let chart = LineChart {
            title: format!("Inter-token latency vs {axis}"),
            x_label: axis.into(),
            y_label: "ITL (ms)".into(),
            series: itl,
            mark: mark.clone(),
        };
        save(&chart, dir, &format!("itl_vs_{stem}"))?;
        written.push((format!("itl_vs_{stem}"), format!("ITL p50/p99 vs {axis}")));
        let chart = LineChart {
            title: format!("Output throughput vs {axis}"),
            x_label: axis.into(),
            y_label: "output tokens/s".into(),
            series: throughput,
            mark,
        };
        save(&chart, dir, &format!("throughput_vs_{stem}"))?;
        written.push((
            format!("throughput_vs_{stem}"),
            format!("output tokens/s vs {axis}"),
        ));
    }
    let bars: Vec<(String, f64)> = runs
        .iter()
        .flat_map(|run| {
            run.points.iter().filter_map(move |p| {
                let ratio = p.summary.cached_token_ratio?;
                let label = if run.points.len() > 1 {
                    format!("{} @ {}", run.label, p.load.describe())
                } else {
                    run.label.clone()
                };
                Some((label, ratio))
            })
        })
        .collect();
    if !bars.is_empty() {
        let chart = BarChart {
            title: "Prompt tokens served from the prefix cache".into(),
            x_label: "cached tokens / prompt tokens (%)".into(),
            bars,
        };
        save(&chart, dir, "cached_ratio")?;
        written.push(("cached_ratio".to_string(), "cached-token ratio".to_string()));
    }
    Ok(written)
}

/// The plot directory of a report directory.
pub fn plots_dir(out: &Path) -> PathBuf {
    out.join("plots")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axes_stay_finite_whatever_the_values() {
        for values in [
            vec![1.0, 1.75e308],
            vec![f64::MAX, f64::MIN],
            vec![f64::NAN, f64::INFINITY],
            vec![],
        ] {
            let (lo, hi) = range(values.into_iter(), true);
            assert!(lo.is_finite() && hi.is_finite() && lo < hi, "{lo} {hi}");
        }
        assert_eq!(range([2.0, 4.0].into_iter(), false), (2.0, 4.1));
    }

    /// A mark or values near f64::MAX made the axis margin infinite, and drawing never returned.
    #[test]
    fn a_chart_of_absurd_values_is_drawn() {
        register_font();
        let chart = LineChart {
            title: "t".into(),
            x_label: "x".into(),
            y_label: "y".into(),
            series: vec![Series {
                label: "s".into(),
                color: 0,
                dashed: false,
                markers: true,
                points: vec![(1.0, 5.0), (2.0, 1.7e308)],
            }],
            mark: Some(Mark {
                concurrency: 1.75e308,
                label: "m".into(),
            }),
        };
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
            chart.draw(&root).unwrap();
        }
        assert!(svg.contains("<svg"), "{svg}");
    }
}
