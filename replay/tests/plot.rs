//! Charts drawn from real sweeps of the conversation trace fixture: the files are valid SVG and
//! PNG, hold one panel per metric and one line per value of the second `--sweep`, and
//! degenerate input (one configuration, none, values that are not numbers) still draws.

use infera_replay::plot::{self, Format, METRICS, Pareto, ParetoPoint, SweepRun};
use infera_replay::report::Summary;
use infera_replay::sim::SimConfig;
use infera_replay::sweep::{self, Point, SweepAxis};
use infera_replay::trace::{self, LoadOptions};
use std::path::Path;

/// The first 120 requests of the conversation trace through every point of `axes`.
fn run(axes: &[&str]) -> (Vec<SweepAxis>, Vec<Point>, Vec<Summary>) {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/traces/conversation_trace.parquet");
    let mut tr = trace::load(&path, &LoadOptions::default()).expect("the fixture loads");
    tr.requests.truncate(120);
    let ideal = trace::summarize(&tr).ideal_hit_rate;
    let mut base = SimConfig::default();
    base.engine.gpu_blocks = 1024;
    let axes: Vec<SweepAxis> = axes.iter().map(|a| a.parse().expect("axis")).collect();
    let points = sweep::grid(&base, &axes).expect("grid");
    let summaries = sweep::run_all(&tr, &points, &|| {})
        .into_iter()
        .map(|r| Summary::of(&r.expect("the simulation runs"), ideal))
        .collect();
    (axes, points, summaries)
}

fn runs<'a>(points: &'a [Point], summaries: &'a [Summary]) -> Vec<SweepRun<'a>> {
    points
        .iter()
        .zip(summaries)
        .map(|(p, s)| SweepRun {
            values: &p.values,
            summary: s,
        })
        .collect()
}

fn svg_text(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes).expect("an SVG is UTF-8")
}

/// What the SVG holds, parsed as XML.
struct Svg {
    size: (u32, u32),
    texts: Vec<String>,
    /// `stroke` (lowercase) and point count of each polyline.
    polylines: Vec<(String, usize)>,
    /// `fill` (lowercase) of each circle.
    circles: Vec<String>,
}

fn parse_svg(svg: &str) -> Svg {
    let doc = roxmltree::Document::parse(svg).expect("the SVG parses as XML");
    let root = doc.root_element();
    assert_eq!(root.tag_name().name(), "svg");
    let dim = |a: &str| -> u32 {
        root.attribute(a)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("svg {a}"))
    };
    let lower = |n: &roxmltree::Node<'_, '_>, a: &str| n.attribute(a).unwrap_or("").to_lowercase();
    let nodes: Vec<roxmltree::Node<'_, '_>> =
        doc.descendants().filter(|n| n.is_element()).collect();
    Svg {
        size: (dim("width"), dim("height")),
        texts: nodes
            .iter()
            .filter(|n| n.has_tag_name("text"))
            .map(|n| n.text().unwrap_or("").trim().to_owned())
            .collect(),
        polylines: nodes
            .iter()
            .filter(|n| n.has_tag_name("polyline"))
            .map(|n| {
                let pts = n
                    .attribute("points")
                    .unwrap_or("")
                    .split_whitespace()
                    .count();
                (lower(n, "stroke"), pts)
            })
            .collect(),
        circles: nodes
            .iter()
            .filter(|n| n.has_tag_name("circle"))
            .map(|n| lower(n, "fill"))
            .collect(),
    }
}

impl Svg {
    fn count(&self, text: &str) -> usize {
        self.texts.iter().filter(|t| t.as_str() == text).count()
    }
}

const BLUE: &str = "#1f77b4";
const ORANGE: &str = "#ff7f0e";

/// Decodes a PNG: its size and whether it holds a pixel of `rgb`.
fn decode_png(bytes: &[u8]) -> ((u32, u32), Vec<u8>) {
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "PNG signature");
    let mut reader = png::Decoder::new(std::io::Cursor::new(bytes))
        .read_info()
        .expect("a PNG header");
    let mut buf = vec![0; reader.output_buffer_size().expect("a buffer size")];
    let info = reader.next_frame(&mut buf).expect("a PNG frame");
    assert_eq!(info.color_type, png::ColorType::Rgb);
    buf.truncate(info.buffer_size());
    ((info.width, info.height), buf)
}

fn has_pixel(rgb: &[u8], color: [u8; 3]) -> bool {
    rgb.chunks_exact(3).any(|p| p == color)
}

#[test]
fn a_two_parameter_sweep_has_a_panel_per_metric_and_a_line_per_policy() {
    let (axes, points, summaries) = run(&[
        "router-policy=round-robin,kv-aware",
        "kv-overlap-weight=0,1,4,16",
    ]);
    let runs = runs(&points, &summaries);
    let svg = parse_svg(&svg_text(
        plot::sweep(&axes, &runs, Format::Svg).expect("the SVG draws"),
    ));
    for m in &METRICS {
        assert_eq!(svg.count(m.title), 1, "{}: {:?}", m.title, svg.texts);
    }
    // The numeric parameter across, in every panel; the legend names the other once.
    assert_eq!(svg.count("kv-overlap-weight"), METRICS.len());
    for w in ["0", "1", "4", "16"] {
        assert!(svg.count(w) >= METRICS.len(), "x label {w}");
    }
    assert_eq!(svg.count("router-policy:"), 1);
    assert_eq!(svg.count("round-robin"), 1);
    assert_eq!(svg.count("kv-aware"), 1);
    // One four-point line per policy per panel, a dot per configuration and legend entry.
    for color in [BLUE, ORANGE] {
        let lines: Vec<usize> = svg
            .polylines
            .iter()
            .filter(|(s, _)| s == color)
            .map(|(_, n)| *n)
            .collect();
        // Each panel's line plus the legend swatch (two points).
        assert_eq!(
            lines.iter().filter(|n| **n == 4).count(),
            METRICS.len(),
            "{color}"
        );
        assert_eq!(lines.iter().filter(|n| **n == 2).count(), 1, "{color}");
        let dots = svg.circles.iter().filter(|f| *f == color).count();
        assert_eq!(dots, METRICS.len() * 4 + 1, "{color}");
    }

    let png = plot::sweep(&axes, &runs, Format::Png).expect("the PNG draws");
    let (size, rgb) = decode_png(&png);
    assert_eq!(size, svg.size, "the PNG and the SVG have one layout");
    assert!(has_pixel(&rgb, [0x1f, 0x77, 0xb4]) && has_pixel(&rgb, [0xff, 0x7f, 0x0e]));
    assert!(has_pixel(&rgb, [0, 0, 0]), "text is drawn");
}

#[test]
fn a_one_parameter_sweep_has_one_line_per_panel_and_no_legend() {
    let (axes, points, summaries) = run(&["router-policy=round-robin,kv-aware"]);
    let runs = runs(&points, &summaries);
    let svg = parse_svg(&svg_text(
        plot::sweep(&axes, &runs, Format::Svg).expect("the SVG draws"),
    ));
    assert_eq!(svg.count("router-policy"), METRICS.len());
    assert_eq!(svg.count("round-robin"), METRICS.len());
    assert!(
        !svg.texts.iter().any(|t| t.ends_with(':')),
        "no legend title"
    );
    let lines: Vec<&(String, usize)> = svg.polylines.iter().filter(|(s, _)| s == BLUE).collect();
    assert_eq!(lines.len(), METRICS.len());
    assert!(lines.iter().all(|(_, n)| *n == 2));
    decode_png(&plot::sweep(&axes, &runs, Format::Png).expect("the PNG draws"));
}

#[test]
fn one_configuration_no_configuration_and_bad_values_still_draw() {
    let (axes, points, summaries) = run(&[]);
    assert!(axes.is_empty() && points.len() == 1);
    let one = runs(&points, &summaries);
    let mut broken = summaries[0].clone();
    broken.hit_rate = f64::NAN;
    broken.ttft_p50_ms = f64::INFINITY;
    broken.output_tokens_per_s = -1.0;
    let broken_runs = [SweepRun {
        values: &points[0].values,
        summary: &broken,
    }];
    for (runs, dots) in [
        (&one[..], METRICS.len()),
        (&[][..], 0),
        (&broken_runs[..], 4),
    ] {
        let svg = parse_svg(&svg_text(
            plot::sweep(&axes, runs, Format::Svg).expect("the SVG draws"),
        ));
        assert_eq!(svg.circles.iter().filter(|f| *f == BLUE).count(), dots);
        assert!(svg.polylines.iter().all(|(s, _)| s != BLUE), "no line");
        for m in &METRICS {
            assert_eq!(svg.count(m.title), 1);
        }
        decode_png(&plot::sweep(&axes, runs, Format::Png).expect("the PNG draws"));
    }
}

fn pareto_points() -> Vec<ParetoPoint> {
    let (_, points, summaries) = run(&[
        "router-policy=round-robin,kv-aware",
        "kv-overlap-weight=0,1,4,16",
    ]);
    let mut pts: Vec<ParetoPoint> = points
        .iter()
        .zip(&summaries)
        .map(|(p, s)| ParetoPoint {
            label: p.label.clone(),
            x: s.ttft_p50_ms,
            y: s.hit_rate * 100.0,
            on_front: false,
        })
        .collect();
    // Lower TTFT and higher hit rate are better.
    for i in 0..pts.len() {
        let dominated = pts
            .iter()
            .any(|q| q.x <= pts[i].x && q.y >= pts[i].y && (q.x < pts[i].x || q.y > pts[i].y));
        pts[i].on_front = !dominated;
    }
    pts
}

#[test]
fn a_pareto_chart_numbers_keys_and_rings_its_points() {
    let pts = pareto_points();
    let front = pts.iter().filter(|p| p.on_front).count();
    assert!(front >= 1);
    let best = pts.iter().position(|p| p.on_front).expect("a front");
    let chart = Pareto {
        title: "kv-overlap-weight × router-policy: TTFT p50 against hit rate",
        x_label: "TTFT p50 (ms)",
        y_label: "block hit rate (%)",
        points: &pts,
        recommended: Some(best),
    };
    let svg = parse_svg(&svg_text(
        plot::pareto(&chart, Format::Svg).expect("the SVG draws"),
    ));
    // The key wraps "(recommended)" after the label when the line would be too long.
    let recommended = format!("{} (recommended)", pts[best].label);
    assert!(
        svg.count(&recommended) == 1
            || (svg.count(&pts[best].label) == 1 && svg.count("(recommended)") == 1),
        "{:?}",
        svg.texts
    );
    for (i, p) in pts.iter().enumerate() {
        if i != best {
            assert_eq!(svg.count(&p.label), 1, "{}", p.label);
        }
        // In the key and beside the point.
        assert!(svg.count(&(i + 1).to_string()) >= 2, "number {}", i + 1);
    }
    assert_eq!(svg.count("TTFT p50 (ms)"), 1);
    assert_eq!(svg.count("block hit rate (%)"), 1);
    // Front dots in the plot and the key, and one saying what they mean; the front joined.
    assert_eq!(
        svg.circles.iter().filter(|f| *f == BLUE).count(),
        2 * front + 1
    );
    assert_eq!(svg.count("on the front"), 1);
    assert_eq!(svg.count("recommended"), 1);
    assert_eq!(svg.polylines.iter().filter(|(s, _)| s == BLUE).count(), 1);
    let (size, rgb) = decode_png(&plot::pareto(&chart, Format::Png).expect("the PNG draws"));
    assert_eq!(size, svg.size);
    assert!(has_pixel(&rgb, [0xff, 0x7f, 0x0e]), "the recommended ring");
}

#[test]
fn a_pareto_chart_of_nothing_or_of_non_numbers_still_draws() {
    let odd = [
        ParetoPoint {
            label: "nan".into(),
            x: f64::NAN,
            y: 1.0,
            on_front: true,
        },
        ParetoPoint {
            label: "one".into(),
            x: 5.0,
            y: 5.0,
            on_front: true,
        },
    ];
    for (points, recommended) in [(&[][..], None), (&odd[..], Some(0)), (&odd[..], Some(7))] {
        let chart = Pareto {
            title: "t",
            x_label: "x",
            y_label: "y",
            points,
            recommended,
        };
        for format in [Format::Svg, Format::Png] {
            plot::pareto(&chart, format).expect("draws");
        }
    }
}
