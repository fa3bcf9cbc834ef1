//! The L4 flags: `--long-backend lmcache|mooncake` (L4 instead of L3) or `--l4-backend` (L4
//! behind L3), and the store's settings.

use super::*;

/// Checks the L4 flags and resolves the store's settings (`env` looks variables up).
pub(super) fn l4_tier(
    args: &KvdArgs,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<L4TierConfig>, ConfigError> {
    let l3 = args.long_path.is_some() || args.long_paths.is_some();
    let alone = match args.long_backend {
        LongBackend::Tablespace => None,
        LongBackend::Lmcache => Some(L4Backend::Lmcache),
        LongBackend::Mooncake => Some(L4Backend::Mooncake),
    };
    let (store, placement) = match (alone, args.l4_backend) {
        (Some(store), Some(_)) => {
            return Err(ConfigError::new(
                "--l4-backend",
                format!(
                    "stacks an L4 behind L3 and cannot be combined with --long-backend {} (L4 \
                     instead of L3); choose one",
                    store.name()
                ),
            ));
        }
        (Some(store), None) if l3 => {
            let name = store.name();
            return Err(ConfigError::new(
                "--long-backend",
                format!(
                    "{name} replaces L3 and cannot be combined with --long-path/--long-paths; \
                     to keep L3 and add an L4 behind it use --l4-backend {name}"
                ),
            ));
        }
        (Some(store), None) => (store, "instead_of_l3"),
        (None, Some(store)) if l3 => (store, "behind_l3"),
        (None, Some(store)) => {
            return Err(ConfigError::new(
                "--l4-backend",
                format!(
                    "stacks an L4 behind the L3 tablespace and needs --long-path or \
                     --long-paths; for an L4 alone use --long-backend {}",
                    store.name()
                ),
            ));
        }
        (None, None) => {
            if args.l4_required {
                return Err(ConfigError::new(
                    "--l4-required",
                    "needs an L4: --long-backend lmcache|mooncake or --l4-backend lmcache|mooncake",
                ));
            }
            if args.lmcache_config.is_some() {
                tracing::warn!("--lmcache-config has no effect without an LMCache L4");
            }
            return Ok(None);
        }
    };
    let mut resolved = match store {
        L4Backend::Lmcache => {
            infera_kvd::l4::L4Config::from_lmcache(args.lmcache_config.as_deref(), env)
                .map_err(|reason| ConfigError::new("--lmcache-config", reason))?
        }
        L4Backend::Mooncake => {
            infera_kvd::l4::L4Config::from_mooncake(args.mooncake_config.as_deref(), env)
                .map_err(|reason| ConfigError::new("--mooncake-config", reason))?
        }
    };
    resolved.required = args.l4_required;
    Ok(Some(L4TierConfig {
        store: store.name().to_owned(),
        placement: placement.to_owned(),
        remote_url: resolved.remote_url.clone(),
        prefix: resolved.prefix.clone(),
        max_value_bytes: resolved.max_value_bytes,
        rpc_timeout: HumanDuration(resolved.rpc_timeout),
        connector_extra: resolved
            .connector_extra
            .iter()
            .map(|(k, _)| k.clone())
            .collect(),
        required: resolved.required,
        resolved: Some(resolved),
    }))
}
