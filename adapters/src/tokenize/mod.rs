//! The router's tokenizer front-end: exact, cached, parallel encoding plus HF chat templates.
//!
//! [`Tokenizer::encode`] returns exactly `tokenizers::Tokenizer::encode(text, false)` ids. The
//! exactness argument, in layers:
//!
//! 1. **Segments.** The crate extracts added/special tokens first and then normalizes,
//!    pre-tokenizes and BPE-encodes every gap between them on its own. We find the same
//!    tokens with the same leftmost-longest, non-normalized-first rule (`split.rs`), so each gap
//!    encoded alone gives the ids the crate gives it inside the whole text. This needs an
//!    identity normalizer, added tokens without `lstrip`/`rstrip`/`single_word`, a
//!    deterministic model and per-split pre-tokenizer stages (`config.rs` checks all of it).
//! 2. **Chunks.** For the proven DeepSeek-V3 pre-tokenizer, a gap is further cut at points where
//!    the pre-tokenizer starts a new pre-token whatever the surrounding text
//!    (`split::is_safe_split`); BPE never crosses a pre-token, so chunks encode independently.
//!    Cuts are chosen left to right from the segment start, so shared prefixes give identical
//!    chunks.
//! 3. **Native encoder.** For that same pre-tokenizer a chunk is encoded by our own code instead
//!    of the crate (`native.rs`), 20-50x faster in `benches/tokenize.rs`:
//!    * `pretok.rs` replays the three `Split` regexes without a regex engine, deciding each
//!      anchored match alternative by alternative as the backtracking engine would, on
//!      per-code-point class bits;
//!    * `classes.rs` builds those bits at load from `regex-syntax` (the parser behind the
//!      `fancy-regex` delegates the crate runs, same version), so `\p{L}`, `\p{N}`, `\s`, ...
//!      are the crate's own sets;
//!    * `bpe.rs` maps bytes to their `ByteLevel` start symbols and merges lowest rank first,
//!      leftmost on ties, with an `FxHashMap` from `(left, right)` to `(rank, merged)`: a linear
//!      scan for short pre-tokens, a heap over a linked list for long ones, and first a probe of
//!      a word table (every vocabulary token of up to 15 bytes that BPE maps to itself, built at
//!      load and read-only after, so no lock);
//!    * `native.rs` reads every model assumption (no dropout, prefix/suffix or
//!      `ignore_merges`, unique ids, all 256 byte chars in the vocabulary) off the crate's
//!      loaded model and the merges off tokenizer.json, or refuses.
//!
//!    Inputs holding a run near a `fancy-regex` limit (a backtrack or stack cap after which the
//!    crate silently stops splitting) are handed whole to the crate (`pretok::Pathological`,
//!    counted in [`CacheStats::plain_fallbacks`]), so even that behaviour is reproduced.
//! 4. **Cache.** A chunk's ids depend only on its text, so a bounded LRU keyed by XXH3-128 of the
//!    text returns them on repeats; a conversation whose earlier turns were seen only encodes the
//!    new tail. Misses above [`PARALLEL_MIN_BYTES`] are encoded on the rayon pool.
//!
//! Anything not proven falls back to the crate: [`FastPath::Native`] is all of the above,
//! [`FastPath::Enabled`] encodes chunks with the crate (with the reason the native encoder was
//! refused), [`FastPath::SegmentsOnly`] does not cut segments, [`FastPath::Disabled`] is the plain
//! call. [`Tokenizer::fast_path`] says which mode is active and why, for startup logs. Load
//! cost of the native tables is a one-off ~0.1 s on top of the crate's own load.
//!
//! Tests: property tests in `adapters/tests/tokenize.rs` compare every mode against the plain
//! call (random Unicode, special tokens, contractions, digits, whitespace, emoji, random bytes,
//! long pre-tokens, 32k-token prompts, repository text, the decoded vocabulary, pathological
//! runs); unit tests in `native.rs` compare the pre-tokenizer with the crate's, pre-token by
//! pre-token, on random text and on every code point of planes 0, 1 and 14.

mod bpe;
mod cache;
mod chat;
mod classes;
mod config;
pub mod image;
mod native;
mod pretok;
mod pyjson;
mod split;
pub mod vision;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use rayon::prelude::*;
use serde_json::Value;

pub use chat::{
    ChatContent, ChatExtras, ChatMessage, ChatTemplate, ContentFormat, ContentPart, TemplateError,
    TemplateKwargs,
};
pub use vision::VisionProfile;

pub use config::FastPath;
use infera_core::hashing::identity::MmRun;

use cache::Lru;
use native::NativeEncoder;
use split::{AddedTokenSplitter, Piece};

/// Target chunk size in bytes (about 500 tokens of English) when cutting long segments.
pub const CHUNK_TARGET_BYTES: usize = 2048;
/// Below this many bytes of cache misses a request is encoded on the calling thread.
pub const PARALLEL_MIN_BYTES: usize = 8192;

/// Why loading or encoding failed.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// A tokenizer file could not be read.
    #[error("cannot read tokenizer file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A tokenizer file is not what the `tokenizers` crate or HF expects.
    #[error("tokenizer file {path} is invalid: {message}")]
    Invalid { path: PathBuf, message: String },
    /// The `tokenizers` crate failed on an input.
    #[error("tokenizer failed to encode the input: {0}")]
    Encode(String),
    /// Chat template missing, malformed or failing.
    #[error(transparent)]
    Template(#[from] TemplateError),
}

impl TokenizeError {
    /// Never: every variant needs a different file, template or request.
    pub fn is_retryable(&self) -> bool {
        false
    }
}

/// Cache counters since load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheStats {
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    pub entries: usize,
    pub resident_tokens: usize,
    /// Requests the native encoder handed whole to the crate because they hold a run near a
    /// regex-engine limit (tens of thousands of unmatched or whitespace chars in a row).
    pub plain_fallbacks: u64,
}

/// Tuning knobs; [`Default`] is what the router uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenizerOptions {
    pub cache: CacheConfig,
    /// Chunk size target when cutting long segments (1 cuts at every safe point).
    pub chunk_target_bytes: usize,
    /// Cache misses below this many bytes are encoded on the calling thread.
    pub parallel_min_bytes: usize,
}

impl Default for TokenizerOptions {
    fn default() -> Self {
        Self {
            cache: CacheConfig::default(),
            chunk_target_bytes: CHUNK_TARGET_BYTES,
            parallel_min_bytes: PARALLEL_MIN_BYTES,
        }
    }
}

/// Cache bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheConfig {
    pub max_entries: usize,
    pub max_tokens: usize,
}

impl Default for CacheConfig {
    /// 64k chunks or 8M tokens (32 MiB of ids), whichever is hit first.
    fn default() -> Self {
        Self {
            max_entries: 65_536,
            max_tokens: 8 << 20,
        }
    }
}

/// A loaded tokenizer; `Send + Sync`, meant to be shared as `Arc<Tokenizer>` and called from a
/// blocking pool.
#[derive(Debug)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    fast_path: FastPath,
    options: TokenizerOptions,
    splitter: Option<AddedTokenSplitter>,
    native: Option<NativeEncoder>,
    cache: Mutex<Lru>,
    hits: AtomicU64,
    misses: AtomicU64,
    plain_fallbacks: AtomicU64,
    chat_template: Option<ChatTemplate>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    config_origin: String,
    vision: Option<VisionProfile>,
}

/// A chat's images the way its engine keys them: identifier, width, height, in prompt order.
pub type KeyedImages = Vec<(Box<str>, u32, u32)>;

impl Tokenizer {
    /// Loads from a directory holding tokenizer.json (and optionally tokenizer_config.json), or
    /// from a tokenizer.json path (a sibling tokenizer_config.json is read if present). A vision
    /// model's config.json and preprocessor_config.json there give its [`VisionProfile`].
    ///
    /// # Errors
    /// [`TokenizeError::Io`]/[`TokenizeError::Invalid`] naming the file, or
    /// [`TokenizeError::Template`] when the config's `chat_template` is malformed or does not
    /// compile. A failed load must stop startup.
    pub fn from_path(path: &Path) -> Result<Self, TokenizeError> {
        Self::from_path_with(path, TokenizerOptions::default())
    }

    /// [`Tokenizer::from_path`] with explicit tuning.
    pub fn from_path_with(path: &Path, options: TokenizerOptions) -> Result<Self, TokenizeError> {
        let model_dir = if path.is_dir() {
            Some(path.to_path_buf())
        } else {
            path.parent().map(Path::to_path_buf)
        };
        let (json_path, config_path) = if path.is_dir() {
            (
                path.join("tokenizer.json"),
                Some(path.join("tokenizer_config.json")),
            )
        } else {
            let sibling = path.parent().map(|d| d.join("tokenizer_config.json"));
            (path.to_path_buf(), sibling.filter(|p| p.is_file()))
        };
        let bytes = read(&json_path)?;
        let invalid = |message: String| TokenizeError::Invalid {
            path: json_path.clone(),
            message,
        };
        let mut inner =
            tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| invalid(e.to_string()))?;
        // The router needs every token for block hashes: no truncation or padding.
        inner
            .with_truncation(None)
            .map_err(|e| invalid(e.to_string()))?;
        inner.with_padding(None);
        let json: Value = serde_json::from_slice(&bytes).map_err(|e| invalid(e.to_string()))?;
        let mut fast_path = config::analyze(&json, inner.get_encode_special_tokens());
        let mut native = None;
        if fast_path == FastPath::Native {
            match NativeEncoder::build(inner.get_model(), &json) {
                Ok(encoder) => native = Some(encoder),
                Err(reason) => fast_path = FastPath::Enabled { reason },
            }
        }
        let splitter = if fast_path.is_enabled() {
            let tokens: Vec<(String, u32, bool)> = inner
                .get_added_tokens_decoder()
                .into_iter()
                .map(|(id, t)| (t.content, id, t.normalized))
                .collect();
            Some(AddedTokenSplitter::new(&tokens).map_err(invalid)?)
        } else {
            None
        };

        let mut config = Value::Null;
        let mut config_origin = format!("{} (no tokenizer_config.json)", path.display());
        if let Some(config_path) = config_path.filter(|p| p.is_file()) {
            let raw = read(&config_path)?;
            config = serde_json::from_slice(&raw).map_err(|e| TokenizeError::Invalid {
                path: config_path.clone(),
                message: e.to_string(),
            })?;
            config_origin = config_path.display().to_string();
        }
        let bos_token = chat::special_token(&config, "bos_token");
        let eos_token = chat::special_token(&config, "eos_token");
        let chat_template = chat::template_source(&config, &config_origin)?
            .map(|source| {
                ChatTemplate::new(
                    source,
                    bos_token.clone(),
                    eos_token.clone(),
                    config_origin.clone(),
                )
            })
            .transpose()?;
        let vision = match &model_dir {
            Some(dir) => {
                VisionProfile::from_dir(dir, |t| inner.token_to_id(t)).map_err(|message| {
                    TokenizeError::Invalid {
                        path: dir.clone(),
                        message,
                    }
                })?
            }
            None => None,
        };

        Ok(Self {
            inner,
            fast_path,
            splitter,
            native,
            cache: Mutex::new(Lru::new(
                options.cache.max_entries,
                options.cache.max_tokens,
            )),
            options,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            plain_fallbacks: AtomicU64::new(0),
            chat_template,
            bos_token,
            eos_token,
            config_origin,
            vision,
        })
    }

    /// The model's image placeholder expansion, for a vision model of a supported type.
    pub fn vision(&self) -> Option<&VisionProfile> {
        self.vision.as_ref()
    }

    /// Which exact speed-ups are active, and why not the others; log it at startup.
    pub fn fast_path(&self) -> &FastPath {
        &self.fast_path
    }

    /// The wrapped `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// The template from tokenizer_config.json, if it has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// Loads a `--chat-template FILE` with this tokenizer's `bos_token`/`eos_token`.
    pub fn load_chat_template(&self, path: &Path) -> Result<ChatTemplate, TemplateError> {
        ChatTemplate::from_file(path, self.bos_token.clone(), self.eos_token.clone())
    }

    /// Counters and occupancy of the segment cache.
    pub fn cache_stats(&self) -> CacheStats {
        let lru = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            evictions: lru.evictions(),
            entries: lru.len(),
            resident_tokens: lru.tokens(),
            plain_fallbacks: self.plain_fallbacks.load(Ordering::Relaxed),
        }
    }

    /// Drops every cached segment (counters are kept).
    pub fn clear_cache(&self) {
        let mut lru = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        lru.clear();
    }

    /// The plain crate call, `encode(text, add_special_tokens = false)`: the reference.
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        self.inner
            .encode_fast(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizeError::Encode(e.to_string()))
    }

    /// Encodes `text` without adding special tokens (a rendered chat already contains them).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        let Some(splitter) = self.splitter.as_ref() else {
            return self.encode_plain(text);
        };
        match self.encode_segments(splitter, text) {
            Err(ChunkError::Pathological) => {
                self.plain_fallbacks.fetch_add(1, Ordering::Relaxed);
                self.encode_plain(text)
            }
            Err(ChunkError::Crate(e)) => Err(e),
            Ok(ids) => Ok(ids),
        }
    }

    /// One chunk (or whole segment) between added tokens, alone.
    fn encode_chunk(&self, chunk: &str) -> Result<Vec<u32>, ChunkError> {
        let Some(native) = self.native.as_ref() else {
            return self.encode_plain(chunk).map_err(ChunkError::Crate);
        };
        let mut ids = Vec::with_capacity(chunk.len() / 3 + 1);
        native
            .encode(chunk, &mut ids)
            .map_err(|_| ChunkError::Pathological)?;
        Ok(ids)
    }

    fn encode_segments(
        &self,
        splitter: &AddedTokenSplitter,
        text: &str,
    ) -> Result<Vec<u32>, ChunkError> {
        let chunked = matches!(self.fast_path, FastPath::Native | FastPath::Enabled { .. });
        let mut units: Vec<Unit> = Vec::new();
        let mut ranges = Vec::new();
        for piece in splitter.split(text) {
            match piece {
                Piece::Added(id) => units.push(Unit::Added(id)),
                Piece::Text(range) => {
                    ranges.clear();
                    if chunked {
                        split::chunks(text, range, self.options.chunk_target_bytes, &mut ranges);
                    } else {
                        ranges.push(range);
                    }
                    units.extend(ranges.iter().map(|r| Unit::Text {
                        range: r.clone(),
                        key: xxhash_rust::xxh3::xxh3_128(&text.as_bytes()[r.clone()]),
                    }));
                }
            }
        }

        let mut found: Vec<Option<Arc<[u32]>>> = vec![None; units.len()];
        let mut missing = Vec::new();
        let mut missing_bytes = 0;
        {
            let mut lru = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
            for (slot, unit) in found.iter_mut().zip(&units) {
                if let Unit::Text { range, key } = unit {
                    *slot = lru.get(*key);
                    if slot.is_none() {
                        missing.push((range.clone(), *key));
                        missing_bytes += range.len();
                    }
                }
            }
        }
        let text_units = units.len() - units.iter().filter(|u| matches!(u, Unit::Added(_))).count();
        self.hits
            .fetch_add((text_units - missing.len()) as u64, Ordering::Relaxed);
        self.misses
            .fetch_add(missing.len() as u64, Ordering::Relaxed);

        let encode_one = |(range, key): &(std::ops::Range<usize>, u128)| {
            self.encode_chunk(&text[range.clone()])
                .map(|ids| (*key, Arc::<[u32]>::from(ids)))
        };
        let fresh: Vec<(u128, Arc<[u32]>)> =
            if missing_bytes >= self.options.parallel_min_bytes && missing.len() > 1 {
                missing
                    .par_iter()
                    .map(encode_one)
                    .collect::<Result<_, _>>()?
            } else {
                missing.iter().map(encode_one).collect::<Result<_, _>>()?
            };
        if !fresh.is_empty() {
            let mut lru = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
            for (key, ids) in &fresh {
                lru.insert(*key, Arc::clone(ids));
            }
        }

        let mut fresh = fresh.into_iter();
        let mut out = Vec::with_capacity(text.len() / 3);
        for (unit, cached) in units.iter().zip(found) {
            match (unit, cached) {
                (Unit::Added(id), _) => out.push(*id),
                (Unit::Text { .. }, Some(ids)) => out.extend_from_slice(&ids),
                (Unit::Text { .. }, None) => {
                    if let Some((_, ids)) = fresh.next() {
                        out.extend_from_slice(&ids);
                    }
                }
            }
        }
        Ok(out)
    }

    /// Renders `messages` and `extras` with `template_override` or the config's template, then
    /// encodes.
    ///
    /// # Errors
    /// [`TemplateError::Missing`] when there is no template at all, render errors, encode errors.
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        extras: &ChatExtras,
        template_override: Option<&ChatTemplate>,
    ) -> Result<Vec<u32>, TokenizeError> {
        let rendered = self.render_chat(messages, extras, template_override)?;
        self.encode(&rendered)
    }

    /// The images of `messages` as the engine keys them, rendered with `template_override` or
    /// the config's template; `None` when a part other than text cannot be keyed: audio and
    /// files, an image without a size or identifier the router knows (a remote URL), any image
    /// for a model without a [`VisionProfile`] or a template that takes text only.
    pub fn keyed_images(
        &self,
        messages: &[ChatMessage],
        template_override: Option<&ChatTemplate>,
    ) -> Option<KeyedImages> {
        let mut parts = messages.iter().flat_map(ChatMessage::non_text).peekable();
        if parts.peek().is_none() {
            return Some(Vec::new());
        }
        self.vision.as_ref()?;
        let template = template_override.or(self.chat_template.as_ref())?;
        if template.content_format() != ContentFormat::OpenAi {
            return None;
        }
        parts.map(ContentPart::keyed_image).collect()
    }

    /// [`Tokenizer::encode_chat`] for a chat with the images `images` (see
    /// [`Tokenizer::keyed_images`]): the prompt with each image's placeholder expanded as the
    /// engine expands it, and the images' runs. Placeholders that do not pair up with the images
    /// (a template that drops one) leave the prompt unexpanded and without runs: its blocks
    /// before the first image still match the engine's, the later ones none.
    ///
    /// # Errors
    /// As [`Tokenizer::encode_chat`].
    pub fn encode_chat_keyed(
        &self,
        messages: &[ChatMessage],
        extras: &ChatExtras,
        template_override: Option<&ChatTemplate>,
        images: &[(Box<str>, u32, u32)],
    ) -> Result<(Vec<u32>, Vec<MmRun>), TokenizeError> {
        let ids = self.encode_chat(messages, extras, template_override)?;
        let Some(vision) = self.vision.as_ref().filter(|_| !images.is_empty()) else {
            return Ok((ids, Vec::new()));
        };
        Ok(vision
            .expand(&ids, images)
            .unwrap_or_else(|| (ids, Vec::new())))
    }

    /// Renders `messages` and `extras` to the prompt string the engine will see.
    pub fn render_chat(
        &self,
        messages: &[ChatMessage],
        extras: &ChatExtras,
        template_override: Option<&ChatTemplate>,
    ) -> Result<String, TemplateError> {
        let template = template_override
            .or(self.chat_template.as_ref())
            .ok_or_else(|| TemplateError::Missing {
                origin: self.config_origin.clone(),
            })?;
        template.render(messages, extras)
    }
}

/// Why a chunk was not encoded.
enum ChunkError {
    /// The native encoder refused (see `pretok::Pathological`): encode the whole text plainly.
    Pathological,
    Crate(TokenizeError),
}

enum Unit {
    Added(u32),
    Text {
        range: std::ops::Range<usize>,
        key: u128,
    },
}

fn read(path: &Path) -> Result<Vec<u8>, TokenizeError> {
    std::fs::read(path).map_err(|source| TokenizeError::Io {
        path: path.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn tokenizer_is_send_sync() {
        assert_send_sync::<Tokenizer>();
    }
}
