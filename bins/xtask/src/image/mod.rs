//! `cargo xtask image [-- --binary PATH] [--tag TAG]`: the container images, built by the local
//! Docker engine from nothing (no base image: no registry is needed or asked) and started.
//!
//! - `infera:<version>` (and `infera:latest`), `bins/deploy/image/Containerfile`: the `infera`
//!   binary (`--binary`, else a release build), each shared library it links (read off `ldd`:
//!   glibc's and libgcc's, from Debian's `libc6` and `libgcc-s1`), the CA certificates rustls
//!   reads, and a non-root user (65532, `infera`) with a home and `/tmp`. No shell, no package
//!   manager, no build tools.
//! - `infera-python:<version>` (and `:latest`), `Containerfile.python`: the same plus Debian's
//!   Python 3.11 (its packages' files and the libraries its modules link) and the `amd-infera`
//!   package, installed by `pip install ./kvd/python`, for the Python Infera's
//!   `python -m infera.…` entry points.
//!
//! The images carry the Debian packages they hold, with versions, in the label
//! `io.infera.debian-packages`. Each build is started ([`smoke`]); `cargo xtask test`
//! builds the images from the debug builds.

mod rootfs;
mod smoke;

use anyhow::{Context, bail};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

const CONTEXT: &str = "target/image";
const UID: u32 = 65532;

/// `cargo xtask image`'s arguments.
#[derive(Debug, Default, PartialEq)]
pub struct Args {
    pub binary: Option<PathBuf>,
    /// The `infera` image's tag; the Python image's is the same with `-python` after the name.
    pub tag: Option<String>,
    /// How the Python image's package is built (`None`: `python3 -m pip`, isolated, release).
    pub package: Option<PackageBuild>,
}

/// How `pip install ./kvd/python` runs for the Python image.
#[derive(Debug, PartialEq)]
pub struct PackageBuild {
    /// The interpreter whose pip (and maturin, in its `bin`) builds the package, without build
    /// isolation.
    pub python: PathBuf,
    /// `MATURIN_PEP517_ARGS`.
    pub maturin_args: String,
}

impl Args {
    /// # Errors
    /// An unknown argument or one without its value.
    pub fn parse(extra: &[OsString]) -> anyhow::Result<Self> {
        let mut args = Self::default();
        let mut it = extra.iter();
        while let Some(arg) = it.next() {
            let mut value = || {
                it.next()
                    .cloned()
                    .with_context(|| format!("{arg:?} needs a value"))
            };
            match arg.to_str() {
                Some("--binary") => args.binary = Some(PathBuf::from(value()?)),
                Some("--tag") => args.tag = Some(value()?.to_string_lossy().into_owned()),
                _ => bail!("unknown argument {arg:?}; expected --binary PATH or --tag TAG"),
            }
        }
        Ok(args)
    }
}

/// The tags of both images: by default the version's and `latest`.
fn tags(args: &Args) -> (Vec<String>, Vec<String>) {
    let version = env!("CARGO_PKG_VERSION");
    let base = match &args.tag {
        Some(tag) => vec![tag.clone()],
        None => vec![format!("infera:{version}"), "infera:latest".to_owned()],
    };
    let python = base
        .iter()
        .map(|tag| match tag.rsplit_once(':') {
            Some((name, label)) if !label.contains('/') => format!("{name}-python:{label}"),
            _ => format!("{tag}-python"),
        })
        .collect();
    (base, python)
}

/// Builds both images and checks them; returns the tags checked.
///
/// # Errors
/// The first step that fails, by name.
pub fn build_and_check(
    root: &Path,
    args: &Args,
    cargo: impl Fn() -> Command,
) -> anyhow::Result<()> {
    let binary = match &args.binary {
        Some(binary) => std::fs::canonicalize(binary)
            .with_context(|| format!("--binary {}", binary.display()))?,
        None => {
            let mut release = cargo();
            release.args(["build", "--locked", "--release", "-p", "infera"]);
            crate::run_step("image: the release binary", &mut release)?;
            root.join("target/release/infera")
        }
    };
    let context = root.join(CONTEXT);
    if context.exists() {
        std::fs::remove_dir_all(&context).with_context(|| format!("cannot remove {CONTEXT}"))?;
    }
    let (base_tags, python_tags) = tags(args);

    let base = context.join("infera");
    let mut packages = rootfs::base(&base.join("rootfs"), &binary)?;
    docker_build(root, &base, "Containerfile", &base_tags, &packages)?;
    smoke::serves(root, &base_tags[0])?;

    let python = context.join("python");
    rootfs::copy(&base.join("rootfs"), &python.join("rootfs"))?;
    packages.extend(rootfs::python(
        root,
        &python.join("rootfs"),
        &binary,
        args.package.as_ref(),
    )?);
    packages.sort();
    packages.dedup();
    docker_build(
        root,
        &python,
        "Containerfile.python",
        &python_tags,
        &packages,
    )?;
    smoke::runs_python_entry_points(&python_tags[0])
}

/// `docker build` of `bins/deploy/image/<file>` in `context`, with each tag.
fn docker_build(
    root: &Path,
    context: &Path,
    file: &str,
    tags: &[String],
    packages: &[String],
) -> anyhow::Result<()> {
    std::fs::copy(
        root.join("bins/deploy/image").join(file),
        context.join(file),
    )
    .with_context(|| format!("cannot copy bins/deploy/image/{file}"))?;
    let mut docker = Command::new("docker");
    docker
        .args(["build", "--quiet", "--file"])
        .arg(context.join(file));
    for tag in tags {
        docker.args(["--tag", tag]);
    }
    docker
        .arg("--label")
        .arg(format!(
            "org.opencontainers.image.version={}",
            env!("CARGO_PKG_VERSION")
        ))
        .arg("--label")
        .arg(format!("io.infera.debian-packages={}", packages.join(" ")))
        .arg(context);
    crate::run_step(&format!("image: docker build {}", tags[0]), &mut docker)?;
    let size = output(Command::new("docker").args([
        "image",
        "inspect",
        "--format",
        "{{.Size}}",
        &tags[0],
    ]))?;
    println!(
        "xtask: image {}: {} MB",
        tags.join(", "),
        size.trim().parse::<u64>().unwrap_or(0) / 1_000_000
    );
    Ok(())
}

/// A command's standard output, failing with its standard error.
fn output(command: &mut Command) -> anyhow::Result<String> {
    let out = command
        .output()
        .with_context(|| format!("could not start {:?}", command.get_program()))?;
    if !out.status.success() {
        bail!(
            "{:?} failed: {}",
            command.get_program(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_take_a_binary_and_a_tag() {
        let args = |list: &[&str]| list.iter().map(OsString::from).collect::<Vec<_>>();
        assert_eq!(Args::parse(&[]).unwrap(), Args::default());
        assert_eq!(
            Args::parse(&args(&["--binary", "/b", "--tag", "x:1"])).unwrap(),
            Args {
                binary: Some("/b".into()),
                tag: Some("x:1".into()),
                package: None,
            }
        );
        assert!(Args::parse(&args(&["--binary"])).is_err());
        assert!(Args::parse(&args(&["--push"])).is_err());
    }

    #[test]
    fn the_python_image_is_named_after_the_other() {
        let (base, python) = tags(&Args::default());
        assert_eq!(base[1], "infera:latest");
        assert_eq!(python[1], "infera-python:latest");
        let given = Args {
            tag: Some("registry:5000/team/infera:test".into()),
            ..Args::default()
        };
        assert_eq!(tags(&given).1, ["registry:5000/team/infera-python:test"]);
    }
}
