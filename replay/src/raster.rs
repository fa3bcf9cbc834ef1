//! A tiny software rasteriser and PNG encoder for `--plot FILE.png`, so that the plot needs no
//! image, font or compression crates.
//!
//! - [`Canvas`]: an 8-bit RGB pixel buffer (row-major, top-left origin, y down). Every drawing call
//!   clips to the canvas, so shapes may start or end outside it; nothing is anti-aliased.
//! - Lines ([`Canvas::line`]) are Bresenham with a square pen 1–3 px wide; rectangles and circles
//!   are filled; text ([`Canvas::text`]) uses the built-in 5×7 bitmap font below, scaled by an
//!   integer factor, with two rows of descender under the baseline.
//! - Text is printable ASCII (0x20–0x7E). [`fold_ascii`] maps the few non-ASCII characters the
//!   reports use (`…`, `—`, `–`, `×`, `µ`, `≤`, `≥`) to ASCII look-alikes; anything else is drawn as
//!   a hollow box.
//!
//! # PNG layout ([`Canvas::to_png`])
//!
//! ```text
//! 89 50 4E 47 0D 0A 1A 0A                 signature
//! chunk IHDR (13 bytes)                   width u32 BE, height u32 BE, bit depth 8,
//!                                         colour type 2 (RGB), compression 0, filter 0,
//!                                         interlace 0
//! chunk IDAT (one chunk, all the data)    zlib stream: CMF 0x78, FLG 0x01 (32 KiB window, no
//!                                         dictionary), one final fixed-Huffman deflate block
//!                                         (BTYPE 01), Adler-32 of the raw scanlines (u32 BE)
//! chunk IEND (0 bytes)
//! ```
//!
//! Every chunk is `length u32 BE | type (4 ASCII bytes) | data | CRC-32 u32 BE`, the CRC taken
//! over type and data (ISO-HDLC polynomial, reflected, as PNG and zlib use). The raw scanlines
//! are `height` rows of `1 + 3 × width` bytes: filter type 2 ("Up": each byte minus the byte
//! above it, modulo 256; the row above the first is zeros) then R, G, B per pixel. The deflate
//! encoder is greedy LZ77 over a 32 KiB window (hash chains on 3-byte prefixes, matches of
//! 3–258 bytes); with the Up filter, repeated rows become runs of zeros, so a plot compresses to
//! tens of kilobytes.

/// An RGB colour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rgb(pub u8, pub u8, pub u8);

impl Rgb {
    pub const WHITE: Rgb = Rgb(255, 255, 255);
    pub const BLACK: Rgb = Rgb(0, 0, 0);
}

/// Width of one glyph in font pixels; glyphs advance by `GLYPH_W + 1`.
pub const GLYPH_W: i32 = 5;
/// Height of a capital letter in font pixels: the baseline is under row `CAP_H - 1`.
pub const CAP_H: i32 = 7;
/// Rows per glyph: `CAP_H` plus two rows of descender (`g`, `j`, `p`, `q`, `y`, `,`, `;`, `_`).
const GLYPH_ROWS: usize = 9;
/// Glyphs: printable ASCII 0x20–0x7E in order, then the box drawn for anything else.
const GLYPHS: usize = 96;
const BOX: usize = GLYPHS - 1;
const PER_BAND: usize = 12;

/// The font, drawn as it looks: bands of twelve glyphs, each glyph five columns of `#` (ink) or
/// `.` (paper) and nine rows, glyphs one space apart. Checked and packed at compile time.
#[rustfmt::skip]
const FONT_ART: [&str; GLYPH_ROWS * GLYPHS / PER_BAND] = [
    //         !     "     #     $     %     &     '     (     )     *     +
    "..... ..#.. .#.#. .#.#. ..#.. ##... .##.. ..#.. ...#. .#... ..... .....",
    "..... ..#.. .#.#. .#.#. .#### ##..# #..#. ..#.. ..#.. ..#.. ..#.. ..#..",
    "..... ..#.. .#.#. ##### #.#.. ...#. #.#.. .#... .#... ...#. #.#.# ..#..",
    "..... ..#.. ..... .#.#. .###. ..#.. .#... ..... .#... ...#. .###. #####",
    "..... ..#.. ..... ##### ..#.# .#... #.#.# ..... .#... ...#. #.#.# ..#..",
    "..... ..... ..... .#.#. ####. #..## #..#. ..... ..#.. ..#.. ..#.. ..#..",
    "..... ..#.. ..... .#.#. ..#.. ...## .##.# ..... ...#. .#... ..... .....",
    "..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... .....",
    "..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... .....",
    //   ,     -     .     /     0     1     2     3     4     5     6     7
    "..... ..... ..... ..... .###. ..#.. .###. ##### ...#. ##### ..##. #####",
    "..... ..... ..... ....# #...# .##.. #...# ...#. ..##. #.... .#... ....#",
    "..... ..... ..... ...#. #..## ..#.. ....# ..#.. .#.#. ####. #.... ...#.",
    "..... .###. ..... ..#.. #.#.# ..#.. ...#. ...#. #..#. ....# ####. ..#..",
    "..... ..... ..... .#... ##..# ..#.. ..#.. ....# ##### ....# #...# .#...",
    ".##.. ..... .##.. #.... #...# ..#.. .#... #...# ...#. #...# #...# .#...",
    ".##.. ..... .##.. ..... .###. .###. ##### .###. ...#. .###. .###. .#...",
    "..#.. ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... .....",
    ".#... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... .....",
    //   8     9     :     ;     <     =     >     ?     @     A     B     C
    ".###. .###. ..... ..... ...#. ..... .#... .###. .###. .###. ####. .###.",
    "#...# #...# .##.. .##.. ..#.. ..... ..#.. #...# #...# #...# #...# #...#",
    "#...# #...# .##.. .##.. .#... ##### ...#. ....# ....# #...# #...# #....",
    ".###. .#### ..... ..... #.... ..... ....# ...#. .##.# ##### ####. #....",
    "#...# ....# .##.. .##.. .#... ##### ...#. ..#.. #.#.# #...# #...# #....",
    "#...# ...#. .##.. .##.. ..#.. ..... ..#.. ..... #.#.# #...# #...# #...#",
    ".###. .##.. ..... ..#.. ...#. ..... .#... ..#.. .###. #...# ####. .###.",
    "..... ..... ..... .#... ..... ..... ..... ..... ..... ..... ..... .....",
    "..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... .....",
    //   D     E     F     G     H     I     J     K     L     M     N     O
    "###.. ##### ##### .###. #...# .###. ..### #...# #.... #...# #...# .###.",
    "#..#. #.... #.... #...# #...# ..#.. ...#. #..#. #.... ##.## #...# #...#",
    "#...# #.... #.... #.... #...# ..#.. ...#. #.#.. #.... #.#.# ##..# #...#",
    "#...# ####. ####. #.### ##### ..#.. ...#. ##... #.... #.#.# #.#.# #...#",
    "#...# #.... #.... #...# #...# ..#.. ...#. #.#.. #.... #...# #..## #...#",
    "#..#. #.... #.... #...# #...# ..#.. #..#. #..#. #.... #...# #...# #...#",
    "###.. ##### #.... .#### #...# .###. .##.. #...# ##### #...# #...# .###.",
    "..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... .....",
    "..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... .....",
    //   P     Q     R     S     T     U     V     W     X     Y     Z     [
    "####. .###. ####. .#### ##### #...# #...# #...# #...# #...# ##### .###.",
    "#...# #...# #...# #.... ..#.. #...# #...# #...# #...# #...# ....# .#...",
    "#...# #...# #...# #.... ..#.. #...# #...# #...# .#.#. .#.#. ...#. .#...",
    "####. #...# ####. .###. ..#.. #...# #...# #.#.# ..#.. ..#.. ..#.. .#...",
    "#.... #.#.# #.#.. ....# ..#.. #...# #...# #.#.# .#.#. ..#.. .#... .#...",
    "#.... #..#. #..#. ....# ..#.. #...# .#.#. #.#.# #...# ..#.. #.... .#...",
    "#.... .##.# #...# ####. ..#.. .###. ..#.. .#.#. #...# ..#.. ##### .###.",
    "..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... .....",
    "..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... .....",
    //   \     ]     ^     _     `     a     b     c     d     e     f     g
    "..... .###. ..#.. ..... .#... ..... #.... ..... ....# ..... ..##. .....",
    "#.... ...#. .#.#. ..... ..#.. ..... #.... ..... ....# ..... .#..# .....",
    ".#... ...#. #...# ..... ...#. .###. #.##. .###. .##.# .###. .#... .####",
    "..#.. ...#. ..... ..... ..... ....# ##..# #.... #..## #...# ###.. #...#",
    "...#. ...#. ..... ..... ..... .#### #...# #.... #...# ##### .#... #...#",
    "....# ...#. ..... ..... ..... #...# #...# #...# #...# #.... .#... #...#",
    "..... .###. ..... ..... ..... .#### ####. .###. .#### .###. .#... .####",
    "..... ..... ..... ##### ..... ..... ..... ..... ..... ..... ..... ....#",
    "..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... .###.",
    //   h     i     j     k     l     m     n     o     p     q     r     s
    "#.... ..#.. ...#. #.... .##.. ..... ..... ..... ..... ..... ..... .....",
    "#.... ..... ..... #.... ..#.. ..... ..... ..... ..... ..... ..... .....",
    "#.##. .##.. ..##. #..#. ..#.. ##.#. #.##. .###. ####. .#### #.##. .####",
    "##..# ..#.. ...#. #.#.. ..#.. #.#.# ##..# #...# #...# #...# ##..# #....",
    "#...# ..#.. ...#. ##... ..#.. #.#.# #...# #...# #...# #...# #.... .###.",
    "#...# ..#.. ...#. #.#.. ..#.. #.#.# #...# #...# #...# #...# #.... ....#",
    "#...# .###. ...#. #..#. .###. #.#.# #...# .###. ####. .#### #.... ####.",
    "..... ..... #..#. ..... ..... ..... ..... ..... #.... ....# ..... .....",
    "..... ..... .##.. ..... ..... ..... ..... ..... #.... ....# ..... .....",
    //   t     u     v     w     x     y     z     {     |     }     ~    box
    ".#... ..... ..... ..... ..... ..... ..... ...#. ..#.. .#... ..... #####",
    ".#... ..... ..... ..... ..... ..... ..... ..#.. ..#.. ..#.. ..... #...#",
    "###.. #...# #...# #...# #...# #...# ##### ..#.. ..#.. ..#.. .#... #...#",
    ".#... #...# #...# #...# .#.#. #...# ...#. .#... ..#.. ...#. #.#.# #...#",
    ".#... #...# #...# #.#.# ..#.. #...# ..#.. ..#.. ..#.. ..#.. ...#. #...#",
    ".#..# #..## .#.#. #.#.# .#.#. #...# .#... ..#.. ..#.. ..#.. ..... #...#",
    "..##. .##.# ..#.. .#.#. #...# .#### ##### ...#. ..#.. .#... ..... #####",
    "..... ..... ..... ..... ..... ....# ..... ..... ..#.. ..... ..... .....",
    "..... ..... ..... ..... ..... .###. ..... ..... ..#.. ..... ..... .....",
];

const FONT: [[u8; GLYPH_ROWS]; GLYPHS] = pack_font(&FONT_ART);

/// Packs [`FONT_ART`] into one byte per glyph row, bit 4 = leftmost column. Malformed art fails
/// the build.
const fn pack_font(art: &[&str; GLYPH_ROWS * GLYPHS / PER_BAND]) -> [[u8; GLYPH_ROWS]; GLYPHS] {
    let mut out = [[0u8; GLYPH_ROWS]; GLYPHS];
    let mut g = 0;
    while g < GLYPHS {
        let mut r = 0;
        while r < GLYPH_ROWS {
            let row = art[g / PER_BAND * GLYPH_ROWS + r].as_bytes();
            assert!(
                row.len() == PER_BAND * 6 - 1,
                "font art rows are 71 characters"
            );
            let mut bits = 0u8;
            let mut c = 0;
            while c < GLYPH_W as usize {
                let ch = row[g % PER_BAND * 6 + c];
                assert!(ch == b'#' || ch == b'.', "font art holds only '#' and '.'");
                if ch == b'#' {
                    bits |= 1 << (GLYPH_W as usize - 1 - c);
                }
                c += 1;
            }
            out[g][r] = bits;
            r += 1;
        }
        g += 1;
    }
    out
}

/// Maps `text` to the printable ASCII the font draws: the few typographic characters the reports
/// use become look-alikes (`…` → `...`); other characters outside 0x20–0x7E are left for
/// [`Canvas::text`] to draw as a box.
pub fn fold_ascii(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for ch in text.chars() {
        match ch {
            '…' => out.push_str("..."),
            '—' | '–' | '−' => out.push('-'),
            '×' => out.push('x'),
            'µ' | 'μ' => out.push('u'),
            '≤' => out.push_str("<="),
            '≥' => out.push_str(">="),
            '‘' | '’' => out.push('\''),
            '“' | '”' => out.push('"'),
            '\t' => out.push(' '),
            _ => out.push(ch),
        }
    }
    out
}

fn glyph(ch: char) -> &'static [u8; GLYPH_ROWS] {
    match ch {
        ' '..='~' => &FONT[ch as usize - 0x20],
        _ => &FONT[BOX],
    }
}

/// The width in pixels of `text` drawn at `scale` by [`Canvas::text`] (0 for empty text).
pub fn text_width(text: &str, scale: i32) -> i32 {
    let n = fold_ascii(text).chars().count() as i32;
    if n == 0 {
        0
    } else {
        (n * (GLYPH_W + 1) - 1) * scale
    }
}

/// An RGB image being drawn; see the module docs.
#[derive(Debug, Clone)]
pub struct Canvas {
    width: u32,
    height: u32,
    /// `width × height` pixels, 3 bytes each, row-major.
    rgb: Vec<u8>,
}

impl Canvas {
    /// A `width × height` canvas filled with `background`.
    pub fn new(width: u32, height: u32, background: Rgb) -> Self {
        let n = width as usize * height as usize;
        let mut rgb = Vec::with_capacity(n * 3);
        for _ in 0..n {
            rgb.extend_from_slice(&[background.0, background.1, background.2]);
        }
        Canvas { width, height, rgb }
    }

    pub fn width(&self) -> u32 {
        self.width
    }

    pub fn height(&self) -> u32 {
        self.height
    }

    /// The colour at (`x`, `y`), or `None` outside the canvas.
    pub fn pixel(&self, x: i32, y: i32) -> Option<Rgb> {
        let i = self.index(x, y)?;
        Some(Rgb(self.rgb[i], self.rgb[i + 1], self.rgb[i + 2]))
    }

    /// The raw pixels: `height` rows of `width` RGB triples.
    pub fn rgb(&self) -> &[u8] {
        &self.rgb
    }

    fn index(&self, x: i32, y: i32) -> Option<usize> {
        let (x, y) = (u32::try_from(x).ok()?, u32::try_from(y).ok()?);
        (x < self.width && y < self.height)
            .then(|| (y as usize * self.width as usize + x as usize) * 3)
    }

    /// Sets one pixel; outside the canvas does nothing.
    pub fn set(&mut self, x: i32, y: i32, c: Rgb) {
        if let Some(i) = self.index(x, y) {
            self.rgb[i..i + 3].copy_from_slice(&[c.0, c.1, c.2]);
        }
    }

    /// Fills the `w × h` rectangle whose top-left pixel is (`x`, `y`).
    pub fn fill_rect(&mut self, x: i32, y: i32, w: i32, h: i32, c: Rgb) {
        let x_end = x.saturating_add(w.max(0)).min(self.width as i32);
        let y_end = y.saturating_add(h.max(0)).min(self.height as i32);
        for py in y.max(0)..y_end {
            for px in x.max(0)..x_end {
                self.set(px, py, c);
            }
        }
    }

    /// Draws a line from (`x0`, `y0`) to (`x1`, `y1`) with a square pen `width` pixels wide
    /// (clamped to 1–3), centred on the line for odd widths and one pixel right/down of it for 2.
    /// Endpoints are rounded to pixels after clipping to the canvas, so far-away or non-finite
    /// coordinates cost nothing (non-finite ones draw nothing).
    pub fn line(&mut self, x0: f64, y0: f64, x1: f64, y1: f64, width: u32, c: Rgb) {
        let pen = width.clamp(1, 3) as i32;
        let margin = f64::from(pen);
        let bounds = (
            -margin,
            -margin,
            f64::from(self.width) + margin,
            f64::from(self.height) + margin,
        );
        let Some((x0, y0, x1, y1)) = clip(x0, y0, x1, y1, bounds) else {
            return;
        };
        let (mut x, mut y) = (x0.round() as i32, y0.round() as i32);
        let (x1, y1) = (x1.round() as i32, y1.round() as i32);
        let (dx, dy) = ((x1 - x).abs(), -(y1 - y).abs());
        let (sx, sy) = (if x < x1 { 1 } else { -1 }, if y < y1 { 1 } else { -1 });
        let mut err = dx + dy;
        let lo = -(pen - 1) / 2;
        loop {
            self.fill_rect(x + lo, y + lo, pen, pen, c);
            if x == x1 && y == y1 {
                break;
            }
            let e2 = 2 * err;
            if e2 >= dy {
                err += dy;
                x += sx;
            }
            if e2 <= dx {
                err += dx;
                y += sy;
            }
        }
    }

    /// Fills the disc of radius `r` centred on (`cx`, `cy`): every pixel whose centre lies within
    /// `r` of the centre (pixel (x, y) covers [x, x+1) × [y, y+1)).
    pub fn fill_circle(&mut self, cx: f64, cy: f64, r: f64, c: Rgb) {
        if !(cx.is_finite() && cy.is_finite() && r.is_finite()) || r <= 0.0 {
            return;
        }
        let x_lo = (cx - r).floor().max(0.0) as i32;
        let y_lo = (cy - r).floor().max(0.0) as i32;
        let x_hi = (cx + r).ceil().min(f64::from(self.width)) as i32;
        let y_hi = (cy + r).ceil().min(f64::from(self.height)) as i32;
        for y in y_lo..y_hi {
            for x in x_lo..x_hi {
                let (dx, dy) = (f64::from(x) + 0.5 - cx, f64::from(y) + 0.5 - cy);
                if dx * dx + dy * dy <= r * r {
                    self.set(x, y, c);
                }
            }
        }
    }

    /// Draws `text` with its top-left corner at (`x`, `top`): the baseline is `CAP_H × scale`
    /// below `top` and each font pixel is a `scale × scale` square (`scale` clamped to 1–4).
    /// Text is folded with [`fold_ascii`]; its width is [`text_width`].
    pub fn text(&mut self, x: i32, top: i32, text: &str, scale: i32, c: Rgb) {
        let s = scale.clamp(1, 4);
        let mut gx = x;
        for ch in fold_ascii(text).chars() {
            if gx >= self.width as i32 {
                break;
            }
            for (r, bits) in glyph(ch).iter().enumerate() {
                for col in 0..GLYPH_W {
                    if bits & (1 << (GLYPH_W - 1 - col)) != 0 {
                        self.fill_rect(gx + col * s, top + r as i32 * s, s, s, c);
                    }
                }
            }
            gx += (GLYPH_W + 1) * s;
        }
    }

    /// Encodes the canvas as a PNG file (layout in the module docs).
    pub fn to_png(&self) -> Vec<u8> {
        let row = self.width as usize * 3;
        let mut raw = Vec::with_capacity((row + 1) * self.height as usize);
        for y in 0..self.height as usize {
            raw.push(2); // filter type Up
            let cur = &self.rgb[y * row..(y + 1) * row];
            match y.checked_sub(1) {
                Some(p) => {
                    let above = &self.rgb[p * row..(p + 1) * row];
                    raw.extend(cur.iter().zip(above).map(|(a, b)| a.wrapping_sub(*b)));
                }
                None => raw.extend_from_slice(cur),
            }
        }
        let mut zlib = vec![0x78, 0x01];
        zlib.extend(deflate(&raw));
        zlib.extend(adler32(&raw).to_be_bytes());
        let mut ihdr = Vec::with_capacity(13);
        ihdr.extend(self.width.to_be_bytes());
        ihdr.extend(self.height.to_be_bytes());
        ihdr.extend([8, 2, 0, 0, 0]);
        let mut png = vec![0x89, b'P', b'N', b'G', 0x0D, 0x0A, 0x1A, 0x0A];
        chunk(&mut png, b"IHDR", &ihdr);
        chunk(&mut png, b"IDAT", &zlib);
        chunk(&mut png, b"IEND", &[]);
        png
    }
}

/// Liang–Barsky: the part of the segment inside `(xmin, ymin, xmax, ymax)`, if any.
fn clip(
    x0: f64,
    y0: f64,
    x1: f64,
    y1: f64,
    (xmin, ymin, xmax, ymax): (f64, f64, f64, f64),
) -> Option<(f64, f64, f64, f64)> {
    if ![x0, y0, x1, y1].iter().all(|v| v.is_finite()) {
        return None;
    }
    let (dx, dy) = (x1 - x0, y1 - y0);
    let (mut t0, mut t1) = (0.0f64, 1.0f64);
    for (p, q) in [
        (-dx, x0 - xmin),
        (dx, xmax - x0),
        (-dy, y0 - ymin),
        (dy, ymax - y0),
    ] {
        if p == 0.0 {
            if q < 0.0 {
                return None;
            }
        } else {
            let t = q / p;
            if p < 0.0 {
                t0 = t0.max(t);
            } else {
                t1 = t1.min(t);
            }
        }
    }
    (t0 <= t1).then_some((x0 + t0 * dx, y0 + t0 * dy, x0 + t1 * dx, y0 + t1 * dy))
}

fn chunk(png: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    // PNG caps chunk lengths at 2^31 - 1; a canvas that large (over 700 megapixels) is not a plot.
    png.extend((data.len() as u32).to_be_bytes());
    let start = png.len();
    png.extend_from_slice(kind);
    png.extend_from_slice(data);
    let crc = crc32(&png[start..]);
    png.extend(crc.to_be_bytes());
}

const CRC_TABLE: [u32; 256] = crc_table();

const fn crc_table() -> [u32; 256] {
    let mut table = [0u32; 256];
    let mut n = 0;
    while n < 256 {
        let mut c = n as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
            k += 1;
        }
        table[n] = c;
        n += 1;
    }
    table
}

/// CRC-32 (ISO-HDLC: reflected polynomial 0xEDB88320, initial and final XOR 0xFFFFFFFF).
pub fn crc32(data: &[u8]) -> u32 {
    !data.iter().fold(!0u32, |c, b| {
        CRC_TABLE[((c ^ u32::from(*b)) & 0xFF) as usize] ^ (c >> 8)
    })
}

/// Adler-32 as zlib defines it (RFC 1950).
pub fn adler32(data: &[u8]) -> u32 {
    const MOD: u32 = 65_521;
    let (mut a, mut b) = (1u32, 0u32);
    // 5552 bytes is the most that can be summed before `b` could overflow a u32.
    for block in data.chunks(5552) {
        for byte in block {
            a += u32::from(*byte);
            b += a;
        }
        a %= MOD;
        b %= MOD;
    }
    (b << 16) | a
}

/// Length codes 257–285: base length and extra bits (RFC 1951 §3.2.5).
const LEN_BASE: [u16; 29] = [
    3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 15, 17, 19, 23, 27, 31, 35, 43, 51, 59, 67, 83, 99, 115, 131,
    163, 195, 227, 258,
];
const LEN_EXTRA: [u8; 29] = [
    0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0,
];
/// Distance codes 0–29: base distance and extra bits.
const DIST_BASE: [u16; 30] = [
    1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49, 65, 97, 129, 193, 257, 385, 513, 769, 1025, 1537,
    2049, 3073, 4097, 6145, 8193, 12289, 16385, 24577,
];
const DIST_EXTRA: [u8; 30] = [
    0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13,
    13,
];

const WINDOW: usize = 1 << 15;
const MIN_MATCH: usize = 3;
const MAX_MATCH: usize = 258;
const MAX_CHAIN: usize = 48;
const HASH_BITS: u32 = 15;
const NONE: u32 = u32::MAX;

/// Deflate bits, least significant first (RFC 1951 §3.1.1).
struct BitWriter {
    out: Vec<u8>,
    acc: u64,
    n: u32,
}

impl BitWriter {
    fn bits(&mut self, value: u32, count: u32) {
        self.acc |= u64::from(value) << self.n;
        self.n += count;
        while self.n >= 8 {
            self.out.push(self.acc as u8);
            self.acc >>= 8;
            self.n -= 8;
        }
    }

    /// A Huffman code goes out most significant bit first.
    fn code(&mut self, code: u32, len: u32) {
        self.bits(code.reverse_bits() >> (32 - len), len);
    }

    /// A literal/length symbol in the fixed code (RFC 1951 §3.2.6).
    fn symbol(&mut self, sym: u32) {
        match sym {
            0..=143 => self.code(0x30 + sym, 8),
            144..=255 => self.code(0x190 + sym - 144, 9),
            256..=279 => self.code(sym - 256, 7),
            _ => self.code(0xC0 + sym - 280, 8),
        }
    }

    fn matched(&mut self, len: usize, dist: usize) {
        let i = LEN_BASE
            .iter()
            .rposition(|b| usize::from(*b) <= len)
            .unwrap_or(0);
        self.symbol(257 + i as u32);
        self.bits(
            (len - usize::from(LEN_BASE[i])) as u32,
            u32::from(LEN_EXTRA[i]),
        );
        let d = DIST_BASE
            .iter()
            .rposition(|b| usize::from(*b) <= dist)
            .unwrap_or(0);
        self.code(d as u32, 5);
        self.bits(
            (dist - usize::from(DIST_BASE[d])) as u32,
            u32::from(DIST_EXTRA[d]),
        );
    }

    fn finish(mut self) -> Vec<u8> {
        if self.n > 0 {
            self.out.push(self.acc as u8);
        }
        self.out
    }
}

fn hash3(b: &[u8]) -> usize {
    let v = u32::from(b[0]) | u32::from(b[1]) << 8 | u32::from(b[2]) << 16;
    (v.wrapping_mul(0x9E37_79B1) >> (32 - HASH_BITS)) as usize
}

/// Links `pos` into the hash chains (positions in a 32-bit file; see [`chunk`] for the limit).
fn insert(data: &[u8], pos: usize, head: &mut [u32], prev: &mut [u32]) {
    if pos + MIN_MATCH <= data.len() {
        let h = hash3(&data[pos..]);
        prev[pos % WINDOW] = head[h];
        head[h] = pos as u32;
    }
}

/// A raw deflate stream (no zlib wrapper) of one final fixed-Huffman block: greedy LZ77 with
/// hash chains, longest match among the `MAX_CHAIN` nearest candidates.
fn deflate(data: &[u8]) -> Vec<u8> {
    let mut w = BitWriter {
        out: Vec::with_capacity(data.len() / 8 + 16),
        acc: 0,
        n: 0,
    };
    w.bits(1, 1); // BFINAL
    w.bits(1, 2); // BTYPE 01: fixed Huffman codes
    let mut head = vec![NONE; 1 << HASH_BITS];
    let mut prev = vec![NONE; WINDOW];
    let mut i = 0;
    while i < data.len() {
        let (mut best_len, mut best_dist) = (0, 0);
        if i + MIN_MATCH <= data.len() {
            let limit = MAX_MATCH.min(data.len() - i);
            let mut cand = head[hash3(&data[i..])];
            let mut steps = 0;
            while cand != NONE && steps < MAX_CHAIN {
                let c = cand as usize;
                if c >= i || i - c > WINDOW {
                    break;
                }
                let len = data[c..]
                    .iter()
                    .zip(&data[i..i + limit])
                    .take_while(|(a, b)| a == b)
                    .count();
                if len > best_len {
                    (best_len, best_dist) = (len, i - c);
                    if len == limit {
                        break;
                    }
                }
                let next = prev[c % WINDOW];
                if next == NONE || next as usize >= c {
                    break;
                }
                cand = next;
                steps += 1;
            }
        }
        if best_len >= MIN_MATCH {
            w.matched(best_len, best_dist);
            for p in i..i + best_len {
                insert(data, p, &mut head, &mut prev);
            }
            i += best_len;
        } else {
            w.symbol(u32::from(data[i]));
            insert(data, i, &mut head, &mut prev);
            i += 1;
        }
    }
    w.symbol(256); // end of block
    w.finish()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Reads deflate bits least significant first.
    struct BitReader<'a> {
        data: &'a [u8],
        bit: usize,
    }

    impl BitReader<'_> {
        fn bits(&mut self, n: u32) -> Result<u32, String> {
            let mut v = 0;
            for k in 0..n {
                let byte = self
                    .data
                    .get(self.bit / 8)
                    .ok_or("deflate stream truncated")?;
                v |= u32::from(byte >> (self.bit % 8) & 1) << k;
                self.bit += 1;
            }
            Ok(v)
        }

        /// A Huffman code, most significant bit first.
        fn code(&mut self, n: u32) -> Result<u32, String> {
            let mut v = 0;
            for _ in 0..n {
                v = v << 1 | self.bits(1)?;
            }
            Ok(v)
        }

        fn fixed_symbol(&mut self) -> Result<u32, String> {
            let mut c = self.code(7)?;
            if c <= 0x17 {
                return Ok(256 + c);
            }
            c = c << 1 | self.bits(1)?;
            match c {
                0x30..=0xBF => return Ok(c - 0x30),
                0xC0..=0xC7 => return Ok(280 + c - 0xC0),
                _ => {}
            }
            c = c << 1 | self.bits(1)?;
            Ok(144 + c - 0x190)
        }
    }

    /// An independent inflater for stored and fixed-Huffman blocks (all the encoder emits).
    pub(crate) fn inflate(data: &[u8]) -> Result<Vec<u8>, String> {
        let mut r = BitReader { data, bit: 0 };
        let mut out = Vec::new();
        loop {
            let last = r.bits(1)? == 1;
            match r.bits(2)? {
                0 => {
                    r.bit = r.bit.div_ceil(8) * 8;
                    let (len, nlen) = (r.bits(16)?, r.bits(16)?);
                    if len != !nlen & 0xFFFF {
                        return Err("stored block: LEN != ~NLEN".into());
                    }
                    for _ in 0..len {
                        out.push(r.bits(8)? as u8);
                    }
                }
                1 => loop {
                    let sym = r.fixed_symbol()?;
                    match sym {
                        0..=255 => out.push(sym as u8),
                        256 => break,
                        257..=285 => {
                            let i = (sym - 257) as usize;
                            let len = usize::from(LEN_BASE[i])
                                + r.bits(u32::from(LEN_EXTRA[i]))? as usize;
                            let d = r.code(5)? as usize;
                            let (base, extra) = (DIST_BASE.get(d), DIST_EXTRA.get(d));
                            let (Some(base), Some(extra)) = (base, extra) else {
                                return Err(format!("bad distance code {d}"));
                            };
                            let dist = usize::from(*base) + r.bits(u32::from(*extra))? as usize;
                            if dist > out.len() {
                                return Err(format!("distance {dist} before the start"));
                            }
                            for _ in 0..len {
                                out.push(out[out.len() - dist]);
                            }
                        }
                        _ => return Err(format!("bad symbol {sym}")),
                    }
                },
                t => return Err(format!("unsupported block type {t}")),
            }
            if last {
                return Ok(out);
            }
        }
    }

    /// Decodes the PNGs [`Canvas::to_png`] writes (8-bit RGB, filters None and Up), checking
    /// every CRC, the zlib header and the Adler-32. Returns width, height and RGB pixels.
    pub(crate) fn decode_png(png: &[u8]) -> Result<(u32, u32, Vec<u8>), String> {
        let sig = [0x89, b'P', b'N', b'G', 0x0D, 0x0A, 0x1A, 0x0A];
        if png.get(..8) != Some(&sig[..]) {
            return Err("bad signature".into());
        }
        let be = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
        let (mut pos, mut idat, mut size) = (8, Vec::new(), None);
        loop {
            let head = png.get(pos..pos + 8).ok_or("truncated chunk header")?;
            let len = be(head) as usize;
            let body = png.get(pos + 4..pos + 8 + len).ok_or("truncated chunk")?;
            let crc = png
                .get(pos + 8 + len..pos + 12 + len)
                .ok_or("missing crc")?;
            if crc32(body) != be(crc) {
                return Err(format!("bad crc on {:?}", &body[..4]));
            }
            let data = &body[4..];
            match &body[..4] {
                b"IHDR" => {
                    if data[8..] != [8, 2, 0, 0, 0] {
                        return Err(format!("unexpected IHDR {data:?}"));
                    }
                    size = Some((be(&data[0..4]), be(&data[4..8])));
                }
                b"IDAT" => idat.extend_from_slice(data),
                b"IEND" => break,
                other => return Err(format!("unexpected chunk {other:?}")),
            }
            pos += 12 + len;
        }
        let (w, h) = size.ok_or("no IHDR")?;
        if idat.len() < 6
            || idat[0] & 0x0F != 8
            || (u16::from(idat[0]) << 8 | u16::from(idat[1])) % 31 != 0
        {
            return Err("bad zlib header".into());
        }
        let raw = inflate(&idat[2..idat.len() - 4])?;
        if adler32(&raw) != be(&idat[idat.len() - 4..]) {
            return Err("bad adler-32".into());
        }
        let row = w as usize * 3;
        if raw.len() != (row + 1) * h as usize {
            return Err(format!("{} bytes of scanlines for {w}x{h}", raw.len()));
        }
        let mut rgb: Vec<u8> = Vec::with_capacity(row * h as usize);
        for (y, line) in raw.chunks(row + 1).enumerate() {
            for (x, v) in line[1..].iter().enumerate() {
                let up = if y == 0 { 0 } else { rgb[(y - 1) * row + x] };
                rgb.push(match line[0] {
                    0 => *v,
                    2 => v.wrapping_add(up),
                    f => return Err(format!("unsupported filter {f}")),
                });
            }
        }
        Ok((w, h, rgb))
    }

    #[test]
    fn checksums_match_known_vectors() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(crc32(b""), 0);
        assert_eq!(crc32(b"IEND"), 0xAE42_6082);
        assert_eq!(adler32(b"Wikipedia"), 0x11E6_0398);
        assert_eq!(adler32(b""), 1);
        // Long enough to need the modulo between blocks.
        assert_eq!(adler32(&[0xFF; 100_000]), naive_adler(&[0xFF; 100_000]));
    }

    fn naive_adler(data: &[u8]) -> u32 {
        let (mut a, mut b) = (1u64, 0u64);
        for x in data {
            a = (a + u64::from(*x)) % 65_521;
            b = (b + a) % 65_521;
        }
        (b << 16 | a) as u32
    }

    #[test]
    fn deflate_agrees_with_zlib() {
        // Python's `zlib.compress(b"a")` body: a fixed block, the literal, end of block.
        assert_eq!(deflate(b"a"), [0x4B, 0x04, 0x00]);
        // zlib's encodings of these differ from ours (it emits two literals before its first
        // match) but the inflater must read both, and `zlib.decompress(bytes.fromhex("4b840300"),
        // -15)` reads ours.
        assert_eq!(deflate(b"aaaaaaaaaa"), [0x4B, 0x84, 0x03, 0x00]);
        for (zlib, plain) in [
            (&[0x4B, 0x4C, 0x84, 0x01, 0x00][..], &b"aaaaaaaaaa"[..]),
            (&[0x4B, 0x4C, 0x4A, 0x4E, 0x84, 0x21, 0x00], b"abcabcabcabc"),
        ] {
            assert_eq!(inflate(zlib).as_deref(), Ok(plain));
        }
    }

    #[test]
    fn deflate_round_trips() {
        let mut rng = 0x2545_F491_4F6C_DD1Du64;
        let mut noise = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng as u8
        };
        let random: Vec<u8> = (0..70_000).map(|_| noise()).collect();
        let mut mixed = Vec::new();
        for k in 0..50_000u32 {
            mixed.push(if k % 1000 < 700 { 0 } else { noise() % 4 });
        }
        let long_runs = vec![7u8; 200_000];
        for data in [
            &b""[..],
            b"x",
            &random,
            &mixed,
            &long_runs,
            &[0, 255, 144, 143, 0, 255, 144, 143],
        ] {
            let packed = deflate(data);
            assert_eq!(
                inflate(&packed).as_deref(),
                Ok(data),
                "{} bytes",
                data.len()
            );
        }
        assert!(deflate(&long_runs).len() < 2_000);
    }

    #[test]
    fn png_round_trips_pixels() {
        let mut c = Canvas::new(37, 21, Rgb(10, 20, 30));
        c.set(0, 0, Rgb(255, 0, 0));
        c.set(36, 20, Rgb(0, 255, 0));
        c.fill_rect(5, 5, 10, 4, Rgb(1, 2, 3));
        let png = c.to_png();
        let (w, h, rgb) = decode_png(&png).expect("decodes");
        assert_eq!((w, h), (37, 21));
        assert_eq!(rgb, c.rgb());
        assert_eq!(&png[12..16], b"IHDR");
        assert_eq!(
            &png[png.len() - 12..],
            [0, 0, 0, 0, b'I', b'E', b'N', b'D', 0xAE, 0x42, 0x60, 0x82]
        );
    }

    #[test]
    fn rects_and_circles_fill_their_pixels_only() {
        let red = Rgb(200, 0, 0);
        let mut c = Canvas::new(40, 30, Rgb::WHITE);
        c.fill_rect(10, 5, 8, 6, red);
        for y in 0..30 {
            for x in 0..40 {
                let inside = (10..18).contains(&x) && (5..11).contains(&y);
                assert_eq!(c.pixel(x, y) == Some(red), inside, "({x}, {y})");
            }
        }
        c.fill_rect(-5, -5, 8, 8, red); // clipped, no panic
        assert_eq!(c.pixel(2, 2), Some(red));
        assert_eq!(c.pixel(40, 0), None);
        let blue = Rgb(0, 0, 200);
        c.fill_circle(30.0, 20.0, 3.5, blue);
        assert_eq!(c.pixel(30, 20), Some(blue));
        assert_eq!(c.pixel(32, 20), Some(blue)); // centre 2.5 px away
        assert_eq!(c.pixel(33, 20), Some(Rgb::WHITE)); // centre 3.54 px away
        assert_eq!(c.pixel(29, 16), Some(Rgb::WHITE));
        assert_eq!(c.pixel(29, 17), Some(blue));
        c.fill_circle(f64::NAN, 0.0, 3.0, blue);
        c.fill_circle(1e12, -1e12, 1e13, blue); // bounded by the canvas
    }

    #[test]
    fn lines_cover_their_ends_and_width() {
        let k = Rgb::BLACK;
        let mut c = Canvas::new(50, 50, Rgb::WHITE);
        c.line(2.0, 3.0, 40.0, 30.0, 1, k);
        assert_eq!(c.pixel(2, 3), Some(k));
        assert_eq!(c.pixel(40, 30), Some(k));
        let dark = |c: &Canvas| c.rgb().chunks(3).filter(|p| p[0] == 0).count();
        assert_eq!(dark(&c), 39); // one pixel per step along the major axis
        let mut c = Canvas::new(50, 50, Rgb::WHITE);
        c.line(5.0, 10.0, 44.0, 10.0, 3, k);
        assert_eq!(dark(&c), (40 + 2) * 3); // a square pen: one pixel past each end

        assert_eq!(c.pixel(20, 9), Some(k));
        assert_eq!(c.pixel(20, 11), Some(k));
        assert_eq!(c.pixel(20, 12), Some(Rgb::WHITE));
        // Far outside, crossing, and non-finite segments: clipped, fast, no panic.
        c.line(-1e9, 25.0, 1e9, 25.0, 2, k);
        assert_eq!(c.pixel(0, 25), Some(k));
        assert_eq!(c.pixel(49, 25), Some(k));
        c.line(f64::NAN, 0.0, 10.0, 10.0, 1, k);
        c.line(-100.0, -100.0, -50.0, -10.0, 1, k);
    }

    #[test]
    fn text_inks_its_box_and_advances_six_pixels_per_glyph() {
        assert_eq!(text_width("", 1), 0);
        assert_eq!(text_width("ab", 1), 11);
        assert_eq!(text_width("ab", 2), 22);
        assert_eq!(text_width("x…", 1), text_width("x...", 1));
        let mut c = Canvas::new(60, 30, Rgb::WHITE);
        c.text(3, 4, "Hg1%", 1, Rgb::BLACK);
        let width = text_width("Hg1%", 1);
        let mut ink = 0;
        for y in 0..30 {
            for x in 0..60 {
                if c.pixel(x, y) == Some(Rgb::BLACK) {
                    ink += 1;
                    assert!(
                        (3..3 + width).contains(&x) && (4..4 + 9).contains(&y),
                        "({x}, {y})"
                    );
                }
            }
        }
        assert!(ink > 30, "{ink} inked pixels");
        // 'H' has its left stem in column 0 over the cap height, 'g' descends below the baseline.
        assert!((4..11).all(|y| c.pixel(3, y) == Some(Rgb::BLACK)));
        assert!((9..14).any(|x| c.pixel(x, 4 + 8) == Some(Rgb::BLACK)));
    }

    #[test]
    fn every_printable_glyph_has_ink_and_unknowns_draw_a_box() {
        for ch in '!'..='~' {
            assert!(glyph(ch).iter().any(|r| *r != 0), "{ch:?} is blank");
        }
        assert!(FONT[0].iter().all(|r| *r == 0));
        assert_eq!(glyph('é'), &FONT[BOX]);
        assert_eq!(fold_ascii("a—b … ≥"), "a-b ... >=");
        let mut c = Canvas::new(20, 20, Rgb::WHITE);
        c.text(0, 0, "\u{1F600}", 2, Rgb::BLACK);
        assert_eq!(c.pixel(0, 0), Some(Rgb::BLACK));
        assert_eq!(c.pixel(9, 13), Some(Rgb::BLACK));
    }
}
