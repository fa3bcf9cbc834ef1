//! The sweep chart of `infera replay --plot`.
//!
//! Layout: a title and one legend for the whole figure on top, then one panel per entry of
//! [`METRICS`], two to a row. The x-axis is one swept parameter: the last `--sweep` whose values
//! are all numbers (sorted ascending), else the last `--sweep` (values in the order given); its
//! values sit evenly spaced. Each value of the other swept parameters (each combination, when
//! there are several) is one series: one line with a dot at each configuration, in the same
//! colour in every panel; earlier series have larger dots, so that equal values still show every
//! colour. Wide x values are staggered over up to four rows (and only every n-th is written past
//! that). A configuration that lacks the x parameter is left out; a value that is not finite
//! leaves a gap in its line.

use super::{
    FAMILY, Figure, GRID, LABEL_PX, PALETTE, TITLE_H, WIDTH, font, nice_ceiling, shorten,
    text_width, tick,
};
use crate::report::Summary;
use crate::sweep::SweepAxis;
use plotters::coord::Shift;
use plotters::coord::ranged1d::{KeyPointHint, NoDefaultFormatting, Ranged, ValueFormatter};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::ops::Range;

/// One configuration of a sweep: its `key=value` pairs (as [`crate::sweep::Point::values`])
/// and its results.
#[derive(Debug, Clone, Copy)]
pub struct SweepRun<'a> {
    pub values: &'a [(String, String)],
    pub summary: &'a Summary,
}

/// A panel of the sweep chart: its title and how to read its value off a summary.
#[derive(Debug)]
pub struct Metric {
    pub title: &'static str,
    /// Where the y-axis starts at most (it starts lower if a value is lower).
    pub floor: f64,
    pub value: fn(&Summary) -> f64,
}

/// The panels, in order (row by row).
pub const METRICS: [Metric; 6] = [
    Metric {
        title: "block hit rate (%)",
        floor: 0.0,
        value: |s| s.hit_rate * 100.0,
    },
    Metric {
        title: "TTFT p50 (ms)",
        floor: 0.0,
        value: |s| s.ttft_p50_ms,
    },
    Metric {
        title: "TTFT p99 (ms)",
        floor: 0.0,
        value: |s| s.ttft_p99_ms,
    },
    Metric {
        title: "TPOT p50 (ms)",
        floor: 0.0,
        value: |s| s.tpot_p50_ms,
    },
    Metric {
        title: "output tokens/s",
        floor: 0.0,
        value: |s| s.output_tokens_per_s,
    },
    Metric {
        title: "load imbalance (largest share / mean)",
        floor: 1.0,
        value: |s| s.imbalance,
    },
];

/// Draws a sweep's results as the bytes of a `format` file. `axes` are the `--sweep`s (none for
/// a single configuration); `runs` the configurations, in any order.
pub fn sweep(
    axes: &[SweepAxis],
    runs: &[SweepRun<'_>],
    format: super::Format,
) -> Result<Vec<u8>, super::PlotError> {
    super::render(&SweepChart::new(axes, runs), format)
}

const COLUMNS: usize = 2;
const PANEL_H: u32 = 330;
const LEGEND_ROW_H: u32 = 26;
/// Longest x-axis value and legend label drawn, in characters.
const MAX_LABEL: usize = 28;

/// One line of every panel.
struct Series<'a> {
    /// The values of the parameters off the x-axis (empty when there are none).
    label: String,
    /// The configuration at each x-axis value, if any.
    at: Vec<Option<&'a Summary>>,
}

struct SweepChart<'a> {
    x_title: String,
    x_values: Vec<String>,
    /// The parameters the series differ by, `, `-separated (empty when there are none); each
    /// series is labelled by their values, in the same order.
    legend_title: String,
    series: Vec<Series<'a>>,
    legend_rows: Vec<Vec<usize>>,
}

impl<'a> SweepChart<'a> {
    fn new(axes: &[SweepAxis], runs: &[SweepRun<'a>]) -> Self {
        let numeric = |a: &&SweepAxis| a.values.iter().all(|v| v.parse::<f64>().is_ok());
        let x_axis = axes.iter().rev().find(numeric).or_else(|| axes.last());
        let (x_title, x_values) = match x_axis {
            Some(a) => {
                let mut values: Vec<String> = Vec::with_capacity(a.values.len());
                for v in &a.values {
                    if !values.contains(v) {
                        values.push(v.clone());
                    }
                }
                if numeric(&a) {
                    values.sort_by(|p, q| {
                        let num = |s: &String| s.parse::<f64>().unwrap_or(f64::NAN);
                        num(p).total_cmp(&num(q))
                    });
                }
                (a.key.clone(), values)
            }
            None => ("configuration".to_owned(), vec!["base".to_owned()]),
        };
        let x_key = x_axis.map(|a| a.key.as_str());
        let others: Vec<&str> = axes
            .iter()
            .map(|a| a.key.as_str())
            .filter(|k| Some(*k) != x_key)
            .collect();
        let mut series: Vec<Series<'a>> = Vec::new();
        for run in runs {
            let slot = match x_key {
                Some(k) => run
                    .values
                    .iter()
                    .find(|(key, _)| key == k)
                    .and_then(|(_, v)| x_values.iter().position(|x| x == v)),
                None => Some(0),
            };
            let Some(slot) = slot else { continue };
            let rest: Vec<&str> = run
                .values
                .iter()
                .filter(|(k, _)| Some(k.as_str()) != x_key)
                .map(|(_, v)| v.as_str())
                .collect();
            let label = rest.join(", ");
            let i = match series.iter().position(|s| s.label == label) {
                Some(i) => i,
                None => {
                    series.push(Series {
                        label,
                        at: vec![None; x_values.len()],
                    });
                    series.len() - 1
                }
            };
            series[i].at[slot] = Some(run.summary);
        }
        let legend_title = others.join(", ");
        let mut chart = SweepChart {
            x_title,
            x_values: x_values.iter().map(|v| shorten(v, MAX_LABEL)).collect(),
            legend_title,
            series,
            legend_rows: Vec::new(),
        };
        chart.legend_rows = chart.legend_layout();
        chart
    }

    /// Whether the figure has a legend: only when there is more than one line or the line has
    /// a name.
    fn has_legend(&self) -> bool {
        self.series.len() > 1 || self.series.iter().any(|s| !s.label.is_empty())
    }

    fn legend_title_text(&self) -> String {
        if self.legend_title.is_empty() {
            String::new()
        } else {
            format!("{}:", self.legend_title)
        }
    }

    /// Left edge of the legend entries, after the legend's title.
    fn legend_x0(&self) -> i32 {
        let title = self.legend_title_text();
        24 + if title.is_empty() {
            0
        } else {
            text_width(&title, LABEL_PX) as i32 + 14
        }
    }

    /// Width of one legend entry: swatch, gap, label, gap.
    fn entry_width(label: &str) -> i32 {
        30 + 6 + text_width(&shorten(label, MAX_LABEL), LABEL_PX) as i32 + 24
    }

    /// The series of each legend row, entries flowing left to right and wrapping at the edge.
    fn legend_layout(&self) -> Vec<Vec<usize>> {
        if !self.has_legend() {
            return Vec::new();
        }
        let mut rows: Vec<Vec<usize>> = vec![Vec::new()];
        let mut x = self.legend_x0();
        for (i, s) in self.series.iter().enumerate() {
            let w = Self::entry_width(&s.label);
            let row_full = rows.last().is_some_and(|r| !r.is_empty());
            if row_full && x + w > WIDTH as i32 - 16 {
                rows.push(Vec::new());
                x = self.legend_x0();
            }
            if let Some(r) = rows.last_mut() {
                r.push(i);
            }
            x += w;
        }
        rows
    }

    fn header_height(&self) -> u32 {
        TITLE_H + self.legend_rows.len() as u32 * LEGEND_ROW_H + 8
    }

    fn title(&self) -> String {
        let n = self.configurations();
        let mut t = format!(
            "infera replay: {n} configuration{}",
            if n == 1 { "" } else { "s" }
        );
        if self.x_values.len() > 1 || !self.legend_title.is_empty() {
            t.push_str(&format!(" by {}", self.x_title));
        }
        if !self.legend_title.is_empty() {
            t.push_str(&format!(" and {}", self.legend_title));
        }
        t
    }

    /// The radius of series `i`'s dots: earlier series (drawn first, underneath) get larger
    /// ones, so that equal values still show every colour.
    fn dot(&self, i: usize) -> u32 {
        let n = self.series.len();
        if n < 2 {
            return 4;
        }
        3 + (3 * n.saturating_sub(i + 1) / (n - 1)) as u32
    }

    fn configurations(&self) -> usize {
        self.series
            .iter()
            .map(|s| s.at.iter().flatten().count())
            .sum()
    }

    fn draw_header<DB: DrawingBackend>(
        &self,
        area: &DrawingArea<DB, Shift>,
    ) -> Result<(), super::DrawError<DB>> {
        let left = Pos::new(HPos::Left, VPos::Center);
        area.draw(&Text::new(
            self.title(),
            (24, TITLE_H as i32 / 2 + 4),
            font(20).pos(left),
        ))?;
        let title = self.legend_title_text();
        for (row, entries) in self.legend_rows.iter().enumerate() {
            let y = (TITLE_H + row as u32 * LEGEND_ROW_H + LEGEND_ROW_H / 2) as i32;
            if row == 0 && !title.is_empty() {
                area.draw(&Text::new(title.clone(), (24, y), font(LABEL_PX).pos(left)))?;
            }
            let mut x = self.legend_x0();
            for i in entries {
                let color = PALETTE[i % PALETTE.len()];
                area.draw(&PathElement::new(
                    vec![(x, y), (x + 30, y)],
                    color.stroke_width(2),
                ))?;
                area.draw(&Circle::new((x + 15, y), self.dot(*i), color.filled()))?;
                let label = shorten(&self.series[*i].label, MAX_LABEL);
                area.draw(&Text::new(
                    label.clone(),
                    (x + 36, y),
                    font(LABEL_PX).pos(left),
                ))?;
                x += Self::entry_width(&label);
            }
        }
        Ok(())
    }

    fn draw_panel<DB: DrawingBackend>(
        &self,
        area: &DrawingArea<DB, Shift>,
        metric: &Metric,
    ) -> Result<(), super::DrawError<DB>> {
        let values = |s: &Series<'a>| -> Vec<(usize, f64)> {
            s.at.iter()
                .enumerate()
                .filter_map(|(x, r)| r.map(|r| (x, (metric.value)(r))))
                .filter(|(_, y)| y.is_finite())
                .collect()
        };
        let all: Vec<f64> = self
            .series
            .iter()
            .flat_map(|s| values(s).into_iter().map(|(_, y)| y))
            .collect();
        let low = all.iter().copied().fold(metric.floor, f64::min);
        let high = all.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let top = low + nice_ceiling((high - low) * 1.08);
        let span = top - low;
        let y_labels: Vec<String> = (0..=5)
            .map(|k| tick(low + span * f64::from(k) / 5.0, span))
            .collect();
        let y_area = y_labels
            .iter()
            .map(|l| text_width(l, LABEL_PX))
            .max()
            .unwrap_or(0)
            + 16;
        // The x labels in as many staggered rows (up to four) as their width needs, every
        // `stride`-th of them when four rows are not enough.
        let (w, _) = area.dim_in_pixel();
        let slot = (w.saturating_sub(y_area + 36) / self.x_values.len().max(1) as u32).max(1);
        let widest = self
            .x_values
            .iter()
            .map(|v| text_width(v, LABEL_PX))
            .max()
            .unwrap_or(0)
            + 12;
        let rows = widest.div_ceil(slot).clamp(1, 4);
        let stride = widest.div_ceil(slot * rows).max(1) as usize;
        let row_h = LABEL_PX as i32 + 4;
        let mut chart = ChartBuilder::on(area)
            .caption(metric.title, (FAMILY, 17))
            .margin(12)
            .margin_right(24)
            .x_label_area_size(28 + rows * row_h as u32 + 8)
            .y_label_area_size(y_area)
            .build_cartesian_2d(Slots(self.x_values.len()), low..top)?;
        chart
            .configure_mesh()
            .x_desc(self.x_title.as_str())
            .y_labels(6)
            .y_label_formatter(&|v| tick(*v, span))
            .y_label_style(font(LABEL_PX))
            .axis_desc_style(font(LABEL_PX))
            .bold_line_style(GRID)
            .light_line_style(TRANSPARENT)
            .draw()?;
        let base = area.get_base_pixel();
        let below = Pos::new(HPos::Center, VPos::Top);
        for (i, v) in self.x_values.iter().enumerate().step_by(stride) {
            let (x, y) = chart.backend_coord(&(i, low));
            let row = (i / stride) as i32 % rows as i32;
            area.draw(&Text::new(
                v.clone(),
                (x - base.0, y - base.1 + 10 + row * row_h),
                font(LABEL_PX).pos(below),
            ))?;
        }
        for (i, s) in self.series.iter().enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            let points = values(s);
            // One polyline per run of consecutive x values.
            let mut start = 0;
            for end in 1..=points.len() {
                if end == points.len() || points[end].0 != points[end - 1].0 + 1 {
                    if end - start > 1 {
                        chart.draw_series(LineSeries::new(
                            points[start..end].iter().copied(),
                            color.stroke_width(2),
                        ))?;
                    }
                    start = end;
                }
            }
            let r = self.dot(i);
            chart.draw_series(points.iter().map(|p| Circle::new(*p, r, color.filled())))?;
        }
        Ok(())
    }
}

impl Figure for SweepChart<'_> {
    fn size(&self) -> (u32, u32) {
        let rows = METRICS.len().div_ceil(COLUMNS) as u32;
        (WIDTH, self.header_height() + rows * PANEL_H)
    }

    fn draw<DB: DrawingBackend>(
        &self,
        root: &DrawingArea<DB, Shift>,
    ) -> Result<(), super::DrawError<DB>> {
        let (header, body) = root.split_vertically(self.header_height());
        self.draw_header(&header)?;
        let rows = METRICS.len().div_ceil(COLUMNS);
        for (area, metric) in body.split_evenly((rows, COLUMNS)).iter().zip(&METRICS) {
            self.draw_panel(area, metric)?;
        }
        Ok(())
    }
}

/// The x-axis: `n` swept values as evenly spaced slots, value `i` at the centre of slot `i`.
/// Its tick labels are empty: [`SweepChart::draw_panel`] draws the values itself, in staggered
/// rows when they are wide.
#[derive(Clone)]
struct Slots(usize);

impl Ranged for Slots {
    type FormatOption = NoDefaultFormatting;
    type ValueType = usize;

    fn map(&self, value: &usize, limit: (i32, i32)) -> i32 {
        let n = self.0.max(1) as f64;
        let span = f64::from(limit.1 - limit.0);
        (f64::from(limit.0) + span * (*value as f64 + 0.5) / n).round() as i32
    }

    fn key_points<H: KeyPointHint>(&self, _hint: H) -> Vec<usize> {
        (0..self.0).collect()
    }

    fn range(&self) -> Range<usize> {
        0..self.0
    }
}

impl ValueFormatter<usize> for Slots {
    fn format_ext(&self, _value: &usize) -> String {
        String::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_centre_each_value() {
        assert_eq!(Slots(2).map(&0, (0, 100)), 25);
        assert_eq!(Slots(2).map(&1, (0, 100)), 75);
        assert_eq!(Slots(0).map(&0, (0, 100)), 50);
        assert_eq!(Slots(3).key_points(10), vec![0, 1, 2]);
    }
}
