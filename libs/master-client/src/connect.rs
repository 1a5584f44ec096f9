//! The gRPC connection to one master: its channel (plaintext or TLS), and what every call on it
//! carries (trace context, pool token). Everything in this project that dials a master makes
//! its channel here, so TLS and the token are applied the same way everywhere.

use std::time::Duration;

use lunakv_proto::master::master_client::MasterClient;
use lunakv_telemetry::propagate::GrpcInject;
use tonic::codegen::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use crate::ClientError;
use crate::preface::speaks_grpc;

/// A master client whose calls carry the caller's trace context (docs/TRACING.md).
pub type Rpc = MasterClient<InterceptedService<Channel, MasterInject>>;

/// What every call to the master carries: the trace context, and the pool's token when this
/// process has one (`LUNAKV_AUTH_TOKEN` / `LUNAKV_ADMIN_TOKEN`, docs/SECURITY.md).
#[derive(Clone)]
pub struct MasterInject {
    authorization: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
}

impl tonic::service::Interceptor for MasterInject {
    fn call(&mut self, req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let mut req = GrpcInject.call(req)?;
        if let Some(a) = &self.authorization {
            req.metadata_mut().insert("authorization", a.clone());
        }
        Ok(req)
    }
}

/// The master client over `channel`. The token is read from the environment at each
/// (re)connect, so a rotated token file takes effect on the next connection.
pub(crate) fn master_client(channel: Channel) -> Result<Rpc, ClientError> {
    // A token is printable ASCII (checked when loaded), so the conversion cannot fail.
    let authorization =
        presented_authorization()?.and_then(|a| tonic::metadata::MetadataValue::try_from(a).ok());
    Ok(
        MasterClient::with_interceptor(channel, MasterInject { authorization })
            .max_decoding_message_size(256 << 20),
    )
}

/// The `authorization` value this process presents to the master (`Bearer <token>`), read
/// from the environment now; None without a token.
pub(crate) fn presented_authorization() -> Result<Option<String>, ClientError> {
    let tokens = lunakv_config::auth::PoolTokens::from_env(&lunakv_config::process_env)
        .map_err(|e| ClientError::Config(e.to_string()))?;
    Ok(tokens.presented().map(|t| bearer(t.as_str())))
}

/// The `authorization` value that presents `token` to a master (`Bearer <token>`): this
/// process's own token (from the environment), or the one a master's standby was given.
pub fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

/// TLS towards the master, from this process's `LUNAKV_TLS_*` (or the `tls_*` keys of the
/// engine's mooncake_config.json); `None`: plaintext. Read at each connect, as the token is.
pub fn master_tls() -> Result<Option<lunakv_tls::ClientTls>, ClientError> {
    let paths = lunakv_config::tls::TlsPaths::client_from_env(&lunakv_config::process_env)
        .map_err(|e| ClientError::Config(e.to_string()))?;
    lunakv_tls::ClientTls::from_paths(&paths).map_err(|e| ClientError::Config(e.to_string()))
}

/// A channel to `addr` (`host:port`), over TLS when `tls` is set; connected now, or lazily.
pub(crate) async fn channel(
    addr: &str,
    endpoint: Endpoint,
    tls: Option<&lunakv_tls::ClientTls>,
    connect_timeout: Duration,
) -> Result<Channel, ClientError> {
    connect_endpoint(endpoint, tls, connect_timeout)
        .await
        .map_err(|e| match lunakv_tls::TlsFailure::in_chain(&e) {
            Some(f) => ClientError::Tls {
                addr: addr.to_owned(),
                message: f.to_string(),
            },
            None => ClientError::Rpc {
                addr: addr.to_owned(),
                message: format!(
                    "cannot connect ({}): is lunakv-master running there?",
                    source_chain(&e)
                ),
            },
        })
}

/// Connects `endpoint`, over TLS when `tls` is set, with tonic's own error: for a caller that
/// reports it its own way (the master's standby following its leader).
pub async fn connect_endpoint(
    endpoint: Endpoint,
    tls: Option<&lunakv_tls::ClientTls>,
    connect_timeout: Duration,
) -> Result<Channel, tonic::transport::Error> {
    match tls {
        Some(t) => {
            endpoint
                .connect_with_connector(t.connector(connect_timeout))
                .await
        }
        None => endpoint.connect().await,
    }
}

/// [`channel`], connected at the first call (HA leaders).
pub(crate) fn lazy_channel(
    endpoint: Endpoint,
    tls: Option<&lunakv_tls::ClientTls>,
    connect_timeout: Duration,
) -> Channel {
    match tls {
        Some(t) => endpoint.connect_with_connector_lazy(t.connector(connect_timeout)),
        None => endpoint.connect_lazy(),
    }
}

pub(crate) async fn connect_master(
    addr: &str,
    timeout: Duration,
    tls: Option<&lunakv_tls::ClientTls>,
) -> Result<Rpc, ClientError> {
    let uri = if addr.contains("://") {
        addr.to_owned()
    } else {
        format!("http://{addr}")
    };
    let endpoint = Channel::from_shared(uri).map_err(|e| ClientError::Config(format!(
        "master_server_address '{addr}' is not a valid address ({e}): use host:port, e.g. \"127.0.0.1:50051\""
    )))?;
    speaks_grpc(addr, timeout, tls).await?;
    let connect_timeout = Duration::from_secs(3).min(timeout);
    let endpoint = endpoint
        .tcp_nodelay(true)
        .connect_timeout(connect_timeout)
        .timeout(timeout);
    master_client(channel(addr, endpoint, tls, connect_timeout).await?)
}

pub fn rpc_error(addr: &str, status: &tonic::Status) -> ClientError {
    ClientError::Rpc {
        addr: addr.to_owned(),
        message: format!("{:?}: {}", status.code(), status.message()),
    }
}

fn source_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}
