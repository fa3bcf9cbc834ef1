//! `replay-sweep/` and `replay-sweep/merge/`: the Indexed Job that runs a sweep's slices and
//! the Job that merges them, checked as the cluster would run them. Each Pod's arguments are run
//! here, with `$(SLICE)` set to its completion index and each claim mount mapped to a folder, as
//! local processes: the slices together hold the whole sweep once, and the merge Job's command
//! joins them.

use super::*;
use k8s_openapi::api::core::v1::VolumeMount;

fn job_container(job: &Job) -> &Container {
    pod_container(&job.spec.as_ref().expect("Job spec").template)
}

/// The container's arguments as its Pod `slice` would run them here: `$(SLICE)` expanded, each
/// mount of the claim at `root/<subPath>`.
fn local_args(container: &Container, slice: i32, root: &Path) -> Vec<String> {
    let mounts: &[VolumeMount] = container.volume_mounts.as_deref().unwrap_or_default();
    args(container)
        .iter()
        .map(|a| {
            let mut a = a.replace("$(SLICE)", &slice.to_string());
            for m in mounts {
                let sub = m.sub_path.as_deref().expect("a subPath of the claim");
                if let Some(rest) = a.strip_prefix(&m.mount_path) {
                    a = format!("{}{rest}", root.join(sub).display());
                }
            }
            a
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_replay_sweep_job_runs_every_slice_once_and_merges_them() {
    let mut all = Vec::new();
    for dir in ["replay-sweep", "replay-sweep/merge"] {
        all.extend(render(&kubernetes_dir().join(dir)));
    }
    let printed = kubectl_dry_run(&all).await;
    assert_eq!(printed.len(), all.len());
    let fleet = classify(&printed);
    assert!(fleet.claims.contains_key("infera-replay"));
    let sweep = &fleet.jobs["infera-replay-sweep"];
    let spec = sweep.spec.as_ref().expect("spec");
    assert_eq!(spec.completion_mode.as_deref(), Some("Indexed"));
    let n = spec.completions.expect("completions");
    assert_eq!(spec.parallelism, Some(n), "every slice at once");
    let c = job_container(sweep);
    assert_eq!(c.command.as_deref(), Some(&["infera".to_owned()][..]));
    assert_eq!(
        flag(&args(c), "--shard"),
        Some(format!("$(SLICE)/{n}").as_str())
    );
    let slice_env = c
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "SLICE")
        .and_then(|e| e.value_from.as_ref()?.field_ref.as_ref())
        .expect("SLICE from the downward API");
    assert_eq!(
        slice_env.field_path,
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    );

    // The trace on the claim: the bundled Mooncake trace, cut short to keep the test quick.
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(root.path().join("trace")).unwrap();
    let fixture = kubernetes_dir().join("../../../fixtures/traces/mooncake_trace_1000.parquet");
    std::fs::copy(&fixture, root.path().join("trace/trace.parquet")).unwrap();
    for sub in ["slices", "results"] {
        // The kubelet creates a missing subPath folder.
        std::fs::create_dir_all(root.path().join(sub)).unwrap();
    }
    let run = |args: &[String]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_infera"))
            .args(args)
            .env_remove("RUST_LOG")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("infera")
    };
    let slices: Vec<_> = (0..n)
        .map(|i| {
            let mut a = local_args(c, i, root.path());
            a.extend(["--limit", "100"].map(str::to_owned));
            run(&a)
        })
        .collect();
    for (i, child) in slices.into_iter().enumerate() {
        let out = child.wait_with_output().expect("a slice");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "slice {i}: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains(&format!("slice {i}/{n}: ")), "{stdout}");
    }
    let merge = job_container(&fleet.jobs["infera-replay-merge"]);
    let out = run(&local_args(merge, 0, root.path()))
        .wait_with_output()
        .expect("the merge");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.starts_with(&format!(
            "merged {n} slice file(s) of a sweep of 96 configuration(s)"
        )),
        "the default --tune grid, whole: {stdout}"
    );
    assert!(stdout.contains("Pareto front ("), "{stdout}");
    assert!(root.path().join("results/sweep.summary.parquet").is_file());
}
