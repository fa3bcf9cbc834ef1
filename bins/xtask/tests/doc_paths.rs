//! The docs name only what exists: every relative link of the README, the design card, the
//! protocols, CONTRIBUTING.md and `docs/` resolves, and every repository path the design card
//! and `docs/` quote in backticks is in the tree.

use std::path::{Path, PathBuf};

/// The folders at the top of the tree; a backticked word starting with one is a path.
const TOP: &[&str] = &[
    "core/",
    "backends/",
    "adapters/",
    "replay/",
    "kvd/",
    "bins/",
    "fixtures/",
    "docs/",
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn documents() -> Vec<PathBuf> {
    let root = root();
    let mut docs: Vec<PathBuf> = [
        "README.md",
        "ARCHITECTURE.md",
        "PROTOCOLS.md",
        "CONTRIBUTING.md",
    ]
    .iter()
    .map(|d| root.join(d))
    .collect();
    let mut pages: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    pages.sort();
    docs.extend(pages);
    docs
}

/// The targets of `[text](target)` links that are neither URLs nor anchors, without anchors.
fn links(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("](") {
        rest = &rest[i + 2..];
        let Some(end) = rest.find(')') else { break };
        let target = rest[..end].split('#').next().unwrap_or("");
        if !target.is_empty() && !target.contains("://") && !target.starts_with("mailto:") {
            out.push(target);
        }
        rest = &rest[end..];
    }
    out
}

/// Backticked words that name a path of the tree (globs and placeholders left out).
fn quoted_paths(text: &str) -> Vec<&str> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .filter(|w| TOP.iter().any(|t| w.starts_with(t)))
        .filter(|w| !w.contains([' ', '*', '{', '<', '…']) && !w.contains("..."))
        .map(|w| w.trim_end_matches([':', ',', '.']))
        .collect()
}

#[test]
fn every_link_and_quoted_path_exists() {
    let root = root();
    let mut missing = Vec::new();
    for doc in documents() {
        let text = std::fs::read_to_string(&doc).expect("read");
        let dir = doc.parent().expect("parent");
        for target in links(&text) {
            if !dir.join(target).exists() {
                missing.push(format!("{}: link {target}", doc.display()));
            }
        }
        let quotes_paths = doc.ends_with("ARCHITECTURE.md") || dir.ends_with("docs");
        for path in quoted_paths(&text).into_iter().filter(|_| quotes_paths) {
            if !root.join(path).exists() {
                missing.push(format!("{}: path {path}", doc.display()));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "named but missing:\n{}",
        missing.join("\n")
    );
}

#[test]
fn the_checks_see_links_and_paths() {
    let text = "see [a](docs/a.md#x), [b](https://x.io), `core/src/lib.rs`, `core/*.rs` and `x/y`";
    assert_eq!(links(text), ["docs/a.md"]);
    assert_eq!(quoted_paths(text), ["core/src/lib.rs"]);
}
