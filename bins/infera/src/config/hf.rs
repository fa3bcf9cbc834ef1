//! Hugging Face model ids where a tokenizer path is expected (`--router-tokenizer-path
//! Qwen/Qwen3-0.6B`), as the Python server takes them: the id is looked up in the local Hugging
//! Face cache, in the hub layout `huggingface_hub` writes
//! (`models--{org}--{name}/refs/{revision}` names a snapshot,
//! `snapshots/{commit}/tokenizer.json` is the file). The cache is the first of `HF_HUB_CACHE`,
//! `HUGGINGFACE_HUB_CACHE`, `$HF_HOME/hub`, `$XDG_CACHE_HOME/huggingface/hub` and
//! `~/.cache/huggingface/hub`; the revision is `HF_REVISION` or `main`. A model missing from the
//! cache is downloaded into it from `HF_ENDPOINT` (default `https://huggingface.co`, with
//! `HF_TOKEN` for gated models; see [`download`]) unless `HF_HUB_OFFLINE` is set; what cannot be
//! had is an error naming the cache and the command that fills it.

mod download;

use std::path::{Path, PathBuf};

/// Whether `text` reads as a model id (`org/name`, or a bare `name`) rather than a path: one
/// or two non-empty segments of letters, digits, `-`, `_` and `.`, not `.` or `..`, and no
/// leading `/`, `./` or `~`.
pub fn is_model_id(text: &str) -> bool {
    let segments: Vec<&str> = text.split('/').collect();
    let segment_ok = |s: &&str| {
        !s.is_empty()
            && *s != "."
            && *s != ".."
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    (1..=2).contains(&segments.len()) && segments.iter().all(segment_ok)
}

/// The hub cache directory, from `env` (see the module docs).
pub fn hub_cache(env: &dyn Fn(&str) -> Option<String>) -> PathBuf {
    let set = |key: &str| env(key).filter(|v| !v.is_empty()).map(PathBuf::from);
    set("HF_HUB_CACHE")
        .or_else(|| set("HUGGINGFACE_HUB_CACHE"))
        .or_else(|| set("HF_HOME").map(|h| h.join("hub")))
        .or_else(|| set("XDG_CACHE_HOME").map(|c| c.join("huggingface").join("hub")))
        .unwrap_or_else(|| {
            set("HOME")
                .unwrap_or_else(|| PathBuf::from("/"))
                .join(".cache")
                .join("huggingface")
                .join("hub")
        })
}

/// The `tokenizer.json` of model `id`: the cached one, else downloaded into the cache (see the
/// module docs).
///
/// # Errors
/// A message naming the cache searched, why the file could not be had, and how to fill it.
pub fn tokenizer(id: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<PathBuf, String> {
    let set = |key: &str| env(key).filter(|v| !v.trim().is_empty());
    let cache = hub_cache(env);
    let revision = set("HF_REVISION").unwrap_or_else(|| "main".to_owned());
    let model = cache.join(format!("models--{}", id.replace('/', "--")));
    let cached = commit_of(&model, &revision)
        .map(|commit| model.join("snapshots").join(commit).join("tokenizer.json"))
        .filter(|file| file.is_file());
    if let Some(file) = cached {
        return Ok(file);
    }
    let missing = |why: String| {
        format!(
            "{id} looks like a Hugging Face model id, but revision {revision} of its \
             tokenizer.json is not in the cache at {} and {why}: fill it with \
             `huggingface-cli download {id} tokenizer.json`, set HF_HOME or HF_HUB_CACHE to the \
             cache that has it, or pass a directory containing tokenizer.json",
            cache.display()
        )
    };
    let offline = set("HF_HUB_OFFLINE").is_some_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "1" | "on" | "yes" | "true"
        )
    });
    if offline {
        return Err(missing("HF_HUB_OFFLINE is set".to_owned()));
    }
    let hub = download::Hub {
        endpoint: set("HF_ENDPOINT")
            .unwrap_or_else(|| "https://huggingface.co".to_owned())
            .trim_end_matches('/')
            .to_owned(),
        token: set("HF_TOKEN").or_else(|| set("HUGGING_FACE_HUB_TOKEN")),
    };
    download::tokenizer(&hub, id, &revision, &model)
        .map_err(|e| missing(format!("downloading it failed: {e}")))
}

/// The snapshot of `revision`: the commit a ref names, or the revision itself when it is a
/// snapshot directory (a commit hash).
fn commit_of(model: &Path, revision: &str) -> Option<String> {
    if let Ok(commit) = std::fs::read_to_string(model.join("refs").join(revision)) {
        let commit = commit.trim();
        return (!commit.is_empty() && !commit.contains('/')).then(|| commit.to_owned());
    }
    model
        .join("snapshots")
        .join(revision)
        .is_dir()
        .then(|| revision.to_owned())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_told_from_paths() {
        for id in ["Qwen/Qwen3-0.6B", "gpt2", "deepseek-ai/DeepSeek-V3.1"] {
            assert!(is_model_id(id), "{id}");
        }
        for path in [
            "/models/qwen",
            "./qwen",
            "a/b/c",
            "~/m",
            "..",
            "a//b",
            "org/na me",
        ] {
            assert!(!is_model_id(path), "{path}");
        }
    }

    #[test]
    fn the_cache_follows_the_hugging_face_variables() {
        fn env(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(key, _)| *key == k)
                    .map(|(_, v)| (*v).to_owned())
            }
        }
        const ORDER: &[(&str, &str)] = &[("HF_HUB_CACHE", "/a"), ("HF_HOME", "/b"), ("HOME", "/h")];
        assert_eq!(hub_cache(&env(ORDER)), PathBuf::from("/a"));
        assert_eq!(hub_cache(&env(&ORDER[1..])), PathBuf::from("/b/hub"));
        assert_eq!(
            hub_cache(&env(&ORDER[2..])),
            PathBuf::from("/h/.cache/huggingface/hub")
        );
    }

    #[test]
    fn a_cached_snapshot_is_found_by_its_ref_and_a_missing_one_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("models--org--m");
        std::fs::create_dir_all(model.join("refs")).unwrap();
        std::fs::create_dir_all(model.join("snapshots/abc123")).unwrap();
        std::fs::write(model.join("refs/main"), "abc123\n").unwrap();
        std::fs::write(model.join("snapshots/abc123/tokenizer.json"), "{}").unwrap();
        let root = dir.path().to_string_lossy().into_owned();
        let env = move |k: &str| (k == "HF_HUB_CACHE").then(|| root.clone());
        assert_eq!(
            tokenizer("org/m", &env).unwrap(),
            model.join("snapshots/abc123/tokenizer.json")
        );
        let offline = |k: &str| match k {
            "HF_HUB_OFFLINE" => Some("1".to_owned()),
            other => env(other),
        };
        let e = tokenizer("org/other", &offline).unwrap_err();
        assert!(e.contains("HF_HUB_OFFLINE is set"), "{e}");
        assert!(e.contains("huggingface-cli download org/other"), "{e}");
        assert!(e.contains(&dir.path().display().to_string()), "{e}");
    }
}
