//! Charts as SVG or PNG files, drawn with `plotters`.
//!
//! - [`sweep()`]: `infera replay --plot`: one panel per metric, the swept parameter on the
//!   x-axis, one line per value of the other swept parameters, one legend for the figure;
//! - [`pareto()`]: configurations as points on two metrics, the Pareto front joined, every point
//!   numbered and named in a key beside the plot, a recommended point ringed.
//!
//! Both formats come from the same drawing code through plotters' SVG and bitmap backends; the
//! bitmap is encoded as an 8-bit RGB PNG. Text is measured (and, in a PNG, drawn) with the DejaVu
//! Sans subset embedded from `fixtures/fonts/` (printable Latin-1 and a few punctuation marks;
//! other characters draw as the font's missing-glyph box), so nothing depends on the fonts
//! installed where it runs. An SVG names `sans-serif` and is drawn in its viewer's font.

mod pareto;
mod sweep;

pub use pareto::{Pareto, ParetoPoint, pareto};
pub use sweep::{METRICS, SweepRun, sweep};

use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::Path;
use std::sync::OnceLock;

/// The output format of a chart.
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

/// Why a chart could not be drawn. None of these is worth retrying: each is a bug or a resource
/// failure of this process.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("the embedded plot font (fixtures/fonts/DejaVuSans-Latin1.ttf) did not parse")]
    Font,
    #[error("drawing the chart: {0}")]
    Draw(String),
    #[error("encoding the PNG: {0}")]
    Png(#[from] png::EncodingError),
}

/// The font family every text style names; [`register_font`] binds it to the embedded font.
const FAMILY: &str = "sans-serif";
static FONT_TTF: &[u8] = include_bytes!("../../fixtures/fonts/DejaVuSans-Latin1.ttf");

/// Tableau's ten categorical colours: series `i` is `PALETTE[i % 10]`.
const PALETTE: [RGBColor; 10] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x7f, 0x7f, 0x7f),
    RGBColor(0xbc, 0xbd, 0x22),
    RGBColor(0x17, 0xbe, 0xcf),
];
const GRID: RGBColor = RGBColor(0xe4, 0xe4, 0xe4);
/// Every chart's width, title band and label size, so the sweep and the Pareto chart match.
const WIDTH: u32 = 1200;
const TITLE_H: u32 = 44;
const LABEL_PX: u32 = 14;

/// A figure of a fixed size that draws itself on any plotters backend.
trait Figure {
    /// Width and height in pixels.
    fn size(&self) -> (u32, u32);
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<(), DrawError<DB>>;
}

type DrawError<DB> = DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>;

/// Binds [`FAMILY`] to the embedded font, once per process.
fn register_font() -> Result<(), PlotError> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = REGISTERED.get_or_init(|| {
        plotters::style::register_font(FAMILY, FontStyle::Normal, FONT_TTF).is_ok()
    });
    if *ok { Ok(()) } else { Err(PlotError::Font) }
}

/// Draws `fig` on a white background as the bytes of a `format` file.
fn render(fig: &impl Figure, format: Format) -> Result<Vec<u8>, PlotError> {
    register_font()?;
    let (w, h) = fig.size();
    match format {
        Format::Svg => {
            let mut svg = String::new();
            draw_on(
                fig,
                &SVGBackend::with_string(&mut svg, (w, h)).into_drawing_area(),
            )?;
            Ok(svg.into_bytes())
        }
        Format::Png => {
            let mut rgb = vec![0u8; w as usize * h as usize * 3];
            draw_on(
                fig,
                &BitMapBackend::with_buffer(&mut rgb, (w, h)).into_drawing_area(),
            )?;
            let mut out = Vec::new();
            let mut encoder = png::Encoder::new(&mut out, w, h);
            encoder.set_color(png::ColorType::Rgb);
            encoder.set_depth(png::BitDepth::Eight);
            let mut writer = encoder.write_header()?;
            writer.write_image_data(&rgb)?;
            writer.finish()?;
            Ok(out)
        }
    }
}

fn draw_on<DB: DrawingBackend>(
    fig: &impl Figure,
    root: &DrawingArea<DB, Shift>,
) -> Result<(), PlotError> {
    let err = |e: DrawError<DB>| PlotError::Draw(e.to_string());
    root.fill(&WHITE).map_err(err)?;
    fig.draw(root).map_err(err)?;
    root.present().map_err(err)
}

/// A text style of the embedded font at `size` pixels.
fn font(size: u32) -> TextStyle<'static> {
    TextStyle::from((FAMILY, size).into_font())
}

/// The width in pixels of `text` at `size` pixels, as the embedded font lays it out.
fn text_width(text: &str, size: u32) -> u32 {
    (FAMILY, size)
        .into_font()
        .box_size(text)
        .map_or(text.chars().count() as u32 * size * 3 / 5, |(w, _)| w)
}

/// `s` cut to at most `max` characters, the last of them an ellipsis when cut.
fn shorten(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_owned()
    } else {
        let mut out: String = s.chars().take(max.saturating_sub(1)).collect();
        out.push('…');
        out
    }
}

/// The smallest 1, 2, 2.5 or 5 × 10^k at or above `v` (1 for anything not above 0).
fn nice_ceiling(v: f64) -> f64 {
    if v.is_nan() || v <= 0.0 || v.is_infinite() {
        return 1.0;
    }
    let mag = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 2.5, 5.0, 10.0]
        .into_iter()
        .map(|m| m * mag)
        .find(|c| *c >= v * (1.0 - 1e-12))
        .unwrap_or(10.0 * mag)
}

/// An axis label for `v` on an axis spanning `span`: as many decimals as the span needs, no
/// trailing zeros, thousands as `k` on an axis spanning 10,000 or more.
fn tick(v: f64, span: f64) -> String {
    if span >= 10_000.0 && v != 0.0 {
        return format!("{}k", tick(v / 1000.0, span / 1000.0));
    }
    // Two significant digits of the span, at least: what a tick step on it can need.
    let decimals = if span > 0.0 && span.is_finite() {
        (2.0 - span.log10().floor()).clamp(0.0, 6.0) as usize
    } else {
        2
    };
    let s = format!("{v:.decimals$}");
    let s = if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        s
    };
    if s == "-0" { "0".into() } else { s }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_follows_the_extension() {
        assert_eq!(Format::from_path(Path::new("a/b.svg")), Some(Format::Svg));
        assert_eq!(Format::from_path(Path::new("b.png")), Some(Format::Png));
        assert_eq!(Format::from_path(Path::new("b.jpg")), None);
        assert_eq!(Format::from_path(Path::new("png")), None);
        assert_eq!(Format::Png.extension(), "png");
    }

    #[test]
    fn axis_helpers() {
        assert_eq!(nice_ceiling(37.0), 50.0);
        assert_eq!(nice_ceiling(100.0), 100.0);
        assert_eq!(nice_ceiling(0.0), 1.0);
        assert_eq!(nice_ceiling(f64::NAN), 1.0);
        assert_eq!(nice_ceiling(0.23), 0.25);
        assert_eq!(tick(12_500.0, 20_000.0), "12.5k");
        assert_eq!(tick(5_000.0, 20_000.0), "5k");
        assert_eq!(tick(0.0, 20_000.0), "0");
        assert_eq!(tick(250.0, 500.0), "250");
        assert_eq!(tick(1.25, 1.5), "1.25");
        assert_eq!(tick(1.5, 5.0), "1.5");
        assert_eq!(tick(0.005, 0.05), "0.005");
        assert_eq!(tick(2.5, 20.0), "2.5");
        assert_eq!(tick(-0.0001, 1.0), "0");
        assert_eq!(shorten("abcdef", 4), "abc…");
        assert_eq!(shorten("abc", 4), "abc");
    }

    #[test]
    fn the_embedded_font_measures_text() {
        register_font().expect("the embedded font parses");
        let narrow = text_width("iii", 14);
        let wide = text_width("WWW", 14);
        assert!(narrow > 0 && wide > 2 * narrow, "{narrow} vs {wide}");
        assert!(text_width("WWW", 28) > wide);
    }
}
