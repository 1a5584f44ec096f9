//! Typed client errors. Callers branch on them in Rust; the Python surface maps them to
//! Mooncake's negative codes with [`ClientError::code`].
//!
//! Defined beside the master's client, not in `lunakv-client`, because the segment owner
//! (`lunakv-segment`) and the requester report the master's failures with the same type;
//! `lunakv-client` re-exports it.

use lunakv_proto::ErrorCode;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The pool has no room even after eviction (upstream -200; vLLM pauses puts on it).
    #[error("no space in the pool for '{key}' ({size} bytes): {message}")]
    NoAvailableHandle {
        key: String,
        size: u64,
        message: String,
    },
    #[error("object '{0}' not found")]
    ObjectNotFound(String),
    #[error("object '{0}' already exists: objects are immutable, remove it first")]
    ObjectAlreadyExists(String),
    #[error("object '{0}' is leased by a reader: retry after the lease expires or pass force")]
    ObjectHasLease(String),
    #[error("invalid key: {0}")]
    InvalidKey(#[from] lunakv_proto::KeyError),
    #[error("invalid argument: {0}")]
    InvalidParams(String),
    #[error("buffer of {have} bytes is too small for object '{key}' of {need} bytes")]
    BufferTooSmall { key: String, need: u64, have: u64 },
    #[error("transfer failed for '{key}': {source}")]
    Transfer {
        key: String,
        #[source]
        source: lunakv_transfer::TransferError,
    },
    #[error("master at {addr} unreachable or failed: {message}")]
    Rpc { addr: String, message: String },
    /// TLS with the master failed in a way waiting does not fix: a certificate refused (this
    /// client's, or the master's), or a master without TLS. The message names the certificate
    /// and the fix (`lunakv_tls::ClientTls::explain`).
    #[error("TLS with the master at {addr} failed: {message}")]
    Tls { addr: String, message: String },
    #[error("configuration: {0}")]
    Config(String),
    #[error("the client is closed")]
    Closed,
    /// A layer-wise session call for a key with no open session of that kind: never started,
    /// already ended or revoked, or dropped after sitting idle.
    #[error("no open {kind} session for '{key}'")]
    NoSession { kind: &'static str, key: String },
    /// The key's put session is being ended or revoked, or its end failed: only another end or
    /// a revoke may follow (upstream's sealed session).
    #[error("the put session for '{0}' is sealed: end or revoke it")]
    SessionSealed(String),
    #[error("a put session for '{0}' is already open: end or revoke it first")]
    SessionExists(String),
    #[error("range {offset}+{len} lies outside object '{key}' of {size} bytes")]
    RangeOutOfBounds {
        key: String,
        offset: u64,
        len: u64,
        size: u64,
    },
    /// Opening one more session would pass a bound of the client's session table
    /// (`lunakv_client::ClientOptions::session_max_keys` / `session_max_bytes`).
    #[error("cannot open a session for '{key}': {limit} (end or revoke open sessions first)")]
    SessionLimit { key: String, limit: String },
    /// Any other code the master returned for one item.
    #[error("master answered {code} for '{key}': {message}")]
    Master {
        key: String,
        code: ErrorCode,
        message: String,
    },
}

impl ClientError {
    /// Mooncake's error code for this error, as the Python API returns it.
    pub fn code(&self) -> ErrorCode {
        match self {
            ClientError::NoAvailableHandle { .. } => ErrorCode::NoAvailableHandle,
            ClientError::ObjectNotFound(_) => ErrorCode::ObjectNotFound,
            ClientError::ObjectAlreadyExists(_) => ErrorCode::ObjectAlreadyExists,
            ClientError::ObjectHasLease(_) => ErrorCode::ObjectHasLease,
            ClientError::InvalidKey(_) => ErrorCode::InvalidKey,
            ClientError::InvalidParams(_)
            | ClientError::Config(_)
            | ClientError::NoSession { .. }
            | ClientError::SessionSealed(_)
            | ClientError::SessionExists(_)
            | ClientError::RangeOutOfBounds { .. } => ErrorCode::InvalidParams,
            // As a full pool: the caller backs off and retries once sessions are closed.
            ClientError::SessionLimit { .. } => ErrorCode::NoAvailableHandle,
            ClientError::BufferTooSmall { .. } => ErrorCode::BufferOverflow,
            ClientError::Transfer { .. } => ErrorCode::TransferFail,
            ClientError::Rpc { .. } | ClientError::Tls { .. } | ClientError::Closed => {
                ErrorCode::RpcFail
            }
            ClientError::Master { code, .. } => *code,
        }
    }

    /// Builds the error for a per-item code from the master.
    pub fn from_item(key: &str, size: u64, code: i32, message: &str) -> ClientError {
        match ErrorCode::from_i32(code) {
            ErrorCode::NoAvailableHandle => ClientError::NoAvailableHandle {
                key: key.to_owned(),
                size,
                message: message.to_owned(),
            },
            ErrorCode::ObjectNotFound | ErrorCode::ReplicaIsNotReady => {
                ClientError::ObjectNotFound(key.to_owned())
            }
            ErrorCode::ObjectAlreadyExists => ClientError::ObjectAlreadyExists(key.to_owned()),
            ErrorCode::ObjectHasLease => ClientError::ObjectHasLease(key.to_owned()),
            code => ClientError::Master {
                key: key.to_owned(),
                code,
                message: message.to_owned(),
            },
        }
    }
}
