//! `--plot FILE.svg|FILE.png`: block hit rate and TTFT p50 against the swept value, and the TTFT
//! CDF of each configuration, as a self-contained SVG (no fonts or libraries needed to view it)
//! or a PNG.
//!
//! One layout drives both formats: [`scene`] turns the points into a list of [`Shape`]s in a
//! 1000 × 760 pixel space (origin top-left, y down, text anchored on its baseline), drawn in
//! order, later over earlier. [`svg`] writes each shape as one SVG element; [`png`] draws them
//! with [`crate::raster`] (no anti-aliasing; text in its 5×7 bitmap font, 1× for labels and 2×
//! for panel titles, non-ASCII folded to look-alikes) and encodes a PNG of the same size.

use crate::raster::{self, Canvas, Rgb};
use std::fmt::Write as _;
use std::path::Path;

/// One configuration as plotted.
#[derive(Debug, Clone)]
pub struct PlotPoint {
    pub label: String,
    /// The swept value when it is numeric.
    pub x: Option<f64>,
    pub hit_rate: f64,
    pub ttft_p50_ms: f64,
    /// Sorted TTFTs in ms.
    pub ttft_ms: Vec<f64>,
}

/// The output format of [`render`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Svg,
    Png,
}

impl Format {
    /// The format a path's extension names (`.svg` or `.png`, lowercase), if either.
    pub fn from_path(path: &Path) -> Option<Format> {
        match path.extension()?.to_str()? {
            "svg" => Some(Format::Svg),
            "png" => Some(Format::Png),
            _ => None,
        }
    }

    /// The file extension, without the dot.
    pub fn extension(self) -> &'static str {
        match self {
            Format::Svg => "svg",
            Format::Png => "png",
        }
    }
}

/// Renders the plot as the bytes of a `format` file. `axis` names the swept option (or
/// "configuration").
pub fn render(axis: &str, points: &[PlotPoint], format: Format) -> Vec<u8> {
    let shapes = scene(axis, points);
    match format {
        Format::Svg => svg(&shapes).into_bytes(),
        Format::Png => png(&shapes),
    }
}

const COLORS: [Rgb; 8] = [
    Rgb(0x1f, 0x77, 0xb4),
    Rgb(0xff, 0x7f, 0x0e),
    Rgb(0x2c, 0xa0, 0x2c),
    Rgb(0xd6, 0x27, 0x28),
    Rgb(0x94, 0x67, 0xbd),
    Rgb(0x8c, 0x56, 0x4b),
    Rgb(0xe3, 0x77, 0xc2),
    Rgb(0x7f, 0x7f, 0x7f),
];
const FRAME: Rgb = Rgb(0x44, 0x44, 0x44);
const GRID: Rgb = Rgb(0xdd, 0xdd, 0xdd);
const W: f64 = 1000.0;
const H: f64 = 760.0;

/// Where a text's `x` is: its left end, centre or right end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Anchor {
    Start,
    Middle,
    End,
}

/// One drawing primitive, in output pixels.
#[derive(Debug, Clone, PartialEq)]
enum Shape {
    Rect {
        x: f64,
        y: f64,
        w: f64,
        h: f64,
        fill: Option<Rgb>,
        /// A 1 px outline.
        stroke: Option<Rgb>,
    },
    /// A 1 px line.
    Line {
        from: (f64, f64),
        to: (f64, f64),
        color: Rgb,
    },
    Polyline {
        points: Vec<(f64, f64)>,
        color: Rgb,
        width: u32,
    },
    Circle {
        cx: f64,
        cy: f64,
        r: f64,
        fill: Rgb,
    },
    /// Black text; `y` is the baseline.
    Text {
        x: f64,
        y: f64,
        size: u32,
        anchor: Anchor,
        text: String,
    },
}

fn text(x: f64, y: f64, size: u32, anchor: Anchor, text: impl Into<String>) -> Shape {
    Shape::Text {
        x,
        y,
        size,
        anchor,
        text: text.into(),
    }
}

struct Panel {
    x0: f64,
    y0: f64,
    w: f64,
    h: f64,
    xmin: f64,
    xmax: f64,
    ymin: f64,
    ymax: f64,
}

impl Panel {
    fn px(&self, x: f64) -> f64 {
        let span = (self.xmax - self.xmin).max(f64::EPSILON);
        self.x0 + (x - self.xmin) / span * self.w
    }

    fn py(&self, y: f64) -> f64 {
        let span = (self.ymax - self.ymin).max(f64::EPSILON);
        self.y0 + self.h - (y - self.ymin) / span * self.h
    }

    /// Grid lines with their y labels, then the frame over them, the title and the x label.
    fn frame(&self, out: &mut Vec<Shape>, title: &str, xlabel: &str, yfmt: &dyn Fn(f64) -> String) {
        for k in 0..=4 {
            let y = self.ymin + (self.ymax - self.ymin) * k as f64 / 4.0;
            let py = self.py(y);
            out.push(Shape::Line {
                from: (self.x0, py),
                to: (self.x0 + self.w, py),
                color: GRID,
            });
            out.push(text(self.x0 - 6.0, py + 4.0, 11, Anchor::End, yfmt(y)));
        }
        out.push(Shape::Rect {
            x: self.x0,
            y: self.y0,
            w: self.w,
            h: self.h,
            fill: None,
            stroke: Some(FRAME),
        });
        let mid = self.x0 + self.w / 2.0;
        out.push(text(mid, self.y0 - 10.0, 15, Anchor::Middle, title));
        out.push(text(
            mid,
            self.y0 + self.h + 36.0,
            12,
            Anchor::Middle,
            xlabel,
        ));
    }

    fn xticks(&self, out: &mut Vec<Shape>, ticks: &[(f64, String)]) {
        for (x, label) in ticks {
            let y = self.y0 + self.h + 16.0;
            out.push(text(self.px(*x), y, 11, Anchor::Middle, label.as_str()));
        }
    }

    fn polyline(&self, out: &mut Vec<Shape>, pts: &[(f64, f64)], color: Rgb, dots: bool) {
        out.push(Shape::Polyline {
            points: pts
                .iter()
                .map(|(x, y)| (self.px(*x), self.py(*y)))
                .collect(),
            color,
            width: 2,
        });
        if dots {
            for (x, y) in pts {
                out.push(Shape::Circle {
                    cx: self.px(*x),
                    cy: self.py(*y),
                    r: 3.5,
                    fill: color,
                });
            }
        }
    }
}

fn nice_max(v: f64) -> f64 {
    if v <= 0.0 {
        return 1.0;
    }
    let mag = 10f64.powf(v.log10().floor());
    for m in [1.0, 2.0, 2.5, 5.0, 10.0] {
        if m * mag >= v {
            return m * mag;
        }
    }
    10.0 * mag
}

/// The plot as shapes: the only place that knows the layout.
fn scene(axis: &str, points: &[PlotPoint]) -> Vec<Shape> {
    let numeric = points.iter().all(|p| p.x.is_some()) && points.len() > 1;
    let xs: Vec<f64> = points
        .iter()
        .enumerate()
        .map(|(i, p)| {
            if numeric {
                p.x.unwrap_or(0.0)
            } else {
                i as f64
            }
        })
        .collect();
    let (xmin, xmax) = xs
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| {
            (a.min(*x), b.max(*x))
        });
    let (xmin, xmax) = if xmin < xmax {
        (xmin, xmax)
    } else {
        (xmin - 1.0, xmax + 1.0)
    };
    let ticks: Vec<(f64, String)> = xs
        .iter()
        .zip(points)
        .map(|(x, p)| {
            let label = if numeric {
                format!("{x}")
            } else {
                format!("#{} {}", 1 + *x as usize, short(&p.label))
            };
            (*x, label)
        })
        .collect();
    let mut out = vec![Shape::Rect {
        x: 0.0,
        y: 0.0,
        w: W,
        h: H,
        fill: Some(Rgb::WHITE),
        stroke: None,
    }];
    let hit_max = nice_max(points.iter().map(|p| p.hit_rate).fold(0.0, f64::max) * 100.0);
    let hit = Panel {
        x0: 80.0,
        y0: 50.0,
        w: 380.0,
        h: 250.0,
        xmin,
        xmax,
        ymin: 0.0,
        ymax: hit_max,
    };
    hit.frame(&mut out, "block hit rate", axis, &|y| format!("{y:.0}%"));
    hit.xticks(&mut out, &ticks);
    let pts: Vec<(f64, f64)> = xs
        .iter()
        .zip(points)
        .map(|(x, p)| (*x, p.hit_rate * 100.0))
        .collect();
    hit.polyline(&mut out, &pts, COLORS[0], true);
    let t_max = nice_max(points.iter().map(|p| p.ttft_p50_ms).fold(0.0, f64::max));
    let ttft = Panel {
        x0: 580.0,
        y0: 50.0,
        w: 380.0,
        h: 250.0,
        xmin,
        xmax,
        ymin: 0.0,
        ymax: t_max,
    };
    ttft.frame(&mut out, "TTFT p50", axis, &|y| format!("{y:.0} ms"));
    ttft.xticks(&mut out, &ticks);
    let pts: Vec<(f64, f64)> = xs
        .iter()
        .zip(points)
        .map(|(x, p)| (*x, p.ttft_p50_ms))
        .collect();
    ttft.polyline(&mut out, &pts, COLORS[1], true);
    // TTFT CDFs up to the largest p99.
    let p99 = |v: &[f64]| crate::report::percentile(v, 0.99);
    let cmax = nice_max(points.iter().map(|p| p99(&p.ttft_ms)).fold(0.0, f64::max));
    let cdf = Panel {
        x0: 80.0,
        y0: 380.0,
        w: 640.0,
        h: 300.0,
        xmin: 0.0,
        xmax: cmax,
        ymin: 0.0,
        ymax: 1.0,
    };
    cdf.frame(&mut out, "TTFT CDF", "TTFT (ms)", &|y| {
        format!("{:.0}%", y * 100.0)
    });
    let cticks: Vec<(f64, String)> = (0..=5)
        .map(|k| {
            (
                cmax * k as f64 / 5.0,
                format!("{:.0}", cmax * k as f64 / 5.0),
            )
        })
        .collect();
    cdf.xticks(&mut out, &cticks);
    for (i, p) in points.iter().enumerate() {
        let n = p.ttft_ms.len().max(1) as f64;
        let step = (p.ttft_ms.len() / 400).max(1);
        let mut pts: Vec<(f64, f64)> = p
            .ttft_ms
            .iter()
            .enumerate()
            .step_by(step)
            .filter(|(_, t)| **t <= cmax)
            .map(|(k, t)| (*t, (k + 1) as f64 / n))
            .collect();
        if pts.is_empty() {
            pts.push((0.0, 0.0));
        }
        let color = COLORS[i % COLORS.len()];
        cdf.polyline(&mut out, &pts, color, false);
        let ly = 390.0 + 18.0 * i as f64;
        out.push(Shape::Rect {
            x: 740.0,
            y: ly,
            w: 12.0,
            h: 12.0,
            fill: Some(color),
            stroke: None,
        });
        let label = format!("#{} {}", i + 1, short(&p.label));
        out.push(text(758.0, ly + 10.0, 12, Anchor::Start, label));
    }
    out
}

fn short(s: &str) -> String {
    if s.chars().count() <= 34 {
        s.to_owned()
    } else {
        format!("{}…", s.chars().take(33).collect::<String>())
    }
}

/// `#rrggbb`.
fn hex(c: Rgb) -> String {
    format!("#{:02x}{:02x}{:02x}", c.0, c.1, c.2)
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

fn svg(shapes: &[Shape]) -> String {
    let mut svg = format!(
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}">"##
    );
    for shape in shapes {
        // Writing to a String cannot fail.
        let _ = match shape {
            Shape::Rect {
                x,
                y,
                w,
                h,
                fill,
                stroke,
            } => {
                let fill = fill.map_or("none".into(), hex);
                let stroke = stroke.map_or(String::new(), |c| format!(r#" stroke="{}""#, hex(c)));
                write!(
                    svg,
                    r#"<rect x="{x:.1}" y="{y:.1}" width="{w:.1}" height="{h:.1}" fill="{fill}"{stroke}/>"#
                )
            }
            Shape::Line { from, to, color } => write!(
                svg,
                r#"<line x1="{:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{}"/>"#,
                from.0,
                from.1,
                to.0,
                to.1,
                hex(*color)
            ),
            Shape::Polyline {
                points,
                color,
                width,
            } => {
                let path: Vec<String> = points
                    .iter()
                    .map(|(x, y)| format!("{x:.1},{y:.1}"))
                    .collect();
                write!(
                    svg,
                    r#"<polyline points="{}" fill="none" stroke="{}" stroke-width="{width}"/>"#,
                    path.join(" "),
                    hex(*color)
                )
            }
            Shape::Circle { cx, cy, r, fill } => write!(
                svg,
                r#"<circle cx="{cx:.1}" cy="{cy:.1}" r="{r}" fill="{}"/>"#,
                hex(*fill)
            ),
            Shape::Text {
                x,
                y,
                size,
                anchor,
                text,
            } => {
                let anchor = match anchor {
                    Anchor::Start => "",
                    Anchor::Middle => r#" text-anchor="middle""#,
                    Anchor::End => r#" text-anchor="end""#,
                };
                write!(
                    svg,
                    r#"<text x="{x:.1}" y="{y:.1}" font-size="{size}"{anchor} font-family="sans-serif">{}</text>"#,
                    esc(text)
                )
            }
        };
    }
    svg.push_str("</svg>\n");
    svg
}

/// Rounds a coordinate to a pixel; `as` saturates, and NaN becomes 0.
fn pix(v: f64) -> i32 {
    v.round() as i32
}

fn png(shapes: &[Shape]) -> Vec<u8> {
    let mut c = Canvas::new(W as u32, H as u32, Rgb::WHITE);
    for shape in shapes {
        match shape {
            Shape::Rect {
                x,
                y,
                w,
                h,
                fill,
                stroke,
            } => {
                let (x0, y0, x1, y1) = (pix(*x), pix(*y), pix(x + w), pix(y + h));
                if let Some(fill) = fill {
                    c.fill_rect(x0, y0, x1 - x0, y1 - y0, *fill);
                }
                if let Some(s) = stroke {
                    let (x0, y0, x1, y1) = (*x, *y, x + w, y + h);
                    for (a, b) in [(x0, y0), (x1, y0), (x1, y1), (x0, y1)].into_iter().zip([
                        (x1, y0),
                        (x1, y1),
                        (x0, y1),
                        (x0, y0),
                    ]) {
                        c.line(a.0, a.1, b.0, b.1, 1, *s);
                    }
                }
            }
            Shape::Line { from, to, color } => c.line(from.0, from.1, to.0, to.1, 1, *color),
            Shape::Polyline {
                points,
                color,
                width,
            } => {
                for seg in points.windows(2) {
                    c.line(seg[0].0, seg[0].1, seg[1].0, seg[1].1, *width, *color);
                }
                if let [(x, y)] = points[..] {
                    c.line(x, y, x, y, *width, *color);
                }
            }
            Shape::Circle { cx, cy, r, fill } => c.fill_circle(*cx, *cy, *r, *fill),
            Shape::Text {
                x,
                y,
                size,
                anchor,
                text,
            } => {
                // About the cap height of a sans-serif face at that size.
                let scale = if *size >= 14 { 2 } else { 1 };
                let w = raster::text_width(text, scale);
                let left = match anchor {
                    Anchor::Start => pix(*x),
                    Anchor::Middle => pix(*x) - w / 2,
                    Anchor::End => pix(*x) - w,
                };
                let top = pix(*y) - raster::CAP_H * scale;
                c.text(left, top, text, scale, Rgb::BLACK);
            }
        }
    }
    c.to_png()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::raster::tests::decode_png;

    fn points(n: usize) -> Vec<PlotPoint> {
        (0..n)
            .map(|i| PlotPoint {
                label: format!("w={i}"),
                x: Some(i as f64),
                hit_rate: 0.1 * i as f64,
                ttft_p50_ms: 100.0 + i as f64,
                ttft_ms: vec![1.0, 2.0, 50.0 * (i + 1) as f64],
            })
            .collect()
    }

    fn svg_of(pts: &[PlotPoint]) -> String {
        String::from_utf8(render("kv-overlap-weight", pts, Format::Svg)).expect("utf-8")
    }

    #[test]
    fn renders_valid_looking_svg() {
        let svg = svg_of(&points(3));
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 2 + 3);
        assert_eq!(svg.matches("<circle").count(), 2 * 3);
        // Background, three frames, three legend swatches.
        assert_eq!(svg.matches("<rect").count(), 1 + 3 + 3);
        assert_eq!(svg.matches("<line").count(), 3 * 5);
        // Per panel: 5 y labels, title, x label; 3 + 3 + 6 x ticks; 3 legend entries.
        assert_eq!(svg.matches("<text").count(), 3 * 7 + 12 + 3);
        assert!(svg.contains("kv-overlap-weight"));
        assert!(svg.contains(r##"stroke="#1f77b4" stroke-width="2""##));
        assert!(nice_max(37.0) == 50.0 && nice_max(0.0) == 1.0);
    }

    #[test]
    fn svg_escapes_and_shortens_labels() {
        let mut pts = points(2);
        pts[0].label = format!("a<b&c {}", "x".repeat(40));
        pts[0].x = None;
        let svg = svg_of(&pts);
        assert!(svg.contains("a&lt;b&amp;c"));
        assert!(svg.contains('…'));
        assert!(!svg.contains("a<b"));
    }

    #[test]
    fn format_follows_the_extension() {
        assert_eq!(Format::from_path(Path::new("a/b.svg")), Some(Format::Svg));
        assert_eq!(Format::from_path(Path::new("b.png")), Some(Format::Png));
        assert_eq!(Format::from_path(Path::new("b.jpg")), None);
        assert_eq!(Format::from_path(Path::new("png")), None);
        assert_eq!(Format::Png.extension(), "png");
    }

    #[test]
    fn png_decodes_and_draws_the_scene() {
        let pts = points(3);
        let png = render("kv-overlap-weight", &pts, Format::Png);
        let (w, h, rgb) = decode_png(&png).expect("a valid PNG");
        assert_eq!((w, h), (1000, 760));
        assert!(png.len() < 100_000, "{} bytes", png.len());
        let at = |x: i32, y: i32| {
            let i = (y as usize * 1000 + x as usize) * 3;
            Rgb(rgb[i], rgb[i + 1], rgb[i + 2])
        };
        // Legend swatches (740..752 × 390 + 18i ..+12) hold their series colours.
        for (i, color) in COLORS.iter().take(3).enumerate() {
            let y0 = 390 + 18 * i as i32;
            for (x, y) in [(741, y0 + 1), (746, y0 + 6), (751, y0 + 11)] {
                assert_eq!(at(x, y), *color, "swatch {i} at ({x}, {y})");
            }
        }
        // Frames: the top-left panel's left edge at x = 80 from y = 50 down to the first dot.
        assert!((50..=290).all(|y| at(80, y) == FRAME));
        // A hit-rate dot at the first point: x = 80, y = 300 (0%).
        let shapes = scene("kv-overlap-weight", &pts);
        let Some(Shape::Circle { cx, cy, .. }) =
            shapes.iter().find(|s| matches!(s, Shape::Circle { .. }))
        else {
            panic!("no dots in the scene");
        };
        assert_eq!(at(pix(*cx) + 1, pix(*cy) - 2), COLORS[0]);
        // Every text has ink in its box and none outside the canvas width.
        let mut texts = 0;
        for s in &shapes {
            if let Shape::Text {
                x,
                y,
                size,
                anchor,
                text,
            } = s
            {
                let scale = if *size >= 14 { 2 } else { 1 };
                let tw = raster::text_width(text, scale);
                let left = match anchor {
                    Anchor::Start => pix(*x),
                    Anchor::Middle => pix(*x) - tw / 2,
                    Anchor::End => pix(*x) - tw,
                };
                let top = pix(*y) - raster::CAP_H * scale;
                let inked = (top..top + 9 * scale)
                    .flat_map(|y| (left..left + tw).map(move |x| (x, y)))
                    .filter(|(x, y)| at(*x, *y) == Rgb::BLACK)
                    .count();
                assert!(inked > 3 * text.len(), "{text:?}: {inked} dark pixels");
                assert!(left >= 0 && left + tw <= 1000, "{text:?} off the canvas");
                texts += 1;
            }
        }
        assert_eq!(texts, 3 * 7 + 12 + 3);
    }

    #[test]
    fn png_survives_degenerate_points() {
        for pts in [Vec::new(), points(1), {
            let mut p = points(2);
            p[1].ttft_ms.clear();
            p[0].hit_rate = f64::NAN;
            p
        }] {
            let png = render("x", &pts, Format::Png);
            assert!(decode_png(&png).is_ok());
        }
    }
}
