//! `cargo xtask layers`: the workspace's dependency rules, checked on `cargo metadata`.
//!
//! Dependencies point inward (see the README's architecture section):
//! - `infera-core` depends on no workspace crate;
//! - `infera-adapters`, `infera-backends`, `infera-replay` and `infera-kvd` depend on
//!   `infera-core` only (a crate may name itself, to turn on its own test features);
//! - only the binaries (`infera`, `xtask`) depend on the other crates.
//!
//! Every dependency kind counts (normal, build and dev): a test or bench that needs two layers
//! lives in the binary crate. `cargo xtask test` runs this check first.

use anyhow::{Context, bail};
use serde_json::Value;
use std::path::Path;
use std::process::Command;

/// The library crates and the workspace crates each may depend on.
const RULES: &[(&str, &[&str])] = &[
    ("infera-core", &[]),
    ("infera-adapters", &["infera-core"]),
    ("infera-backends", &["infera-core"]),
    ("infera-replay", &["infera-core"]),
    ("infera-kvd", &["infera-core"]),
];

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
    let broken = violations(&metadata);
    if !broken.is_empty() {
        bail!("layering rules broken:\n  {}", broken.join("\n  "));
    }
    println!("xtask: layers: every library crate depends inward only");
    Ok(())
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
    fn this_workspace_keeps_its_layers() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        check(&root).expect("the workspace's own layering");
    }
}
