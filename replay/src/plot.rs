//! `--plot FILE.svg`: block hit rate and TTFT p50 against the swept value, and the TTFT CDF of each
//! configuration, as a self-contained SVG (no fonts or libraries needed to view it).

use std::fmt::Write as _;

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

const COLORS: [&str; 8] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
];
const W: f64 = 1000.0;
const H: f64 = 760.0;

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

    fn frame(&self, svg: &mut String, title: &str, xlabel: &str, yfmt: &dyn Fn(f64) -> String) {
        let _ = write!(
            svg,
            r##"<rect x="{:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="none" stroke="#444"/>"##,
            self.x0, self.y0, self.w, self.h
        );
        let _ = write!(
            svg,
            r##"<text x="{:.1}" y="{:.1}" font-size="15" text-anchor="middle" font-family="sans-serif">{}</text>"##,
            self.x0 + self.w / 2.0,
            self.y0 - 10.0,
            esc(title)
        );
        let _ = write!(
            svg,
            r##"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle" font-family="sans-serif">{}</text>"##,
            self.x0 + self.w / 2.0,
            self.y0 + self.h + 36.0,
            esc(xlabel)
        );
        for k in 0..=4 {
            let y = self.ymin + (self.ymax - self.ymin) * k as f64 / 4.0;
            let py = self.py(y);
            let _ = write!(
                svg,
                r##"<line x1="{:.1}" y1="{py:.1}" x2="{:.1}" y2="{py:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" font-size="11" text-anchor="end" font-family="sans-serif">{}</text>"##,
                self.x0,
                self.x0 + self.w,
                self.x0 - 6.0,
                py + 4.0,
                esc(&yfmt(y))
            );
        }
    }

    fn xticks(&self, svg: &mut String, ticks: &[(f64, String)]) {
        for (x, label) in ticks {
            let px = self.px(*x);
            let _ = write!(
                svg,
                r##"<text x="{px:.1}" y="{:.1}" font-size="11" text-anchor="middle" font-family="sans-serif">{}</text>"##,
                self.y0 + self.h + 16.0,
                esc(label)
            );
        }
    }

    fn polyline(&self, svg: &mut String, pts: &[(f64, f64)], color: &str, dots: bool) {
        let path: Vec<String> = pts
            .iter()
            .map(|(x, y)| format!("{:.1},{:.1}", self.px(*x), self.py(*y)))
            .collect();
        let _ = write!(
            svg,
            r##"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"##,
            path.join(" ")
        );
        if dots {
            for (x, y) in pts {
                let _ = write!(
                    svg,
                    r##"<circle cx="{:.1}" cy="{:.1}" r="3.5" fill="{color}"/>"##,
                    self.px(*x),
                    self.py(*y)
                );
            }
        }
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
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

/// Renders the plot. `axis` names the swept option (or "configuration").
pub fn render(axis: &str, points: &[PlotPoint]) -> String {
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
    let mut svg = format!(
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}"><rect width="100%" height="100%" fill="white"/>"##
    );
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
    hit.frame(&mut svg, "block hit rate", axis, &|y| format!("{y:.0}%"));
    hit.xticks(&mut svg, &ticks);
    let pts: Vec<(f64, f64)> = xs
        .iter()
        .zip(points)
        .map(|(x, p)| (*x, p.hit_rate * 100.0))
        .collect();
    hit.polyline(&mut svg, &pts, COLORS[0], true);
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
    ttft.frame(&mut svg, "TTFT p50", axis, &|y| format!("{y:.0} ms"));
    ttft.xticks(&mut svg, &ticks);
    let pts: Vec<(f64, f64)> = xs
        .iter()
        .zip(points)
        .map(|(x, p)| (*x, p.ttft_p50_ms))
        .collect();
    ttft.polyline(&mut svg, &pts, COLORS[1], true);
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
    cdf.frame(&mut svg, "TTFT CDF", "TTFT (ms)", &|y| {
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
    cdf.xticks(&mut svg, &cticks);
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
        cdf.polyline(&mut svg, &pts, color, false);
        let ly = 390.0 + 18.0 * i as f64;
        let _ = write!(
            svg,
            r##"<rect x="740" y="{:.1}" width="12" height="12" fill="{color}"/><text x="758" y="{:.1}" font-size="12" font-family="sans-serif">{}</text>"##,
            ly,
            ly + 10.0,
            esc(&format!("#{} {}", i + 1, short(&p.label)))
        );
    }
    svg.push_str("</svg>\n");
    svg
}

fn short(s: &str) -> String {
    if s.chars().count() <= 34 {
        s.to_owned()
    } else {
        format!("{}…", s.chars().take(33).collect::<String>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_valid_looking_svg() {
        let pts: Vec<PlotPoint> = (0..3)
            .map(|i| PlotPoint {
                label: format!("w={i}"),
                x: Some(i as f64),
                hit_rate: 0.1 * i as f64,
                ttft_p50_ms: 100.0 + i as f64,
                ttft_ms: vec![1.0, 2.0, 50.0 * (i + 1) as f64],
            })
            .collect();
        let svg = render("kv-overlap-weight", &pts);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 2 + 3);
        assert!(svg.contains("kv-overlap-weight"));
        assert!(nice_max(37.0) == 50.0 && nice_max(0.0) == 1.0);
    }
}
