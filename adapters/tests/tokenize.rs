//! `infera_adapters::tokenize` against the plain `tokenizers` call on the DeepSeek fixture.
//!
//! The exactness tests use a tokenizer tuned to cut at *every* safe split point and to always
//! go parallel, so each proptest case checks the split rule at every place it fires, the
//! added-token segmentation and the parallel merge. The reference is always
//! `tokenizers::Tokenizer::encode(text, false)` on the same wrapped tokenizer.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use infera_adapters::tokenize::{
    CacheConfig, ChatContent, ChatMessage, ChatTemplate, ContentPart, FastPath, TemplateError,
    TokenizeError, Tokenizer, TokenizerOptions,
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
    assert_eq!(fine().fast_path(), &FastPath::Enabled);
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
        .render_chat(&three_messages(), None)
        .expect("template renders");
    assert_eq!(
        rendered,
        "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>What is 2 + 2?\
         <｜Assistant｜>4.<｜end▁of▁sentence｜><｜Assistant｜>"
    );
    let ids = fine()
        .encode_chat(&three_messages(), None)
        .expect("encodes");
    assert_eq!(ids, plain(fine(), &rendered));
    assert_eq!(ids.first(), Some(&0));
    assert_eq!(ids.last(), Some(&128_804));
    assert!(ids.contains(&128_803) && ids.contains(&1));
}

#[test]
fn array_content_is_joined_and_non_text_is_rejected() {
    let parts = ChatMessage {
        role: "user".into(),
        content: Some(ChatContent::Parts(vec![
            ContentPart {
                kind: "text".into(),
                text: Some("first".into()),
            },
            ContentPart {
                kind: "text".into(),
                text: Some("second".into()),
            },
        ])),
    };
    let joined = ChatMessage::text("user", "first\nsecond");
    assert_eq!(
        fine().render_chat(&[parts], None).expect("renders"),
        fine().render_chat(&[joined], None).expect("renders")
    );
    let image = ChatMessage {
        role: "user".into(),
        content: Some(ChatContent::Parts(vec![ContentPart {
            kind: "image_url".into(),
            text: None,
        }])),
    };
    assert!(matches!(
        fine().render_chat(&[image], None),
        Err(TemplateError::UnsupportedContent { index: 0, .. })
    ));
}

#[test]
fn multi_turn_chats_match_plain_and_reuse_the_prefix() {
    let tok = small_cache();
    let mut messages = vec![ChatMessage::text("system", FRAGMENTS[0])];
    for turn in 0..8 {
        messages.push(ChatMessage::text("user", long_prompt(3 + turn)));
        let ids = tok.encode_chat(&messages, None).expect("encodes");
        let rendered = tok.render_chat(&messages, None).expect("renders");
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
        .render_chat(&three_messages()[1..], Some(&custom))
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
        template.render(&three_messages()).expect("renders"),
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
    let err = bare.encode_chat(&three_messages(), None);
    assert!(
        matches!(
            err,
            Err(TokenizeError::Template(TemplateError::Missing { .. }))
        ),
        "{err:?}"
    );
    assert!(bare.encode_chat(&three_messages(), Some(&template)).is_ok());
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
