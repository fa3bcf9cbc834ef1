//! The Mooncake Store settings, as the Python kvd reads them: `--mooncake-config PATH` (the
//! flat YAML of [`super::super::config`]) with every key overridden by `INFERA_L4_<KEY>`.
//!
//! Keys: `master_address` (required, `host:port` of `mooncake_master`), `cluster_id`
//! (required; the prefix of every store name, a tenant boundary), `metadata_server` (the
//! transfer engine's metadata: `http://…/metadata`, `etcd://…` or `P2PHANDSHAKE`),
//! `protocol` (`tcp` or `rdma`), `device_name` (the RDMA device), `local_hostname` (this
//! client's `host:port` in the cluster; default `$POD_IP:$INFERA_L4_LOCAL_PORT` (14001) where
//! `POD_IP` is set, else the host name), `global_segment_size` (1 GiB: the memory this client
//! gives the store, which lives as long as kvd; 0 for a client that stores everything in other
//! clients' memory), `local_buffer_size` (256 MiB: its transfer buffer), `max_value_bytes`
//! (64 MiB), `rpc_timeout_s` (30), and kvd's own `python` (`python3`: the interpreter whose
//! `mooncake` package runs the sidecar, see [`super`]).
//!
//! `protocol: rdma` without a `device_name` present under `/sys/class/infiniband` refuses to
//! start: Mooncake would fall back to TCP silently. `INFERA_L4_ALLOW_TCP_FALLBACK=1` allows it.

use super::super::config::{L4Config, RemoteUrl, Settings};
use std::path::Path;

/// The variable that lets `protocol: rdma` start without a usable RDMA device.
pub const ALLOW_TCP_FALLBACK: &str = "INFERA_L4_ALLOW_TCP_FALLBACK";
/// Where RDMA devices are listed.
const INFINIBAND: &str = "/sys/class/infiniband";

/// What the sidecar's store client is set up with (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MooncakeConfig {
    pub master_address: String,
    pub metadata_server: String,
    pub protocol: String,
    pub device_name: String,
    pub local_hostname: String,
    pub global_segment_size: u64,
    pub local_buffer_size: u64,
    pub python: String,
}

impl L4Config {
    /// Reads the Mooncake settings from `path` (if any) and the environment (`env` looks
    /// variables up; `INFERA_L4_<KEY>` wins over the file).
    ///
    /// # Errors
    /// One line naming the key (or the file) at fault.
    pub fn from_mooncake(
        path: Option<&Path>,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Self, String> {
        Self::from_mooncake_with(path, env, Path::new(INFINIBAND))
    }

    fn from_mooncake_with(
        path: Option<&Path>,
        env: &dyn Fn(&str) -> Option<String>,
        infiniband: &Path,
    ) -> Result<Self, String> {
        let settings = Settings::read(path, env)?;
        let master = settings.get("master_address");
        let cluster = settings.prefix("cluster_id", None)?;
        let (Some(master_address), Some(prefix)) = (master.clone(), cluster.clone()) else {
            let missing: Vec<&str> = [
                ("master_address", master.is_none()),
                ("cluster_id", cluster.is_none()),
            ]
            .into_iter()
            .filter_map(|(k, absent)| absent.then_some(k))
            .collect();
            return Err(format!(
                "{} required: set {} in --mooncake-config or as {}",
                missing.join(" and "),
                if missing.len() > 1 { "them" } else { "it" },
                missing
                    .iter()
                    .map(|k| format!("INFERA_L4_{}", k.to_ascii_uppercase()))
                    .collect::<Vec<_>>()
                    .join(" / ")
            ));
        };
        if !master_address
            .rsplit_once(':')
            .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok())
        {
            return Err(format!(
                "master_address {master_address:?}: expected host:port"
            ));
        }
        let protocol = settings.get("protocol").unwrap_or_else(|| "tcp".to_owned());
        let device_name = settings.get("device_name").unwrap_or_default();
        match protocol.as_str() {
            "tcp" => {}
            "rdma" => check_rdma(&settings, &device_name, infiniband)?,
            other => return Err(format!("protocol {other:?}: tcp or rdma")),
        }
        let local_hostname = match settings.get("local_hostname") {
            Some(h) => h,
            None => match settings.env("POD_IP") {
                Some(ip) => {
                    let port = settings.env("INFERA_L4_LOCAL_PORT");
                    format!("{ip}:{}", port.as_deref().unwrap_or("14001"))
                }
                None => rustix::system::uname()
                    .nodename()
                    .to_string_lossy()
                    .into_owned(),
            },
        };
        let config = MooncakeConfig {
            master_address: master_address.clone(),
            metadata_server: settings.get("metadata_server").unwrap_or_default(),
            protocol,
            device_name,
            local_hostname,
            global_segment_size: settings.count("global_segment_size", 1 << 30, 0, 1 << 50)?,
            local_buffer_size: settings.count("local_buffer_size", 1 << 28, 1, 1 << 40)?,
            python: settings
                .get("python")
                .unwrap_or_else(|| "python3".to_owned()),
        };
        Ok(Self {
            remote_url: format!("mooncake://{master_address}"),
            remote: RemoteUrl::Mooncake(Box::new(config)),
            prefix,
            max_value_bytes: settings.max_value_bytes()?,
            rpc_timeout: settings.rpc_timeout()?,
            connector_extra: settings.extra,
            required: false,
        })
    }
}

/// Refuses `protocol: rdma` that Mooncake would silently run over TCP.
fn check_rdma(settings: &Settings<'_>, device: &str, infiniband: &Path) -> Result<(), String> {
    let allowed = settings
        .env(ALLOW_TCP_FALLBACK)
        .is_some_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes"));
    if allowed {
        tracing::warn!(
            "protocol rdma with {ALLOW_TCP_FALLBACK} set: the RDMA check is skipped, and \
             Mooncake may fall back to TCP silently"
        );
        return Ok(());
    }
    if device.is_empty() {
        return Err(format!(
            "protocol rdma needs device_name (e.g. mlx5_0); without it Mooncake silently uses \
             TCP. Set device_name, or {ALLOW_TCP_FALLBACK}=1 to allow TCP"
        ));
    }
    let mut present: Vec<String> = std::fs::read_dir(infiniband)
        .map(|dir| {
            dir.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    if present.iter().any(|d| d == device) {
        return Ok(());
    }
    present.sort();
    Err(format!(
        "protocol rdma: device_name {device:?} is not in {} (present: {}); refusing to start \
         rather than fall back to TCP silently. Fix the device, or set {ALLOW_TCP_FALLBACK}=1",
        infiniband.display(),
        if present.is_empty() {
            "none".to_owned()
        } else {
            present.join(", ")
        }
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    }

    fn mooncake(config: &L4Config) -> &MooncakeConfig {
        match &config.remote {
            RemoteUrl::Mooncake(m) => m,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_python_kvd_keys_and_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mooncake.yaml");
        std::fs::write(
            &path,
            "master_address: \"${MASTER}:50051\"\ncluster_id: prod-a\nprotocol: tcp\n\
             metadata_server: http://10.0.0.1:8080/metadata\nglobal_segment_size: 2147483648\n",
        )
        .unwrap();
        let vars = env(&[("MASTER", "10.0.0.1"), ("POD_IP", "10.1.2.3")]);
        let config = L4Config::from_mooncake(Some(&path), &vars).unwrap();
        assert_eq!(config.prefix, "prod-a");
        assert_eq!(config.remote_url, "mooncake://10.0.0.1:50051");
        assert_eq!(config.max_value_bytes, 64 << 20);
        let m = mooncake(&config);
        assert_eq!(m.master_address, "10.0.0.1:50051");
        assert_eq!(m.metadata_server, "http://10.0.0.1:8080/metadata");
        assert_eq!(
            m.local_hostname, "10.1.2.3:14001",
            "POD_IP with the default port"
        );
        assert_eq!(
            (m.global_segment_size, m.local_buffer_size),
            (2 << 30, 1 << 28)
        );
        assert_eq!(m.python, "python3");

        // Every key is overridden by its variable, the file may be left out.
        let config = L4Config::from_mooncake(
            None,
            &env(&[
                ("INFERA_L4_MASTER_ADDRESS", "127.0.0.1:1"),
                ("INFERA_L4_CLUSTER_ID", "b"),
                ("INFERA_L4_LOCAL_HOSTNAME", "127.0.0.1:7"),
                ("INFERA_L4_PYTHON", "/opt/py/bin/python"),
            ]),
        )
        .unwrap();
        let m = mooncake(&config);
        assert_eq!(
            (m.local_hostname.as_str(), m.python.as_str()),
            ("127.0.0.1:7", "/opt/py/bin/python")
        );
        assert_eq!(config.prefix, "b");
    }

    #[test]
    fn missing_keys_and_bad_values_are_one_line_errors() {
        let e = L4Config::from_mooncake(None, &env(&[])).unwrap_err();
        assert!(
            e.starts_with("master_address and cluster_id required"),
            "{e}"
        );
        assert!(
            e.contains("INFERA_L4_MASTER_ADDRESS / INFERA_L4_CLUSTER_ID"),
            "{e}"
        );
        let base = [
            ("INFERA_L4_MASTER_ADDRESS", "h:1"),
            ("INFERA_L4_CLUSTER_ID", "c"),
        ];
        for (key, value, says) in [
            ("INFERA_L4_MASTER_ADDRESS", "nohost", "expected host:port"),
            ("INFERA_L4_PROTOCOL", "udp", "tcp or rdma"),
            ("INFERA_L4_CLUSTER_ID", "a b", "cluster_id"),
            ("INFERA_L4_GLOBAL_SEGMENT_SIZE", "1G", "a whole number"),
        ] {
            let mut vars = base.to_vec();
            vars.retain(|(k, _)| *k != key);
            vars.push((key, value));
            let e = L4Config::from_mooncake(None, &env(&vars)).unwrap_err();
            assert!(e.contains(says) && !e.contains('\n'), "{key}={value}: {e}");
        }
    }

    #[test]
    fn rdma_without_its_device_refuses_to_start_unless_tcp_is_allowed() {
        let ib = tempfile::tempdir().unwrap();
        std::fs::create_dir(ib.path().join("mlx5_0")).unwrap();
        let vars = |extra: &[(&'static str, &'static str)]| {
            let mut v = vec![
                ("INFERA_L4_MASTER_ADDRESS", "h:1"),
                ("INFERA_L4_CLUSTER_ID", "c"),
                ("INFERA_L4_PROTOCOL", "rdma"),
            ];
            v.extend_from_slice(extra);
            env(&v)
        };
        let open = |extra| L4Config::from_mooncake_with(None, &vars(extra), ib.path());
        assert!(open(&[]).unwrap_err().contains("needs device_name"));
        let e = open(&[("INFERA_L4_DEVICE_NAME", "mlx5_1")]).unwrap_err();
        assert!(
            e.contains("\"mlx5_1\" is not in") && e.contains("present: mlx5_0"),
            "{e}"
        );
        assert!(open(&[("INFERA_L4_DEVICE_NAME", "mlx5_0")]).is_ok());
        assert!(
            open(&[
                ("INFERA_L4_DEVICE_NAME", "mlx5_1"),
                (ALLOW_TCP_FALLBACK, "1")
            ])
            .is_ok()
        );
    }
}
