//! The images' root file systems, assembled from the binary and Debian's installed packages.

use super::{PackageBuild, UID, output};
use anyhow::{Context, bail};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Debian's packages of the Python image's interpreter and standard library.
const PYTHON_PACKAGES: [&str; 3] = [
    "python3.11-minimal",
    "libpython3.11-minimal",
    "libpython3.11-stdlib",
];
/// Where the Python image's packages go: on Debian's `sys.path`.
const DIST_PACKAGES: &str = "usr/lib/python3/dist-packages";

/// The `infera` image's files under `rootfs`; returns the Debian packages they came from.
pub fn base(rootfs: &Path, binary: &Path) -> anyhow::Result<Vec<String>> {
    install(binary, &rootfs.join("usr/local/bin/infera"))?;
    let mut packages = libraries_of(rootfs, &[binary.to_path_buf()])?;
    install(
        Path::new("/etc/ssl/certs/ca-certificates.crt"),
        &rootfs.join("etc/ssl/certs/ca-certificates.crt"),
    )
    .context("the CA certificates (Debian's ca-certificates package)")?;
    packages.extend(package_of(Path::new("/etc/ssl/certs/ca-certificates.crt")));
    write(
        &rootfs.join("etc/passwd"),
        &format!(
            "root:x:0:0:root:/root:/sbin/nologin\n\
             infera:x:{UID}:{UID}:infera:/home/infera:/sbin/nologin\n"
        ),
    )?;
    write(
        &rootfs.join("etc/group"),
        &format!("root:x:0:\ninfera:x:{UID}:\n"),
    )?;
    write(&rootfs.join("etc/nsswitch.conf"), "hosts: files dns\n")?;
    for dir in ["tmp", "home/infera"] {
        std::fs::create_dir_all(rootfs.join(dir))?;
    }
    Ok(packages)
}

/// Adds Debian's Python and the `amd-infera` package (built around `binary`) to `rootfs`;
/// returns the Debian packages added.
pub fn python(
    root: &Path,
    rootfs: &Path,
    binary: &Path,
    build: Option<&PackageBuild>,
) -> anyhow::Result<Vec<String>> {
    let mut packages = Vec::new();
    for package in PYTHON_PACKAGES {
        let files = output(Command::new("dpkg-query").args(["--listfiles", package]))
            .with_context(|| format!("Debian's {package} (apt-get install python3.11)"))?;
        for file in files.lines().map(Path::new).filter(|f| f.is_absolute()) {
            let inside = rootfs.join(file.strip_prefix("/").unwrap_or(file));
            let meta = std::fs::symlink_metadata(file)?;
            if meta.file_type().is_symlink() {
                if let Some(dir) = inside.parent() {
                    std::fs::create_dir_all(dir)?;
                }
                let _ = std::fs::remove_file(&inside);
                std::os::unix::fs::symlink(std::fs::read_link(file)?, &inside)?;
            } else if meta.is_file() {
                install(file, &inside)?;
            }
        }
        packages.extend(package_of(Path::new(&format!("/usr/share/doc/{package}"))));
    }
    for name in ["python3", "python"] {
        std::os::unix::fs::symlink("python3.11", rootfs.join("usr/bin").join(name))?;
    }
    let mut linked = vec![PathBuf::from("/usr/bin/python3.11")];
    for entry in std::fs::read_dir("/usr/lib/python3.11/lib-dynload")? {
        linked.push(entry?.path());
    }
    packages.extend(libraries_of(rootfs, &linked)?);

    let target = rootfs.join(DIST_PACKAGES);
    let mut pip = match build {
        Some(build) => {
            let bin = build
                .python
                .parent()
                .map(Path::to_path_buf)
                .unwrap_or_default();
            let path = std::env::join_paths(std::iter::once(bin).chain(std::env::split_paths(
                &std::env::var_os("PATH").unwrap_or_default(),
            )))?;
            let mut pip = Command::new(&build.python);
            pip.args(["-m", "pip", "install", "--no-build-isolation"])
                .env("PATH", path)
                .env("MATURIN_PEP517_ARGS", &build.maturin_args);
            pip
        }
        None => {
            let mut pip = Command::new("python3");
            pip.args(["-m", "pip", "install"]);
            pip
        }
    };
    pip.current_dir(root)
        .args([
            "--no-deps",
            "--quiet",
            "--disable-pip-version-check",
            "--target",
        ])
        .arg(&target)
        .arg("./kvd/python")
        .env("INFERA_WHEEL_BINARY", binary)
        .env("CARGO_TARGET_DIR", root.join("target"));
    crate::run_step(
        "image: pip install ./kvd/python into the Python image",
        &mut pip,
    )?;
    // The console script pip wrote names this machine's interpreter; the image's is python3.
    let _ = std::fs::remove_dir_all(target.join("bin"));
    // One copy of the binary: `infera` on PATH is the package's.
    let on_path = rootfs.join("usr/local/bin/infera");
    std::fs::remove_file(&on_path)?;
    std::os::unix::fs::symlink(
        Path::new("/")
            .join(DIST_PACKAGES)
            .join("infera/_bin/infera"),
        &on_path,
    )?;
    Ok(packages)
}

/// Copies a root file system (`cp -a`: links and modes kept).
pub fn copy(from: &Path, to: &Path) -> anyhow::Result<()> {
    if let Some(dir) = to.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut cp = Command::new("cp");
    cp.arg("-a").arg(from).arg(to);
    crate::run_step("image: copy the root file system", &mut cp)
}

/// Installs the libraries `binaries` link under `rootfs`; returns their Debian packages.
fn libraries_of(rootfs: &Path, binaries: &[PathBuf]) -> anyhow::Result<Vec<String>> {
    let mut packages = Vec::new();
    for binary in binaries {
        for library in linked_libraries(binary)? {
            let inside = rootfs.join(library.strip_prefix("/").unwrap_or(&library));
            if !inside.exists() {
                install(&std::fs::canonicalize(&library)?, &inside)?;
                packages.extend(package_of(&library));
            }
        }
    }
    packages.sort();
    packages.dedup();
    Ok(packages)
}

/// The libraries `binary` links, as `ldd` resolves them (the loader included).
fn linked_libraries(binary: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let listing = output(Command::new("ldd").arg(binary))?;
    let mut libraries = Vec::new();
    for line in listing.lines() {
        let path = match line.split_once("=>") {
            Some((_, after)) => after.split_whitespace().next(),
            None => line
                .split_whitespace()
                .next()
                .filter(|p| p.starts_with('/')),
        };
        match path {
            Some(path) if path.starts_with('/') => libraries.push(PathBuf::from(path)),
            Some("not") => bail!("ldd: {binary:?} links a library that is not found: {line}"),
            _ => {}
        }
    }
    Ok(libraries)
}

/// The Debian package (`name=version`) that installed `file`, if dpkg knows it (under `/usr`
/// too: on a merged-`/usr` system `ldd` may name a library by its `/lib` link).
fn package_of(file: &Path) -> Option<String> {
    let under_usr = Path::new("/usr").join(file.strip_prefix("/").unwrap_or(file));
    let owner = [file, under_usr.as_path()]
        .into_iter()
        .find_map(|path| output(Command::new("dpkg-query").arg("--search").arg(path)).ok())?;
    let name = owner.split(':').next()?.trim().to_owned();
    let version =
        output(Command::new("dpkg-query").args(["--show", "--showformat", "${Version}", &name]))
            .ok()?;
    Some(format!("{name}={}", version.trim()))
}

fn install(from: &Path, to: &Path) -> anyhow::Result<()> {
    if let Some(dir) = to.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::copy(from, to)
        .with_context(|| format!("cannot copy {} to {}", from.display(), to.display()))?;
    Ok(())
}

fn write(path: &Path, text: &str) -> anyhow::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
}
