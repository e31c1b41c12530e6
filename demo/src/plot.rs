//! The PNG plots: test accuracy against step (left) and against cumulative bytes sent per
//! worker (right, log scale), one curve per method (mean over seeds): [`draw`]; and test
//! accuracy against seconds of training, one panel per network link: [`draw_time_panels`]
//! (the slow-network report's plot, example `netsim_plot`).
//!
//! Text is drawn with DejaVu Sans, embedded from `assets/` (see its licence file there), so
//! plotting needs no system fontconfig.

use std::path::Path;
use std::sync::OnceLock;

use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

use crate::DemoError;
use crate::report::{MethodResult, Report};

const FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");
const FAMILY: &str = "sans-serif";

/// One colour per method of the default list (`Method::ALL`), so that no two share one.
const COLORS: [RGBColor; 15] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
    RGBColor(188, 189, 34),
    RGBColor(127, 127, 127),
    RGBColor(0, 0, 0),
    RGBColor(0, 0, 139),
    RGBColor(139, 0, 0),
    RGBColor(0, 100, 0),
    RGBColor(255, 20, 147),
];

fn register() -> Result<(), DemoError> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    if *REGISTERED.get_or_init(|| register_font(FAMILY, FontStyle::Normal, FONT).is_ok()) {
        Ok(())
    } else {
        Err(DemoError::Plot("the embedded font cannot be read".into()))
    }
}

fn plot_error<E: std::fmt::Display>(e: E) -> DemoError {
    DemoError::Plot(e.to_string())
}

/// One point of a mean curve: (step, cumulative bytes per worker, test accuracy in percent).
type Point = (f64, f64, f64);

/// The mean curve of a method over its seeds.
fn mean_curve(m: &MethodResult) -> Vec<Point> {
    let Some(first) = m.runs.first() else {
        return Vec::new();
    };
    #[allow(clippy::cast_precision_loss)]
    let n = m.runs.len() as f64;
    (0..first.curve.len())
        .filter(|&i| m.runs.iter().all(|r| r.curve.len() > i))
        .map(|i| {
            let acc = m
                .runs
                .iter()
                .map(|r| f64::from(r.curve[i].test_accuracy))
                .sum::<f64>()
                / n;
            let bytes = m
                .runs
                .iter()
                .map(|r| r.curve[i].bytes_per_worker)
                .sum::<f64>()
                / n;
            #[allow(clippy::cast_precision_loss)]
            let step = first.curve[i].step as f64;
            (step, bytes, 100.0 * acc)
        })
        .collect()
}

/// Draws the two-panel plot of `report` into a PNG file at `path`.
///
/// # Errors
/// [`DemoError::Plot`] when drawing or writing the file fails.
pub fn draw(report: &Report, path: &Path) -> Result<(), DemoError> {
    register()?;
    let curves: Vec<(&MethodResult, Vec<Point>)> =
        report.results.iter().map(|m| (m, mean_curve(m))).collect();
    #[allow(clippy::cast_precision_loss)]
    let steps = report.config.train.steps.max(1) as f64;
    let max_bytes = curves
        .iter()
        .flat_map(|(_, c)| c.iter().map(|p| p.1))
        .fold(1.0f64, f64::max);
    let min_bytes = curves
        .iter()
        .flat_map(|(_, c)| c.iter().map(|p| p.1))
        .filter(|&b| b > 0.0)
        .fold(max_bytes, f64::min);

    let root = BitMapBackend::new(path, (1400, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_error)?;
    let title = format!(
        "MLP on digits, {} workers, mean of {} seed(s)",
        report.config.workers,
        report.config.seeds.len()
    );
    let root = root.titled(&title, (FAMILY, 24)).map_err(plot_error)?;
    let (left, right) = root.split_horizontally(700);

    let mut chart = ChartBuilder::on(&left)
        .caption("test accuracy against step", (FAMILY, 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..steps, 0.0..100.0)
        .map_err(plot_error)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("test accuracy (%)")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .label_style((FAMILY, 13))
        .draw()
        .map_err(plot_error)?;
    for (i, (m, c)) in curves.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(
                c.iter().map(|&(s, _, a)| (s, a)),
                color.stroke_width(2),
            ))
            .map_err(plot_error)?
            .label(m.method.name())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .label_font((FAMILY, 13))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(plot_error)?;

    let mut chart = ChartBuilder::on(&right)
        .caption("test accuracy against bytes sent per worker", (FAMILY, 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((min_bytes * 0.8..max_bytes * 1.25).log_scale(), 0.0..100.0)
        .map_err(plot_error)?;
    chart
        .configure_mesh()
        .x_desc("cumulative bytes sent per worker (log scale)")
        .x_labels(6)
        .y_desc("test accuracy (%)")
        .x_label_formatter(&|b| human_bytes(*b))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .label_style((FAMILY, 13))
        .draw()
        .map_err(plot_error)?;
    for (i, (_, c)) in curves.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(
                c.iter().filter(|p| p.1 > 0.0).map(|&(_, b, a)| (b, a)),
                color.stroke_width(2),
            ))
            .map_err(plot_error)?;
    }
    root.present().map_err(plot_error)?;
    Ok(())
}

/// One panel of [`draw_time_panels`]: a title and named curves of (seconds, test accuracy %).
#[derive(Debug, Clone, PartialEq)]
pub struct TimePanel {
    /// The panel's caption (e.g. the link).
    pub title: String,
    /// One curve per run: its label and its points (seconds of training > 0, accuracy in %).
    pub curves: Vec<(String, Vec<(f64, f64)>)>,
}

/// Test accuracy against wall-clock seconds of training (log scale), one panel per entry of
/// `panels` (two per row), written as a PNG to `path`. Points at 0 s are left out (the log
/// axis has no 0).
///
/// # Errors
/// [`DemoError::Plot`] when drawing or writing the file fails, or for no panel.
pub fn draw_time_panels(title: &str, panels: &[TimePanel], path: &Path) -> Result<(), DemoError> {
    register()?;
    if panels.is_empty() {
        return Err(DemoError::Plot("no panel to draw".into()));
    }
    let rows = panels.len().div_ceil(2);
    let height = u32::try_from(60 + 420 * rows).unwrap_or(u32::MAX);
    let root = BitMapBackend::new(path, (1400, height)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_error)?;
    let root = root.titled(title, (FAMILY, 24)).map_err(plot_error)?;
    let areas = root.split_evenly((rows, 2));
    for (panel, area) in panels.iter().zip(&areas) {
        let xs = || panel.curves.iter().flat_map(|(_, c)| c.iter().map(|p| p.0));
        let max_s = xs().fold(1e-3f64, f64::max);
        let min_s = xs().filter(|&s| s > 0.0).fold(max_s, f64::min);
        let mut chart = ChartBuilder::on(area)
            .caption(&panel.title, (FAMILY, 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d((min_s * 0.8..max_s * 1.25).log_scale(), 0.0..100.0)
            .map_err(plot_error)?;
        chart
            .configure_mesh()
            .x_desc("seconds of training (log scale)")
            .x_labels(8)
            .y_desc("test accuracy (%)")
            .x_label_formatter(&|s| seconds(*s))
            .y_label_formatter(&|y| format!("{y:.0}"))
            .label_style((FAMILY, 13))
            .draw()
            .map_err(plot_error)?;
        for (i, (label, c)) in panel.curves.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            chart
                .draw_series(LineSeries::new(
                    c.iter().copied().filter(|p| p.0 > 0.0),
                    color.stroke_width(2),
                ))
                .map_err(plot_error)?
                .label(label)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .label_font((FAMILY, 12))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(plot_error)?;
    }
    root.present().map_err(plot_error)?;
    Ok(())
}

/// Seconds with as many decimals as a log axis needs: `250`, `2.5`, `0.25`.
fn seconds(s: f64) -> String {
    if s >= 10.0 {
        format!("{s:.0}")
    } else if s >= 1.0 {
        format!("{s:.1}")
    } else {
        format!("{s:.2}")
    }
}

/// A byte count with its unit and up to three significant digits: `340 kB`, `1.5 MB`.
fn human_bytes(b: f64) -> String {
    let (v, unit) = if b >= 1e9 {
        (b / 1e9, "GB")
    } else if b >= 1e6 {
        (b / 1e6, "MB")
    } else if b >= 1e3 {
        (b / 1e3, "kB")
    } else {
        (b, "B")
    };
    if v >= 100.0 || unit == "B" {
        format!("{v:.0} {unit}")
    } else if v >= 10.0 {
        format!("{v:.1} {unit}")
    } else {
        format!("{v:.2} {unit}")
    }
}

#[cfg(test)]
mod tests {
    use super::{COLORS, human_bytes};
    use crate::codec::Method;

    #[test]
    fn every_default_method_has_a_colour_of_its_own() {
        assert!(Method::ALL.len() <= COLORS.len());
        for (i, a) in COLORS.iter().enumerate() {
            assert!(!COLORS[i + 1..].contains(a), "colour {i} appears twice");
        }
    }

    #[test]
    fn bytes_read_well() {
        assert_eq!(human_bytes(340_008.0), "340 kB");
        assert_eq!(human_bytes(1.5e6), "1.50 MB");
        assert_eq!(human_bytes(25_500_000.0), "25.5 MB");
        assert_eq!(human_bytes(12.0), "12 B");
    }
}
