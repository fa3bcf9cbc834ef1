//! `cargo xtask layers`: the workspace's dependency rules, checked on `cargo metadata`.
//!
//! Dependencies point inward (see ARCHITECTURE.md):
//! - `infera-core` depends on no workspace crate;
//! - `infera-adapters`, `infera-backends`, `infera-replay` and `infera-kvd` depend on
//!   `infera-core` only (a crate may name itself, to turn on its own test features);
//! - `infera-kvd-py` (the Python extension, an edge like the binary) depends on `infera-kvd`
//!   and `infera-core` only;
//! - only the binaries (`infera`, `xtask`) depend on the other crates;
//! - inside the `infera` binary, only its wiring module (`bins/infera/src/wiring/`) names
//!   `infera_backends`: a scan of the binary's sources (comments included) for the name.
//!
//! Every dependency kind counts (normal, build and dev): a test or bench that needs two layers
//! lives in the binary crate (its tests and benches may name backends; they are not scanned).
//! `cargo xtask test` runs this check first, then [`check_without_backends`]: the binary built
//! with every backend feature off.

use anyhow::{Context, bail};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The library crates and the workspace crates each may depend on.
const RULES: &[(&str, &[&str])] = &[
    ("infera-core", &[]),
    ("infera-adapters", &["infera-core"]),
    ("infera-backends", &["infera-core"]),
    ("infera-replay", &["infera-core"]),
    ("infera-kvd", &["infera-core"]),
    ("infera-kvd-py", &["infera-core", "infera-kvd"]),
];

/// The binary's sources, relative to the workspace root.
const BINARY_SRC: &str = "bins/infera/src";
/// The binary's wiring module, relative to [`BINARY_SRC`]: a folder, or a file.
const WIRING: &[&str] = &["wiring", "wiring.rs"];
/// The name only the wiring module may write.
const BACKENDS: &str = "infera_backends";

/// Checks the rules on the workspace at `root`.
///
/// # Errors
/// Every broken rule, one per line; or `cargo metadata` failing.
pub fn check(root: &Path) -> anyhow::Result<()> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let output = Command::new(cargo)
        .current_dir(root)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .output()
        .context("cannot run cargo metadata")?;
    if !output.status.success() {
        bail!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let metadata: Value =
        serde_json::from_slice(&output.stdout).context("cargo metadata printed no JSON")?;
    let mut broken = violations(&metadata);
    broken.extend(backends_outside_wiring(&root.join(BINARY_SRC))?);
    if !broken.is_empty() {
        bail!("layering rules broken:\n  {}", broken.join("\n  "));
    }
    println!(
        "xtask: layers: every library crate depends inward only; only the binary's wiring \
         module names a backend"
    );
    Ok(())
}

/// `cargo check -p infera --no-default-features`: the binary with every backend compiled out
/// must build, and without a warning (a backend's code behind a feature leaves nothing unused).
/// Run by `cargo xtask test` after [`check`]; a few seconds once built.
///
/// # Errors
/// The check does not build, or warns (each warning named).
pub fn check_without_backends(root: &Path) -> anyhow::Result<()> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let args = [
        "check",
        "-p",
        "infera",
        "--no-default-features",
        "--message-format=json",
    ];
    println!("xtask: layers: cargo {}", args.join(" "));
    let output = Command::new(cargo)
        .current_dir(root)
        .args(args)
        .output()
        .context("cannot run cargo check")?;
    let warnings = warnings(&String::from_utf8_lossy(&output.stdout));
    if !output.status.success() {
        bail!(
            "infera does not build without its backends (--no-default-features):\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    if !warnings.is_empty() {
        bail!(
            "infera warns without its backends (--no-default-features):\n{}",
            warnings.join("\n")
        );
    }
    Ok(())
}

/// The rendered warnings among `cargo --message-format=json` lines.
fn warnings(json_lines: &str) -> Vec<String> {
    json_lines
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|m| m["reason"] == "compiler-message" && m["message"]["level"] == "warning")
        .map(|m| {
            let message = &m["message"];
            message["rendered"]
                .as_str()
                .or_else(|| message["message"].as_str())
                .unwrap_or("a warning")
                .to_owned()
        })
        .collect()
}

/// The broken rules in `cargo metadata` output, as sentences.
fn violations(metadata: &Value) -> Vec<String> {
    let packages = metadata["packages"].as_array().cloned().unwrap_or_default();
    let members: Vec<&str> = packages.iter().filter_map(|p| p["name"].as_str()).collect();
    let mut broken = Vec::new();
    for (crate_name, allowed) in RULES {
        let Some(package) = packages.iter().find(|p| p["name"] == *crate_name) else {
            broken.push(format!("{crate_name} is not a workspace member any more"));
            continue;
        };
        for dep in package["dependencies"].as_array().into_iter().flatten() {
            let Some(name) = dep["name"].as_str() else {
                continue;
            };
            if members.contains(&name) && name != *crate_name && !allowed.contains(&name) {
                let kind = dep["kind"].as_str().unwrap_or("normal");
                broken.push(format!(
                    "{crate_name} depends on {name} ({kind}); it may depend on {}",
                    if allowed.is_empty() {
                        "no workspace crate".to_owned()
                    } else {
                        allowed.join(", ")
                    }
                ));
            }
        }
    }
    broken
}

/// Every line of a Rust file under `src` (the binary's source folder) that names
/// [`BACKENDS`] outside the wiring module, as sentences.
///
/// # Errors
/// A folder or file that cannot be read.
fn backends_outside_wiring(src: &Path) -> anyhow::Result<Vec<String>> {
    let mut broken = Vec::new();
    let mut folders = vec![src.to_path_buf()];
    while let Some(folder) = folders.pop() {
        let entries = std::fs::read_dir(&folder)
            .with_context(|| format!("cannot list {}", folder.display()))?;
        let mut paths: Vec<PathBuf> = entries
            .map(|entry| entry.map(|e| e.path()))
            .collect::<Result<_, _>>()
            .with_context(|| format!("cannot list {}", folder.display()))?;
        paths.sort();
        for path in paths {
            let relative = path.strip_prefix(src).unwrap_or(&path);
            if WIRING.iter().any(|w| relative == Path::new(w)) {
                continue;
            }
            if path.is_dir() {
                folders.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path)
                    .with_context(|| format!("cannot read {}", path.display()))?;
                for (index, line) in text.lines().enumerate() {
                    if line.contains(BACKENDS) {
                        broken.push(format!(
                            "{}:{} names {BACKENDS}; only the binary's wiring module \
                             ({BINARY_SRC}/wiring) may",
                            path.display(),
                            index + 1
                        ));
                    }
                }
            }
        }
    }
    Ok(broken)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn package(name: &str, deps: &[(&str, &str)]) -> Value {
        let deps: Vec<Value> = deps
            .iter()
            .map(|(n, kind)| json!({"name": n, "kind": if *kind == "normal" { Value::Null } else { json!(kind) }}))
            .collect();
        json!({"name": name, "dependencies": deps})
    }

    fn workspace(extra_backends_dep: Option<(&str, &str)>) -> Value {
        let mut backends = vec![
            ("infera-core", "normal"),
            ("infera-backends", "dev"),
            ("tokio", "normal"),
        ];
        backends.extend(extra_backends_dep);
        json!({"packages": [
            package("infera-core", &[("serde", "normal")]),
            package("infera-adapters", &[("infera-core", "normal")]),
            package("infera-backends", &backends),
            package("infera-replay", &[("infera-core", "normal")]),
            package("infera-kvd", &[("infera-core", "normal")]),
            package(
                "infera-kvd-py",
                &[("infera-core", "normal"), ("infera-kvd", "normal")],
            ),
            package("infera", &[("infera-adapters", "normal"), ("infera-backends", "dev")]),
        ]})
    }

    #[test]
    fn inward_dependencies_pass() {
        assert_eq!(violations(&workspace(None)), Vec::<String>::new());
    }

    #[test]
    fn an_outward_edge_of_any_kind_is_named() {
        for kind in ["normal", "dev", "build"] {
            let broken = violations(&workspace(Some(("infera-adapters", kind))));
            assert_eq!(broken.len(), 1, "{broken:?}");
            assert!(
                broken[0].contains("infera-backends depends on infera-adapters"),
                "{broken:?}"
            );
            assert!(broken[0].contains(kind), "{broken:?}");
        }
    }

    #[test]
    fn a_binary_file_outside_the_wiring_that_names_a_backend_is_named() {
        let src = tempfile::tempdir().unwrap();
        let write = |path: &str, text: &str| {
            let path = src.path().join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        };
        write("main.rs", "mod wiring;\nmod worker;\n");
        write("wiring/mod.rs", "use infera_backends::nats;\n");
        write("wiring/nats.rs", "pub use infera_backends::nats::Client;\n");
        write("worker/mod.rs", "use crate::wiring::NatsLink;\n");
        assert_eq!(
            backends_outside_wiring(src.path()).unwrap(),
            Vec::<String>::new()
        );

        write(
            "worker/mod.rs",
            "use crate::wiring::NatsLink;\nuse infera_backends::zmq;\n",
        );
        write("notes.txt", "infera_backends is not Rust here\n");
        let broken = backends_outside_wiring(src.path()).unwrap();
        assert_eq!(broken.len(), 1, "{broken:?}");
        assert!(
            broken[0].contains("worker/mod.rs:2 names infera_backends"),
            "{broken:?}"
        );
        assert!(broken[0].contains("wiring module"), "{broken:?}");
    }

    #[test]
    fn warnings_are_picked_from_cargo_json_messages() {
        let lines = [
            json!({"reason": "compiler-artifact", "target": {"name": "infera"}}),
            json!({"reason": "compiler-message", "message": {"level": "warning", "rendered": "warning: unused variable `flag`"}}),
            json!({"reason": "compiler-message", "message": {"level": "note", "rendered": "note: x"}}),
            json!({"reason": "build-finished", "success": true}),
        ]
        .map(|v| v.to_string())
        .join("\n");
        assert_eq!(
            warnings(&format!("{lines}\nnot json")),
            ["warning: unused variable `flag`"]
        );
    }

    #[test]
    fn this_workspace_keeps_its_layers() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        check(&root).expect("the workspace's own layering");
    }
}
