//! The Pareto chart: configurations as points on two metrics.
//!
//! Layout: a title on top, the scatter on the left, a key on the right. Points on the front are
//! blue and joined in x order; the others are grey. Every keyed point carries its number beside
//! it, placed by [`place_labels`] clear of the other numbers and dots where it can be (with a
//! thin leader line when it had to move away), and its label in the key, wrapped to the key's
//! width; the recommended point is ringed in orange, in the plot and the key. A line under the
//! key says what the marks mean. Up to [`MAX_KEYED`] points are keyed; past that, only the front
//! and the recommended point. Points whose coordinates are not finite are left out.

use super::{
    FAMILY, Figure, GRID, LABEL_PX, PALETTE, TITLE_H, WIDTH, font, shorten, text_width, tick,
};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// One configuration on the chart.
#[derive(Debug, Clone, PartialEq)]
pub struct ParetoPoint {
    pub label: String,
    pub x: f64,
    pub y: f64,
    /// Whether no other point is better on both metrics (the caller decides what "better" is).
    pub on_front: bool,
}

/// A Pareto chart: what the axes measure and the points.
#[derive(Debug, Clone, Copy)]
pub struct Pareto<'a> {
    pub title: &'a str,
    pub x_label: &'a str,
    pub y_label: &'a str,
    pub points: &'a [ParetoPoint],
    /// Index into `points` of the configuration to recommend, if any.
    pub recommended: Option<usize>,
}

/// Draws a Pareto chart as the bytes of a `format` file.
pub fn pareto(chart: &Pareto<'_>, format: super::Format) -> Result<Vec<u8>, super::PlotError> {
    super::render(chart, format)
}

/// The most points listed in the key.
pub const MAX_KEYED: usize = 40;
const PLOT_W: u32 = 760;
const KEY_ROW_H: u32 = 21;
/// Longest label drawn, in characters; the key wraps it to [`KEY_TEXT_W`].
const MAX_LABEL: usize = 160;
const KEY_TEXT_X: i32 = 62;
const KEY_TEXT_W: u32 = WIDTH - PLOT_W - KEY_TEXT_X as u32 - 12;
const FRONT: RGBColor = PALETTE[0];
const OTHER: RGBColor = RGBColor(0x99, 0x99, 0x99);
const RECOMMENDED: RGBColor = PALETTE[1];

impl Pareto<'_> {
    fn finite(&self, i: usize) -> bool {
        self.points
            .get(i)
            .is_some_and(|p| p.x.is_finite() && p.y.is_finite())
    }

    /// The points with a number and a key row, in order.
    fn keyed(&self) -> Vec<usize> {
        let finite: Vec<usize> = (0..self.points.len()).filter(|i| self.finite(*i)).collect();
        if finite.len() <= MAX_KEYED {
            return finite;
        }
        finite
            .into_iter()
            .filter(|i| self.points[*i].on_front || self.recommended == Some(*i))
            .take(MAX_KEYED)
            .collect()
    }

    /// `lo..hi` of `values` with a margin of 8% of the span each side (±1 around a single value).
    fn range(values: impl Iterator<Item = f64>) -> (f64, f64) {
        let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
            (a.min(v), b.max(v))
        });
        if lo > hi {
            return (0.0, 1.0);
        }
        let pad = if hi > lo {
            (hi - lo) * 0.08
        } else {
            lo.abs().max(1.0) * 0.1
        };
        (lo - pad, hi + pad)
    }

    /// Point `i`'s key text, wrapped to the key's width.
    fn key_lines(&self, i: usize) -> Vec<String> {
        let mut label = shorten(&self.points[i].label, MAX_LABEL);
        if self.recommended == Some(i) {
            label.push_str(" (recommended)");
        }
        wrap(&label, KEY_TEXT_W, LABEL_PX)
    }

    fn key_rows(&self, keyed: &[usize]) -> u32 {
        keyed.iter().map(|i| self.key_lines(*i).len() as u32).sum()
    }

    fn draw_key<DB: DrawingBackend>(
        &self,
        area: &DrawingArea<DB, Shift>,
        keyed: &[usize],
    ) -> Result<(), super::DrawError<DB>> {
        let left = Pos::new(HPos::Left, VPos::Center);
        let mut y = 36;
        area.draw(&Text::new("configurations", (8, y), font(16).pos(left)))?;
        y += KEY_ROW_H as i32 + 4;
        for i in keyed {
            let p = &self.points[*i];
            if self.recommended == Some(*i) {
                area.draw(&Circle::new((16, y), 9, RECOMMENDED.stroke_width(2)))?;
            }
            if p.on_front {
                area.draw(&Circle::new((16, y), 5, FRONT.filled()))?;
            } else {
                area.draw(&Circle::new((16, y), 5, OTHER.filled()))?;
            }
            area.draw(&Text::new(
                format!("{}", i + 1),
                (32, y),
                font(LABEL_PX).pos(left),
            ))?;
            for line in self.key_lines(*i) {
                area.draw(&Text::new(line, (KEY_TEXT_X, y), font(LABEL_PX).pos(left)))?;
                y += KEY_ROW_H as i32;
            }
        }
        // What the marks mean.
        y += KEY_ROW_H as i32 / 2;
        let mut x = 16;
        let marks = [
            (Some(FRONT.filled()), "on the front"),
            (Some(OTHER.filled()), "off the front"),
            (None, "recommended"),
        ];
        for (dot, what) in marks {
            match dot {
                Some(style) => area.draw(&Circle::new((x, y), 5, style))?,
                None if self.recommended.is_some() => {
                    area.draw(&Circle::new((x, y), 9, RECOMMENDED.stroke_width(2)))?
                }
                None => continue,
            }
            area.draw(&Text::new(what, (x + 14, y), font(LABEL_PX).pos(left)))?;
            x += 14 + text_width(what, LABEL_PX) as i32 + 28;
        }
        Ok(())
    }
}

/// Left, top, right and bottom, in pixels.
type PixelBox = (i32, i32, i32, i32);

/// A label and where [`place_labels`] put it.
struct Placed {
    text: String,
    dot: (i32, i32),
    rect: PixelBox,
}

/// A box in pixels for each label beside its dot: the first of eight
/// directions, at growing distances, that stays inside `area` and overlaps no dot and no box
/// placed before it; the nearest spot up and to the right when none is clear.
fn place_labels(
    labels: Vec<(String, (i32, i32))>,
    dots: &[(i32, i32)],
    area: (std::ops::Range<i32>, std::ops::Range<i32>),
) -> Vec<Placed> {
    const DIRECTIONS: [(i32, i32); 8] = [
        (1, -1),
        (1, 1),
        (-1, -1),
        (-1, 1),
        (1, 0),
        (-1, 0),
        (0, -1),
        (0, 1),
    ];
    /// Pixels kept free between a label and anything else.
    const GAP: i32 = 3;
    let (xs, ys) = area;
    let mut taken: Vec<PixelBox> = dots
        .iter()
        .map(|(x, y)| (x - 6, y - 6, x + 6, y + 6))
        .collect();
    let mut out = Vec::with_capacity(labels.len());
    for (text, (x, y)) in labels {
        let w = text_width(&text, LABEL_PX) as i32;
        let h = LABEL_PX as i32;
        let spot = |d: i32, (dx, dy): (i32, i32)| {
            let cx = x + dx * (d + w / 2);
            let cy = y + dy * (d + h / 2);
            (cx - w / 2, cy - h / 2, cx - w / 2 + w, cy - h / 2 + h)
        };
        let clear = |b: &PixelBox| {
            xs.start <= b.0
                && b.2 < xs.end
                && ys.start <= b.1
                && b.3 < ys.end
                && taken.iter().all(|o| {
                    b.2 + GAP <= o.0 || b.0 >= o.2 + GAP || b.3 + GAP <= o.1 || b.1 >= o.3 + GAP
                })
        };
        let chosen = [10, 22, 36, 52]
            .iter()
            .flat_map(|d| DIRECTIONS.iter().map(move |dir| (*d, *dir)))
            .map(|(d, dir)| spot(d, dir))
            .find(clear)
            .unwrap_or_else(|| spot(10, DIRECTIONS[0]));
        taken.push(chosen);
        out.push(Placed {
            text,
            dot: (x, y),
            rect: chosen,
        });
    }
    out
}

/// `text` in lines of at most `width` pixels at `size`, broken at spaces (inside a word only
/// where the word alone is wider).
fn wrap(text: &str, width: u32, size: u32) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    let mut line = String::new();
    for word in text.split(' ').filter(|w| !w.is_empty()) {
        let joined = if line.is_empty() {
            word.to_owned()
        } else {
            format!("{line} {word}")
        };
        if text_width(&joined, size) <= width {
            line = joined;
            continue;
        }
        if !line.is_empty() {
            lines.push(std::mem::take(&mut line));
        }
        for c in word.chars() {
            line.push(c);
            if text_width(&line, size) > width && line.chars().count() > 1 {
                line.pop();
                lines.push(std::mem::replace(&mut line, c.to_string()));
            }
        }
    }
    if !line.is_empty() || lines.is_empty() {
        lines.push(line);
    }
    lines
}

impl Figure for Pareto<'_> {
    fn size(&self) -> (u32, u32) {
        let rows = self.key_rows(&self.keyed()) + 4;
        (WIDTH, (TITLE_H + 80 + rows * KEY_ROW_H).max(640))
    }

    fn draw<DB: DrawingBackend>(
        &self,
        root: &DrawingArea<DB, Shift>,
    ) -> Result<(), super::DrawError<DB>> {
        let (header, body) = root.split_vertically(TITLE_H);
        header.draw(&Text::new(
            self.title.to_owned(),
            (24, TITLE_H as i32 / 2 + 4),
            font(20).pos(Pos::new(HPos::Left, VPos::Center)),
        ))?;
        let (plot, key) = body.split_horizontally(PLOT_W);
        let keyed = self.keyed();
        self.draw_key(&key, &keyed)?;

        let shown: Vec<&ParetoPoint> = (0..self.points.len())
            .filter(|i| self.finite(*i))
            .map(|i| &self.points[i])
            .collect();
        let (x0, x1) = Self::range(shown.iter().map(|p| p.x));
        let (y0, y1) = Self::range(shown.iter().map(|p| p.y));
        let y_area = [y0, y1]
            .iter()
            .map(|v| text_width(&tick(*v, y1 - y0), LABEL_PX))
            .max()
            .unwrap_or(0)
            + 20;
        let mut chart = ChartBuilder::on(&plot)
            .margin(16)
            .x_label_area_size(52)
            .y_label_area_size(y_area + 28)
            .build_cartesian_2d(x0..x1, y0..y1)?;
        chart
            .configure_mesh()
            .x_desc(self.x_label)
            .y_desc(self.y_label)
            .x_labels(8)
            .y_labels(8)
            .x_label_formatter(&|v| tick(*v, x1 - x0))
            .y_label_formatter(&|v| tick(*v, y1 - y0))
            .label_style(font(LABEL_PX))
            .axis_desc_style((FAMILY, LABEL_PX))
            .bold_line_style(GRID)
            .light_line_style(TRANSPARENT)
            .draw()?;
        let mut front: Vec<(f64, f64)> = shown
            .iter()
            .filter(|p| p.on_front)
            .map(|p| (p.x, p.y))
            .collect();
        front.sort_by(|a, b| a.0.total_cmp(&b.0));
        chart.draw_series(LineSeries::new(front, FRONT.stroke_width(2)))?;
        chart.draw_series(
            shown
                .iter()
                .filter(|p| !p.on_front)
                .map(|p| Circle::new((p.x, p.y), 5, OTHER.filled())),
        )?;
        chart.draw_series(
            shown
                .iter()
                .filter(|p| p.on_front)
                .map(|p| Circle::new((p.x, p.y), 5, FRONT.filled())),
        )?;
        if let Some(r) = self.recommended.filter(|r| self.finite(*r)) {
            let p = &self.points[r];
            chart.draw_series(std::iter::once(Circle::new(
                (p.x, p.y),
                11,
                RECOMMENDED.stroke_width(3),
            )))?;
        }

        // Numbers beside the points, clear of the other numbers and dots where possible.
        let dots: Vec<(i32, i32)> = shown
            .iter()
            .map(|p| chart.backend_coord(&(p.x, p.y)))
            .collect();
        let labels: Vec<(String, (i32, i32))> = keyed
            .iter()
            .map(|i| {
                let p = &self.points[*i];
                (format!("{}", i + 1), chart.backend_coord(&(p.x, p.y)))
            })
            .collect();
        let (px, py) = plot.get_pixel_range();
        let centered = Pos::new(HPos::Center, VPos::Center);
        for Placed {
            text,
            dot,
            rect: (l, t, r, b),
        } in place_labels(labels, &dots, (px, py))
        {
            let (cx, cy) = ((l + r) / 2, (t + b) / 2);
            let near = (dot.0.clamp(l, r), dot.1.clamp(t, b));
            if (near.0 - dot.0).abs().max((near.1 - dot.1).abs()) > 16 {
                root.draw(&PathElement::new(vec![dot, near], OTHER.stroke_width(1)))?;
            }
            root.draw(&Text::new(text, (cx, cy), font(LABEL_PX).pos(centered)))?;
        }
        Ok(())
    }
}
