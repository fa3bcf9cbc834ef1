//! `infera_adapters::tokenize` against the plain `tokenizers` call on the DeepSeek fixture.
//!
//! The exactness tests use a tokenizer tuned to cut at *every* safe split point and to always
//! go parallel, so each proptest case checks the split rule at every place it fires, the
//! added-token segmentation and the parallel merge. The reference is always
//! `tokenizers::Tokenizer::encode(text, false)` on the same wrapped tokenizer.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use infera_adapters::tokenize::{
    CacheConfig, ChatContent, ChatExtras, ChatMessage, ChatTemplate, ContentPart, FastPath,
    TemplateError, TokenizeError, Tokenizer, TokenizerOptions,
};
use proptest::prelude::*;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tokenizers/deepseek-v4")
}

/// Cuts at every safe point, always parallel.
fn fine() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        let options = TokenizerOptions {
            chunk_target_bytes: 1,
            parallel_min_bytes: 0,
            ..TokenizerOptions::default()
        };
        Tokenizer::from_path_with(&fixture_dir(), options).expect("fixture loads")
    })
}

/// The router's defaults, except a tiny cache so that eviction happens.
fn small_cache() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        let options = TokenizerOptions {
            cache: CacheConfig {
                max_entries: 8,
                max_tokens: 4096,
            },
            ..TokenizerOptions::default()
        };
        Tokenizer::from_path_with(&fixture_dir(), options).expect("fixture loads")
    })
}

fn plain(tok: &Tokenizer, text: &str) -> Vec<u32> {
    tok.inner()
        .encode(text, false)
        .expect("plain encode")
        .get_ids()
        .to_vec()
}

fn assert_exact(tok: &Tokenizer, text: &str) {
    let ours = tok.encode(text).expect("fast encode");
    let reference = plain(tok, text);
    assert_eq!(ours, reference, "mismatch for {text:?}");
}

/// Building blocks chosen to stress the pre-tokenizer: every character class the regexes
/// distinguish, the two split rules' neighbours, added tokens and their fragments.
const ATOMS: &[&str] = &[
    "a",
    "b",
    "Z",
    "q",
    "the",
    "word",
    "Hello",
    "x",
    " ",
    " ",
    " ",
    "  ",
    "   ",
    "\n",
    "\n",
    "\n\n",
    "\r\n",
    "\r",
    "\t",
    " \n",
    "\n ",
    "1",
    "23",
    "456",
    "7890",
    "0",
    ".",
    ",",
    "!",
    "?",
    "(",
    ")",
    "{",
    "}",
    ";",
    ":",
    "\"",
    "'",
    "-",
    "_",
    "/",
    "\\",
    "#",
    "$",
    "+",
    "=",
    "<",
    ">",
    "|",
    "`",
    "~",
    "@",
    "%",
    "^",
    "&",
    "*",
    "[",
    "]",
    "中",
    "文字",
    "一",
    "龥",
    "ひらがな",
    "カタカナ",
    "゠",
    "・",
    "한국어",
    "é",
    "ß",
    "Ω",
    "ж",
    "\u{0301}",
    "\u{0308}",
    "Ⓐ",
    "①",
    "²",
    "Ⅻ",
    "\u{00a0}",
    "\u{3000}",
    "\u{2028}",
    "\u{200b}",
    "\u{85}",
    "😀",
    "👍🏽",
    "🇺🇸",
    "、",
    "。",
    "「",
    "」",
    "！",
    "，",
    "\u{0}",
    "\u{7f}",
    "\u{1b}",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<think>",
    "</think>",
    "<｜",
    "｜>",
    "<｜User",
    "<dsml:",
    "</dsml:",
    "<｜/table>｜",
    "<｜tool▁sep｜>",
    "<|EOT|>",
    "<｜place▁holder▁no▁7｜>",
    "｜DSML｜",
];

fn random_text(max_atoms: usize) -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(ATOMS), 0..max_atoms).prop_map(|v| v.concat())
}

/// Ascii-heavy text: letters, digits, spaces and newlines, where the split rules fire most.
fn ascii_text() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9 \\n.,;:(){}\\[\\]\"'_=+\\-\\t]{0,400}"
}

/// Arbitrary unicode strings (any scalar values).
fn any_text() -> impl Strategy<Value = String> {
    prop::collection::vec(any::<char>(), 0..80).prop_map(|v| v.into_iter().collect())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn random_atoms_match_plain(text in random_text(80)) {
        assert_exact(fine(), &text);
    }

    #[test]
    fn ascii_text_matches_plain(text in ascii_text()) {
        assert_exact(fine(), &text);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn arbitrary_unicode_matches_plain(text in any_text()) {
        assert_exact(fine(), &text);
    }

    #[test]
    fn realistic_fragments_match_plain(
        picks in prop::collection::vec((0..FRAGMENTS.len(), 0..ATOMS.len()), 1..12),
    ) {
        let mut text = String::new();
        for (fragment, atom) in picks {
            text.push_str(FRAGMENTS[fragment]);
            text.push_str(ATOMS[atom]);
        }
        assert_exact(fine(), &text);
        assert_exact(small_cache(), &text);
    }
}

const FRAGMENTS: &[&str] = &[
    "The router tokenizes every request itself, so the cost of tokenization sits on the critical \
     path of each decision. Caching repeated prefixes keeps that cost proportional to new text.",
    "fn main() {\n    let xs: Vec<u32> = (0..10).map(|i| i * 2).collect();\n    println!(\"{xs:?}\");\n}\n",
    "{\"model\": \"deepseek-v4\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": 128}",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n",
    "路由器在每个请求到达时都会自行分词，以计算前缀块的哈希值。",
    "東京は日本の首都です。カタカナとひらがなも含みます。",
    "Emoji test 🚀🔥 and accents: naïve café, Ærøskøbing.\n",
    "    \n\t\n   trailing spaces and tabs   \n",
    "1234567890 3.14159 -42 1e10 0xFF",
    "<｜User｜>What is the capital of France?<｜Assistant｜>Paris.<｜end▁of▁sentence｜>",
    "SELECT id, name FROM users WHERE created_at > '2024-01-01' ORDER BY id DESC;\n",
    "## Heading\n\n- item one\n- item two\n\n> quoted text\n",
];

/// A long, realistic prompt: numbered paragraphs of prose, code, JSON and CJK.
fn long_prompt(paragraphs: usize) -> String {
    let mut text = String::new();
    for i in 0..paragraphs {
        let fragment = FRAGMENTS[i % FRAGMENTS.len()];
        text.push_str(&format!("Section {i}: "));
        text.push_str(fragment);
        text.push_str(if i % 3 == 0 { "\n\n" } else { " " });
    }
    text
}

#[test]
fn fixture_uses_the_full_fast_path() {
    assert_eq!(fine().fast_path(), &FastPath::Native);
}

#[test]
fn long_realistic_prompts_match_plain() {
    let text = long_prompt(120);
    assert_exact(fine(), &text);
    assert_exact(small_cache(), &text);
    let default = Tokenizer::from_path(&fixture_dir()).expect("fixture loads");
    assert_exact(&default, &text);
    // Second call comes from the cache and must be identical.
    assert_exact(&default, &text);
    assert!(default.cache_stats().hits > 0);
}

fn three_messages() -> Vec<ChatMessage> {
    vec![
        ChatMessage::text("system", "You are a helpful assistant."),
        ChatMessage::text("user", "What is 2 + 2?"),
        ChatMessage::text("assistant", "4."),
    ]
}

#[test]
fn deepseek_template_renders_expected_string() {
    let rendered = fine()
        .render_chat(&three_messages(), &ChatExtras::default(), None)
        .expect("template renders");
    assert_eq!(
        rendered,
        "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>What is 2 + 2?\
         <｜Assistant｜>4.<｜end▁of▁sentence｜><｜Assistant｜>"
    );
    let ids = fine()
        .encode_chat(&three_messages(), &ChatExtras::default(), None)
        .expect("encodes");
    assert_eq!(ids, plain(fine(), &rendered));
    assert_eq!(ids.first(), Some(&0));
    assert_eq!(ids.last(), Some(&128_804));
    assert!(ids.contains(&128_803) && ids.contains(&1));
}

#[test]
fn array_content_is_joined_and_non_text_is_rejected_by_a_text_template() {
    let parts = ChatMessage {
        role: "user".into(),
        content: Some(ChatContent::Parts(vec![
            ContentPart::text("first"),
            ContentPart::text("second"),
        ])),
        extra: Default::default(),
    };
    let joined = ChatMessage::text("user", "first\nsecond");
    assert_eq!(
        fine()
            .render_chat(&[parts], &ChatExtras::default(), None)
            .expect("renders"),
        fine()
            .render_chat(&[joined], &ChatExtras::default(), None)
            .expect("renders")
    );
    let image = ChatMessage {
        role: "user".into(),
        content: Some(ChatContent::Parts(vec![ContentPart {
            kind: "image_url".into(),
            ..ContentPart::default()
        }])),
        extra: Default::default(),
    };
    assert!(matches!(
        fine().render_chat(&[image], &ChatExtras::default(), None),
        Err(TemplateError::UnsupportedContent { index: 0, .. })
    ));
}

#[test]
fn multi_turn_chats_match_plain_and_reuse_the_prefix() {
    let tok = small_cache();
    let mut messages = vec![ChatMessage::text("system", FRAGMENTS[0])];
    for turn in 0..8 {
        messages.push(ChatMessage::text("user", long_prompt(3 + turn)));
        let ids = tok
            .encode_chat(&messages, &ChatExtras::default(), None)
            .expect("encodes");
        let rendered = tok
            .render_chat(&messages, &ChatExtras::default(), None)
            .expect("renders");
        assert_eq!(ids, plain(tok, &rendered));
        messages.push(ChatMessage::text(
            "assistant",
            FRAGMENTS[turn % FRAGMENTS.len()],
        ));
    }
}

#[test]
fn cache_is_correct_on_repeats_prefix_variants_and_after_eviction() {
    let tok = small_cache();
    let base = long_prompt(40);
    let first = tok.encode(&base).expect("encodes");
    assert_eq!(tok.encode(&base).expect("encodes"), first);
    for suffix in ["", " more words", "\nnew line", "<｜User｜>x", "中文", "1"] {
        let variant = format!("{base}{suffix}");
        assert_exact(tok, &variant);
        // The same text cut short in the middle of a chunk.
        assert_exact(tok, &variant[..variant.len() / 2 + 1]);
    }
    // Many distinct texts push the early chunks out of the 8-entry cache.
    for i in 0..20 {
        assert_exact(tok, &format!("filler {i} {}", long_prompt(4)));
    }
    assert!(tok.cache_stats().evictions > 0);
    assert_eq!(tok.encode(&base).expect("encodes"), first);
}

#[test]
fn override_template_and_bad_template() {
    let custom = ChatTemplate::new(
        "{% for m in messages %}[{{ m.role }}]{{ m.content | trim }}\n{% endfor %}".into(),
        None,
        None,
        "inline",
    )
    .expect("compiles");
    let rendered = fine()
        .render_chat(
            &three_messages()[1..],
            &ChatExtras::default(),
            Some(&custom),
        )
        .expect("renders");
    assert_eq!(rendered, "[user]What is 2 + 2?\n[assistant]4.\n");

    let bad = ChatTemplate::new("{% for m in messages %}".into(), None, None, "inline");
    assert!(matches!(bad, Err(TemplateError::Syntax { .. })), "{bad:?}");
}

#[test]
fn template_file_and_missing_template() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("t.jinja");
    std::fs::write(
        &file,
        "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}",
    )
    .expect("write");
    let template = fine().load_chat_template(&file).expect("loads");
    assert_eq!(
        template
            .render(&three_messages(), &ChatExtras::default())
            .expect("renders"),
        "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜end▁of▁sentence｜>"
    );
    let missing = fine().load_chat_template(&dir.path().join("nope.jinja"));
    assert!(matches!(missing, Err(TemplateError::Io { .. })));

    // tokenizer.json alone: loads, but a chat needs an override.
    std::fs::copy(
        fixture_dir().join("tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .expect("copy");
    let bare = Tokenizer::from_path(&dir.path().join("tokenizer.json")).expect("loads");
    let err = bare.encode_chat(&three_messages(), &ChatExtras::default(), None);
    assert!(
        matches!(
            err,
            Err(TokenizeError::Template(TemplateError::Missing { .. }))
        ),
        "{err:?}"
    );
    assert!(
        bare.encode_chat(&three_messages(), &ChatExtras::default(), Some(&template))
            .is_ok()
    );
}

#[test]
fn load_errors_name_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let err = Tokenizer::from_path(dir.path()).expect_err("no tokenizer.json");
    assert!(matches!(err, TokenizeError::Io { .. }));
    assert!(err.to_string().contains("tokenizer.json"), "{err}");

    let bad = dir.path().join("tokenizer.json");
    std::fs::write(&bad, "{ not json").expect("write");
    let err = Tokenizer::from_path(&bad).expect_err("invalid");
    assert!(matches!(err, TokenizeError::Invalid { .. }));
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
    assert!(!err.is_retryable());
}

// ---------------------------------------------------------------------------------------------
// The native encoder (own pre-tokenizer + BPE) against the plain crate call.
// ---------------------------------------------------------------------------------------------

/// The router's defaults: large chunks, parallel only above 8 KiB of misses.
fn router() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| Tokenizer::from_path(&fixture_dir()).expect("fixture loads"))
}

/// Checks `text` with the fine-grained tokenizer and the router's defaults.
fn assert_exact_everywhere(text: &str) {
    let reference = plain(router(), text);
    for tok in [fine(), router()] {
        let ours = tok.encode(text).expect("fast encode");
        assert_eq!(ours, reference, "mismatch for {text:?}");
    }
}

/// One fragment of trouble for the pre-tokenizer or BPE.
fn fragment() -> impl Strategy<Value = String> {
    let chars = |set: Vec<char>, max: usize| {
        prop::collection::vec(prop::sample::select(set), 1..max)
            .prop_map(|v| v.into_iter().collect::<String>())
    };
    prop_oneof![
        // Words with contractions, in any case.
        (
            "[A-Za-z]{1,12}",
            prop::sample::select(vec![
                "", "", "'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "n't", "'S", "'LL", "’s"
            ])
        )
            .prop_map(|(w, c)| format!("{w}{c}")),
        // Whitespace runs of every kind, including lone \r and Unicode spaces.
        chars(
            vec![
                ' ', ' ', ' ', '\t', '\n', '\n', '\r', '\u{a0}', '\u{3000}', '\u{2028}',
                '\u{2029}', '\u{b}', '\u{c}', '\u{85}', '\u{2009}'
            ],
            14
        ),
        // Digit runs, ASCII and not.
        chars(
            vec![
                '0', '1', '2', '5', '9', '9', '²', '①', 'Ⅻ', '٣', '৪', '〇', '½'
            ],
            12
        ),
        // CJK, kana (incl. the block's marks, symbols and unassigned points) and hangul.
        chars(
            vec![
                '中', '文', '一', '龥', '龦', '㐀', 'あ', 'ア', 'ヿ', '゠', '・', 'ー', '゛',
                '\u{3099}', '\u{3040}', '\u{3097}', '한', '国', '，', '。'
            ],
            10
        ),
        // ASCII punctuation and symbol runs.
        "[!-/:-@\\[-`{-~]{1,6}",
        prop::sample::select(vec![
            "、", "。", "「」", "！？", "«»", "—", "…", "€", "→", "©", "¿", "§", "¶", "‰"
        ])
        .prop_map(String::from),
        // Emoji: modifiers, ZWJ sequences, flags, keycaps, variation selectors.
        prop::sample::select(vec!["😀", "👍🏽", "👨‍👩‍👧", "🇺🇸", "1️⃣", "❤️", "🤖", "🏳️‍🌈", "✨✨"])
            .prop_map(String::from),
        // Combining marks and format characters, around letters.
        chars(
            vec![
                'e', 'a', '\u{301}', '\u{308}', '\u{20dd}', '\u{200b}', '\u{200d}', '\u{ad}',
                '\u{feff}', '\u{e000}', '\u{1}', '\u{7f}'
            ],
            8
        ),
        // Random bytes, read as Latin-1 chars and decoded lossily as UTF-8.
        prop::collection::vec(any::<u8>(), 1..16)
            .prop_map(|b| b.into_iter().map(char::from).collect::<String>()),
        prop::collection::vec(any::<u8>(), 1..16)
            .prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
        // Special tokens and their fragments.
        prop::sample::select(ATOMS).prop_map(String::from),
        any::<char>().prop_map(String::from),
    ]
}

fn mixed_text() -> impl Strategy<Value = String> {
    prop::collection::vec(fragment(), 0..40).prop_map(|v| v.concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1500))]

    #[test]
    fn mixed_text_matches_plain(text in mixed_text()) {
        assert_exact_everywhere(&text);
    }
}

/// Text files of this repository: prose, licences, JSON and Rust source.
fn repo_texts() -> Vec<(PathBuf, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut paths: Vec<PathBuf> = [
        "README.md",
        "fixtures/traces/README.md",
        "fixtures/traces/LICENSE-Apache-2.0",
        "fixtures/kv-events/README.md",
        "fixtures/hashing/golden.json",
        "fixtures/tokenizers/deepseek-v4/tokenizer_config.json",
        "Cargo.toml",
    ]
    .iter()
    .map(|p| root.join(p))
    .collect();
    let mut dirs = vec![root.join("adapters/src")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read source dir").flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                paths.push(path);
            }
        }
    }
    paths.sort();
    paths
        .into_iter()
        .filter_map(|p| std::fs::read_to_string(&p).ok().map(|text| (p, text)))
        .collect()
}

#[test]
fn repository_text_files_match_plain() {
    let texts = repo_texts();
    assert!(texts.len() > 10, "found only {} text files", texts.len());
    for (path, text) in &texts {
        let ours = router().encode(text).expect("encodes");
        assert_eq!(
            ours,
            plain(router(), text),
            "mismatch for {}",
            path.display()
        );
    }
}

/// Every vocabulary token decoded to text, in id order: real subwords of every script the
/// tokenizer was trained on, glued together as in running text.
#[test]
fn decoded_vocabulary_matches_plain() {
    let inner = router().inner();
    let size = inner.get_vocab_size(false) as u32;
    let mut checked = 0;
    for start in (0..size).step_by(256) {
        let ids: Vec<u32> = (start..(start + 256).min(size)).collect();
        let text = inner.decode(&ids, false).expect("decodes");
        assert_exact(router(), &text);
        checked += text.len();
    }
    assert!(checked > 500_000, "decoded only {checked} bytes");
}

#[test]
fn prompt_of_32k_tokens_matches_plain() {
    // Prose, code, JSON and CJK paragraphs, as in the bench; 1250 of them are ~34k tokens.
    let text = format!("<｜begin▁of▁sentence｜>{}", long_prompt(1250));
    let tok = Tokenizer::from_path(&fixture_dir()).expect("fixture loads");
    let reference = plain(&tok, &text);
    assert!(reference.len() >= 32_000, "{} tokens", reference.len());
    assert_eq!(tok.encode(&text).expect("encodes"), reference);
    assert_eq!(fine().encode(&text).expect("encodes"), reference);
    // Warm: the same text plus a new tail reuses the cached chunks.
    let longer = format!("{text}\nOne more question about the above?");
    assert_eq!(tok.encode(&longer).expect("encodes"), plain(&tok, &longer));
    assert!(tok.cache_stats().hits > 0);
}

/// Deterministic pseudo-random text from a seed (no RNG dependency).
fn lcg_text(seed: u64, len: usize, alphabet: &[char]) -> String {
    let mut x = seed;
    (0..len)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            alphabet[(x >> 33) as usize % alphabet.len()]
        })
        .collect()
}

#[test]
fn long_pre_tokens_match_plain() {
    let base64: Vec<char> = ('A'..='Z')
        .chain('a'..='z')
        .chain('0'..='9')
        .chain(['+', '/'])
        .collect();
    let cjk: Vec<char> = "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年"
        .chars()
        .collect();
    let spaces = [' ', ' ', ' ', '\t', '\n', '\u{a0}'];
    for text in [
        "=".repeat(3_000),
        "a".repeat(1_000),
        "ab".repeat(1_000),
        format!("data:image/png;base64,{}", lcg_text(1, 3_000, &base64)),
        lcg_text(2, 1_500, &cjk),
        lcg_text(3, 2_000, &spaces),
        "😀".repeat(500),
        format!("x{}y", " ".repeat(2_000)),
        "\u{301}".repeat(1_000),
        "-_".repeat(800),
    ] {
        assert_exact_everywhere(&text);
    }
}

/// Runs long enough to approach `fancy-regex`'s backtrack and stack limits are handed to the
/// crate whole, so even its give-up behaviour is reproduced.
#[test]
fn pathological_runs_fall_back_to_the_crate() {
    let tok = Tokenizer::from_path(&fixture_dir()).expect("fixture loads");
    let tail = " and then ordinary words follow, with safe split points.\n".repeat(60);
    for text in [
        format!("{}{tail}", "\u{1}".repeat(120_000)),
        format!("{}x{tail}", " ".repeat(120_000)),
    ] {
        assert_eq!(tok.encode(&text).expect("encodes"), plain(&tok, &text));
    }
    assert_eq!(tok.cache_stats().plain_fallbacks, 2);
    // Just below the limits the native encoder handles them itself.
    let below = format!("{}x{tail}", "\u{1}".repeat(90_000));
    assert_eq!(tok.encode(&below).expect("encodes"), plain(&tok, &below));
    assert_eq!(tok.cache_stats().plain_fallbacks, 2);
}

/// A model the native encoder does not cover (here `ignore_merges`, which changes BPE) keeps
/// the cuts and the cache but encodes chunks with the crate, and says why.
#[test]
fn unproven_model_falls_back_to_crate_chunks() {
    let raw = std::fs::read(fixture_dir().join("tokenizer.json")).expect("fixture");
    let mut json: serde_json::Value = serde_json::from_slice(&raw).expect("json");
    json["model"]["ignore_merges"] = serde_json::Value::Bool(true);
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, serde_json::to_vec(&json).expect("serializes")).expect("write");
    let tok = Tokenizer::from_path(&path).expect("loads");
    match tok.fast_path() {
        FastPath::Enabled { reason } => assert!(reason.contains("ignore_merges"), "{reason}"),
        other => panic!("expected the crate-chunk mode, got {other:?}"),
    }
    for text in [FRAGMENTS.concat(), long_prompt(30)] {
        assert_exact(&tok, &text);
    }
}
