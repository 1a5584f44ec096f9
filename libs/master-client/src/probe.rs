//! Probes only `lunakv doctor` uses: what a master's port requires of its callers' transport,
//! and whether it turns away a caller without a pool token.

use std::time::Duration;

use lunakv_proto::master as pb;
use lunakv_proto::master::master_client::MasterClient;
use tonic::transport::Channel;

use crate::ClientError;
use crate::connect::{channel, master_tls};

/// What a master's RPC port requires of its callers' transport (`lunakv doctor`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MasterTls {
    /// Plaintext gRPC.
    Off,
    /// TLS, no client certificate asked.
    On,
    /// TLS with a client certificate from its CA (mTLS).
    Mutual,
}

/// [`probe_master_tls`], async.
pub(crate) async fn master_tls_mode(
    addr: &str,
    timeout: Duration,
) -> Result<MasterTls, ClientError> {
    let rpc_err = |message: String| ClientError::Rpc {
        addr: addr.to_owned(),
        message,
    };
    let connect_timeout = Duration::from_secs(3).min(timeout);
    let endpoint = Channel::from_shared(format!("http://{addr}"))
        .map_err(|e| rpc_err(format!("not a valid address ({e})")))?
        .connect_timeout(connect_timeout)
        .timeout(timeout);
    let channel = channel(addr, endpoint, None, connect_timeout).await?;
    match MasterClient::new(channel)
        .get_cluster_status(pb::GetClusterStatusRequest {})
        .await
    {
        Ok(_) => Ok(MasterTls::Off),
        Err(s) => match s
            .metadata()
            .get(lunakv_tls::grpc::TLS_REQUIRED_HEADER)
            .and_then(|v| v.to_str().ok())
        {
            Some("mtls") => Ok(MasterTls::Mutual),
            Some(_) => Ok(MasterTls::On),
            // Refused for its token: a plaintext master.
            None if s.code() == tonic::Code::Unauthenticated => Ok(MasterTls::Off),
            None => Err(rpc_err(format!("status in plaintext: {}", s.message()))),
        },
    }
}

/// What the master at `addr` (`host:port`) requires of its callers' transport, from
/// synchronous code (`lunakv doctor`, which may not have connected: a master with mTLS refuses a
/// doctor without a certificate): one status call in plaintext, which a master with TLS refuses
/// with the `x-lunakv-tls-required` header. Not from inside a runtime.
pub fn probe_master_tls(addr: &str, timeout: Duration) -> Result<MasterTls, ClientError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| ClientError::Config(format!("cannot start a runtime: {e}")))?;
    rt.block_on(master_tls_mode(addr, timeout))
}

/// Whether the master at `addr` turns away a caller that presents no pool token: one status
/// call on a fresh connection without credentials (`lunakv doctor`'s security row). Over TLS
/// when this process has it (the certificate is not a token).
pub async fn refuses_anonymous(addr: &str, timeout: Duration) -> Result<bool, ClientError> {
    let rpc_err = |message: String| ClientError::Rpc {
        addr: addr.to_owned(),
        message,
    };
    let tls = master_tls()?;
    let connect_timeout = Duration::from_secs(3).min(timeout);
    let endpoint = Channel::from_shared(format!("http://{addr}"))
        .map_err(|e| rpc_err(format!("not a valid address ({e})")))?
        .connect_timeout(connect_timeout)
        .timeout(timeout);
    let channel = channel(addr, endpoint, tls.as_ref(), connect_timeout).await?;
    let mut anonymous = MasterClient::new(channel);
    match anonymous
        .get_cluster_status(pb::GetClusterStatusRequest {})
        .await
    {
        Ok(_) => Ok(false),
        Err(s) if s.code() == tonic::Code::Unauthenticated => Ok(true),
        Err(s) => Err(rpc_err(format!("status without a token: {}", s.message()))),
    }
}
