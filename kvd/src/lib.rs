//! `infera kvd`: the KV-cache daemon — the Unix-socket protocol, the L2 host-RAM store and shared
//! arena, the L3 tablespace, L4 through the backend trait, and its client library. It does not
//! depend on the router.
