//! `cargo xtask commits [-- RANGE]`: checks commit messages against CONTRIBUTING.md: a subject of
//! at most [`MAX_SUBJECT`] characters, then a blank line before any body. `RANGE` is a
//! `git log` revision range (default `HEAD~1..HEAD`, the last commit); every offending commit is
//! listed, and the task fails when there is one.

use anyhow::{Context, bail};
use std::path::Path;
use std::process::Command;

/// The longest subject line accepted.
pub const MAX_SUBJECT: usize = 72;

/// What is wrong with one commit message, if anything.
pub fn problems(message: &str) -> Vec<String> {
    let mut lines = message.lines();
    let subject = lines.next().unwrap_or_default();
    let mut out = Vec::new();
    let len = subject.chars().count();
    if subject.trim().is_empty() {
        out.push("the subject is empty".to_owned());
    } else if len > MAX_SUBJECT {
        out.push(format!(
            "the subject has {len} characters, more than {MAX_SUBJECT}: put the details in the body"
        ));
    }
    if lines.next().is_some_and(|l| !l.trim().is_empty()) {
        out.push("the subject is not followed by a blank line".to_owned());
    }
    out
}

/// Checks the commits of `range` in the repository at `root`.
///
/// # Errors
/// `git` fails, or a commit breaks the rules (each one is printed).
pub fn check(root: &Path, range: Option<&str>) -> anyhow::Result<()> {
    let range = range.unwrap_or("HEAD~1..HEAD");
    let output = Command::new("git")
        .current_dir(root)
        .args(["log", "--format=%H%x00%B%x01", range])
        .output()
        .context("cannot run git log")?;
    if !output.status.success() {
        bail!(
            "git log {range} failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    let text = String::from_utf8_lossy(&output.stdout);
    let mut bad = 0;
    for entry in text.split('\u{1}').filter(|e| !e.trim().is_empty()) {
        let (hash, message) = entry.trim_start().split_once('\0').unwrap_or((entry, ""));
        for problem in problems(message) {
            println!("xtask: commit {}: {problem}", &hash[..hash.len().min(12)]);
            bad += 1;
        }
    }
    if bad > 0 {
        bail!("{bad} problem(s) in the commit messages of {range} (see CONTRIBUTING.md)");
    }
    println!("xtask: the commit messages of {range} follow CONTRIBUTING.md");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_are_short_and_set_apart_from_the_body() {
        assert!(problems("Route LoRA requests by adapter\n\nWhy and figures.\n").is_empty());
        assert!(problems("Fix a typo").is_empty());
        assert_eq!(problems(&"x".repeat(73)).len(), 1);
        assert!(
            problems(&"é".repeat(72)).is_empty(),
            "characters, not bytes"
        );
        assert_eq!(problems("Subject\nbody at once").len(), 1);
        assert_eq!(problems("\n\nbody").len(), 1);
    }
}
