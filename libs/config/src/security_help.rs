//! The security variables each server's `--help` lists. They are read from the environment
//! only (a secret on a command line shows in `ps`), so they are not clap arguments with `env =`;
//! this section names them instead, from the same constants the loaders read.

use crate::auth::{ENV_ADMIN_TOKEN, ENV_ADMIN_TOKEN_FILE, ENV_AUTH_TOKEN, ENV_AUTH_TOKEN_FILE};
use crate::etcd::{ENV_ETCD_CACERT, ENV_ETCD_CERT, ENV_ETCD_KEY, ENV_ETCD_PASSWORD, ENV_ETCD_USER};
use crate::tls::{
    ENV_ADMIN_IDENTITIES, ENV_ADMIN_TLS, ENV_MOUNT_IDENTITIES, ENV_TLS_CACERT, ENV_TLS_CERT,
    ENV_TLS_KEY, ENV_TLS_SERVER_NAME,
};

/// The variables `lunakv-master` reads, each with what it does there.
pub fn master_vars() -> Vec<(String, &'static str)> {
    vec![
        (
            pair(ENV_AUTH_TOKEN, ENV_AUTH_TOKEN_FILE),
            "the pool token every caller must present (or the file holding it)",
        ),
        (
            pair(ENV_ADMIN_TOKEN, ENV_ADMIN_TOKEN_FILE),
            "the admin token: what can wipe the pool (RemoveAll) and the admin port's listings",
        ),
        (
            pair(ENV_TLS_CERT, ENV_TLS_KEY),
            "the RPC port's certificate and key (PEM): TLS on",
        ),
        (
            ENV_TLS_CACERT.to_string(),
            "the CA client certificates must chain to: mTLS",
        ),
        (
            ENV_TLS_SERVER_NAME.to_string(),
            "the name a standby expects in the leader's certificate",
        ),
        (
            ENV_ADMIN_IDENTITIES.to_string(),
            "client identities (CN or first SAN) that are admins",
        ),
        (
            ENV_MOUNT_IDENTITIES.to_string(),
            "client identities that may mount segments",
        ),
        (
            ENV_ADMIN_TLS.to_string(),
            "1: the admin port serves HTTPS with the same files",
        ),
        etcd(),
    ]
}

/// The variables `lunakv-store` reads, each with what it does there.
pub fn store_vars() -> Vec<(String, &'static str)> {
    vec![
        (
            pair(ENV_AUTH_TOKEN, ENV_AUTH_TOKEN_FILE),
            "the pool token sent to the master (or the file holding it)",
        ),
        (
            pair(ENV_TLS_CERT, ENV_TLS_KEY),
            "the client certificate and key shown to an mTLS master",
        ),
        (
            ENV_TLS_CACERT.to_string(),
            "the CA the master's certificate must chain to: TLS on",
        ),
        (
            ENV_TLS_SERVER_NAME.to_string(),
            "the name expected in the master's certificate (default: the host dialled)",
        ),
        etcd(),
    ]
}

/// `lunakv-master --help`'s closing section.
pub fn master_help() -> String {
    section(&master_vars())
}

/// `lunakv-store --help`'s closing section.
pub fn store_help() -> String {
    section(&store_vars())
}

fn pair(a: &str, b: &str) -> String {
    format!("{a}, {b}")
}

fn etcd() -> (String, &'static str) {
    (
        [
            ENV_ETCD_CACERT,
            ENV_ETCD_CERT,
            ENV_ETCD_KEY,
            ENV_ETCD_USER,
            ENV_ETCD_PASSWORD,
        ]
        .join(", "),
        "how a secured etcd is reached (an HA master's etcd)",
    )
}

fn section(vars: &[(String, &'static str)]) -> String {
    let mut s =
        String::from("Security (from the environment only, never flags; docs/SECURITY.md):\n");
    for (names, what) in vars {
        s.push_str(&format!("  {names}\n      {what}\n"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_section_names_the_variables_its_server_reads() {
        let (m, s) = (master_help(), store_help());
        for v in [
            ENV_AUTH_TOKEN,
            ENV_AUTH_TOKEN_FILE,
            ENV_TLS_CERT,
            ENV_TLS_KEY,
            ENV_TLS_CACERT,
            ENV_TLS_SERVER_NAME,
            ENV_ETCD_CACERT,
            ENV_ETCD_CERT,
            ENV_ETCD_KEY,
            ENV_ETCD_USER,
            ENV_ETCD_PASSWORD,
        ] {
            assert!(m.contains(v) && s.contains(v), "{v}");
        }
        for v in [
            ENV_ADMIN_TOKEN,
            ENV_ADMIN_TOKEN_FILE,
            ENV_ADMIN_IDENTITIES,
            ENV_MOUNT_IDENTITIES,
            ENV_ADMIN_TLS,
        ] {
            assert!(m.contains(v) && !s.contains(v), "{v}");
        }
    }
}
