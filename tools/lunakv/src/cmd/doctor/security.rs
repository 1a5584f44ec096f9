//! What protects the pool, as far as this client can tell: etcd's TLS and identity, a master
//! that refuses anonymous callers, mTLS.

use super::check::Check;

/// A probe of the master that got no answer, with what stopped it (the probe's own error,
/// whichever call it came from, as the security row quotes it).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(super) struct Unanswered(pub(super) String);

/// What protects the pool (docs/SECURITY.md), as far as this client can tell:
/// - an `etcd://` master: etcd must be reached over TLS and know who lunakv is (a client
///   certificate or a user), or anyone who reaches etcd can redirect every client;
/// - the master itself: `refuses_anonymous` is one status call without credentials
///   ([`lunakv_client::StoreClient::master_refuses_anonymous`]). A master that turns it away
///   requires the pool token of every caller, and its owners require its capabilities on their
///   transfer ports; one that answers is open to whoever reaches it, unless that is only
///   loopback. A master doctor did not reach is vouched for by nothing (the row is `skip`, or
///   `warn` for what else it found), whatever address it would listen on.
/// - mTLS: `tls` is what the master's RPC port requires ([`lunakv_master_client::probe_master_tls`]).
///   With mTLS every caller shows a certificate from the pool's CA, whose identity owns its
///   mounts and puts; this doctor's own `LUNAKV_TLS_*` must agree with the master's, and its
///   certificate must be valid.
pub(super) fn check_security(
    master: &str,
    env: &dyn Fn(&str) -> Option<String>,
    refuses_anonymous: Option<&Result<bool, Unanswered>>,
    tls: Option<&Result<lunakv_master_client::MasterTls, Unanswered>>,
) -> Check {
    use lunakv_master_client::MasterTls;
    const NAME: &str = "security";
    const DOC: &str = "docs/SECURITY.md";
    let tokens = match lunakv_config::auth::PoolTokens::from_env(env) {
        Ok(t) => t,
        Err(e) => return Check::fail(NAME, e.to_string(), "fix the variable it names"),
    };
    let mine = match lunakv_config::tls::TlsPaths::client_from_env(env)
        .map_err(|e| e.to_string())
        .and_then(|p| lunakv_tls::ClientTls::from_paths(&p).map_err(|e| e.to_string()))
    {
        Ok(t) => t,
        Err(e) => return Check::fail(NAME, e, "fix the variable or file it names"),
    };
    let mut warns: Vec<(String, String)> = Vec::new();
    let mut passes: Vec<String> = Vec::new();
    let tls_fix = format!(
        "set LUNAKV_TLS_CERT, LUNAKV_TLS_KEY and LUNAKV_TLS_CACERT on the master, the stores, the \
         engines (or tls_cert, tls_key, tls_cacert in mooncake_config.json) and the CLI \
         (components/mtls does it in Kubernetes) ({DOC})"
    );
    let mtls = matches!(tls, Some(Ok(MasterTls::Mutual)));
    match tls {
        Some(Ok(MasterTls::Mutual)) => {
            let file = mine
                .as_ref()
                .and_then(|t| t.paths().cert.as_ref())
                .map(ToString::to_string);
            match (mine.as_ref().and_then(|t| t.certificate()), file) {
                (Some(c), Some(f)) if c.expired || c.not_yet_valid => warns.push((
                    format!(
                        "the master requires mTLS and this client's certificate {f} is not \
                         valid now ({c})"
                    ),
                    "renew it (cert-manager renews before expiry; the files are reread when \
                     they change)"
                        .into(),
                )),
                (Some(c), _) => passes.push(format!(
                    "mTLS: the master requires a client certificate from its CA of every \
                     caller, whose identity owns its mounts and puts; this client is {:?} ({c})",
                    c.identity.as_deref().unwrap_or("(no CN or SAN)")
                )),
                (None, _) => warns.push((
                    "the master requires mTLS (a client certificate from its CA) and this \
                     client presents none"
                        .into(),
                    tls_fix.clone(),
                )),
            }
        }
        Some(Ok(MasterTls::On)) => warns.push((
            "the master serves TLS but asks no client certificate: callers are not \
             identified, so any of them may act on the others' mounts and puts"
                .into(),
            format!(
                "set LUNAKV_TLS_CACERT on the master to the CA of the clients' certificates \
                 ({DOC})"
            ),
        )),
        Some(Ok(MasterTls::Off)) if mine.is_some() => warns.push((
            "this client has TLS settings (LUNAKV_TLS_*) but the master serves plaintext".into(),
            format!(
                "start the master with LUNAKV_TLS_CERT, LUNAKV_TLS_KEY and LUNAKV_TLS_CACERT, or \
                 unset them here ({DOC})"
            ),
        )),
        _ => {}
    }
    if master.trim().starts_with("etcd://") {
        let creds = match lunakv_config::EtcdCredentials::from_env(env) {
            Ok(c) => c,
            Err(e) => {
                return Check::fail(
                    NAME,
                    e.to_string(),
                    "fix the LUNAKV_ETCD_* variable it names",
                );
            }
        };
        match (&creds.ca, &creds.identity, &creds.user) {
            (None, _, _) => warns.push((
                "etcd is reached over plain http: whoever reaches etcd can rewrite master_view \
                 and send every client to a master of their own"
                    .into(),
                format!(
                    "serve etcd over TLS with --client-cert-auth and set LUNAKV_ETCD_CACERT, \
                     LUNAKV_ETCD_CERT, LUNAKV_ETCD_KEY (the ha overlay's components/etcd-tls \
                     does; {DOC})"
                ),
            )),
            (Some(_), None, None) => warns.push((
                "etcd is reached over TLS but lunakv presents no identity (no client \
                 certificate, no etcd user), so etcd cannot tell lunakv from anyone else"
                    .into(),
                format!(
                    "run etcd with --client-cert-auth and set LUNAKV_ETCD_CERT/KEY, or turn on \
                     etcd users and set LUNAKV_ETCD_USER ({DOC})"
                ),
            )),
            (Some((ca, _)), id, user) => passes.push(format!(
                "etcd over TLS (CA {}) as {}",
                ca.display(),
                match (id, user) {
                    (_, Some((u, _))) => format!("etcd user {u}"),
                    _ => "the client certificate's CN".to_string(),
                }
            )),
        }
    }
    let host = master
        .rsplit_once(':')
        .map_or(master, |(h, _)| h)
        .trim_matches(|c| c == '[' || c == ']');
    let loopback = host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    let token_fix = format!(
        "set LUNAKV_AUTH_TOKEN (or LUNAKV_AUTH_TOKEN_FILE) on the master, every store and every \
         engine (the overlays' optional Secret lunakv-auth), or turn on mTLS (LUNAKV_TLS_*, \
         components/mtls), and keep lunakv's ports closed to strangers with the NetworkPolicies \
         (components/network-policy) ({DOC})"
    );
    match refuses_anonymous {
        // Callers are authenticated by their certificates (said above); owners then require
        // capabilities too.
        _ if mtls => {}
        Some(Ok(true)) => passes.push(
            "the master refuses callers without the pool token, and its owners require its \
             capabilities on their transfer ports"
                .into(),
        ),
        Some(Ok(false)) if loopback => passes.push(format!(
            "the master listens on loopback ({master}) and asks no token"
        )),
        Some(Ok(false)) => warns.push((
            format!(
                "the master at {master} answers callers that present no pool token{}: anyone \
                 who reaches it and the stores can read, overwrite and remove objects",
                if tokens.presented().is_some() {
                    " although this doctor has one (LUNAKV_AUTH_TOKEN): the master was started \
                     without it"
                } else {
                    ""
                }
            ),
            token_fix,
        )),
        Some(Err(e)) => warns.push((
            format!("cannot tell whether the master requires a pool token: {e}"),
            token_fix,
        )),
        // Not reached: where it listens says nothing about what it asks, and a master that is
        // not running guards nothing; the row must not pass on it.
        None => {}
    }
    let unchecked = (refuses_anonymous.is_none() && !mtls).then(|| match tls {
        // The plaintext probe got an answer, so what the port serves is known (said above).
        Some(Ok(_)) => format!(
            "this doctor could not open a session with the master at {master}, so whether it \
             requires a pool token could not be checked"
        ),
        _ => format!(
            "the master at {master} was not reached, so whether it requires a pool token or \
             mTLS could not be checked"
        ),
    });
    if !warns.is_empty() {
        let (mut details, fixes): (Vec<String>, Vec<String>) = warns.into_iter().unzip();
        details.extend(unchecked);
        Check::warn(NAME, details.join("; "), fixes.join("; "))
    } else if let Some(u) = unchecked {
        passes.push(u);
        Check::skip(NAME, passes.join("; "))
    } else {
        Check::pass(NAME, passes.join("; "))
    }
}
