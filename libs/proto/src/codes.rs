//! Mooncake's numeric error codes. Per-item results in the master API carry these values so the
//! Python surface can hand them to vLLM unchanged (vLLM pauses puts on -200, for example).

/// A Mooncake `ErrorCode` value. Only the codes lunakv produces are listed; the numbers are
/// upstream's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum ErrorCode {
    Ok = 0,
    InternalError = -1,
    BufferOverflow = -10,
    SegmentNotFound = -101,
    SegmentAlreadyExists = -102,
    ClientNotFound = -103,
    NoAvailableHandle = -200,
    InvalidKey = -400,
    InvalidParams = -600,
    InvalidWrite = -700,
    InvalidRead = -701,
    ReplicaIsNotReady = -703,
    ObjectNotFound = -704,
    ObjectAlreadyExists = -705,
    ObjectHasLease = -706,
    TransferFail = -800,
    RpcFail = -900,
    UnavailableInCurrentStatus = -1010,
    /// No drain job of that id (upstream's JOB_NOT_FOUND).
    JobNotFound = -1402,
    /// The tenant's puts would pass its quota and none of its own objects can be evicted.
    TenantQuotaExceeded = -1700,
    /// Multi-tenant mode and the tenant policy does not name the tenant.
    TenantNotRegistered = -1701,
    /// A tenant's policy cannot go while it still holds objects.
    TenantNotEmpty = -1702,
}

impl ErrorCode {
    const ALL: [ErrorCode; 22] = [
        ErrorCode::Ok,
        ErrorCode::InternalError,
        ErrorCode::BufferOverflow,
        ErrorCode::SegmentNotFound,
        ErrorCode::SegmentAlreadyExists,
        ErrorCode::ClientNotFound,
        ErrorCode::NoAvailableHandle,
        ErrorCode::InvalidKey,
        ErrorCode::InvalidParams,
        ErrorCode::InvalidWrite,
        ErrorCode::InvalidRead,
        ErrorCode::ReplicaIsNotReady,
        ErrorCode::ObjectNotFound,
        ErrorCode::ObjectAlreadyExists,
        ErrorCode::ObjectHasLease,
        ErrorCode::TransferFail,
        ErrorCode::RpcFail,
        ErrorCode::UnavailableInCurrentStatus,
        ErrorCode::JobNotFound,
        ErrorCode::TenantQuotaExceeded,
        ErrorCode::TenantNotRegistered,
        ErrorCode::TenantNotEmpty,
    ];

    pub fn as_i32(self) -> i32 {
        self as i32
    }

    /// Maps a wire value back; unknown values become `InternalError` rather than failing, so an
    /// older client still reports a newer master's error as an error.
    pub fn from_i32(v: i32) -> ErrorCode {
        Self::ALL
            .into_iter()
            .find(|c| *c as i32 == v)
            .unwrap_or(ErrorCode::InternalError)
    }

    /// Upstream's spelling, as it appears in Mooncake logs and docs.
    pub fn name(self) -> &'static str {
        match self {
            ErrorCode::Ok => "OK",
            ErrorCode::InternalError => "INTERNAL_ERROR",
            ErrorCode::BufferOverflow => "BUFFER_OVERFLOW",
            ErrorCode::SegmentNotFound => "SEGMENT_NOT_FOUND",
            ErrorCode::SegmentAlreadyExists => "SEGMENT_ALREADY_EXISTS",
            ErrorCode::ClientNotFound => "CLIENT_NOT_FOUND",
            ErrorCode::NoAvailableHandle => "NO_AVAILABLE_HANDLE",
            ErrorCode::InvalidKey => "INVALID_KEY",
            ErrorCode::InvalidParams => "INVALID_PARAMS",
            ErrorCode::InvalidWrite => "INVALID_WRITE",
            ErrorCode::InvalidRead => "INVALID_READ",
            ErrorCode::ReplicaIsNotReady => "REPLICA_IS_NOT_READY",
            ErrorCode::ObjectNotFound => "OBJECT_NOT_FOUND",
            ErrorCode::ObjectAlreadyExists => "OBJECT_ALREADY_EXISTS",
            ErrorCode::ObjectHasLease => "OBJECT_HAS_LEASE",
            ErrorCode::TransferFail => "TRANSFER_FAIL",
            ErrorCode::RpcFail => "RPC_FAIL",
            ErrorCode::UnavailableInCurrentStatus => "UNAVAILABLE_IN_CURRENT_STATUS",
            ErrorCode::JobNotFound => "JOB_NOT_FOUND",
            ErrorCode::TenantQuotaExceeded => "TENANT_QUOTA_EXCEEDED",
            ErrorCode::TenantNotRegistered => "TENANT_NOT_REGISTERED",
            ErrorCode::TenantNotEmpty => "TENANT_NOT_EMPTY",
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.name(), *self as i32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_match_upstream_values() {
        for c in ErrorCode::ALL {
            assert_eq!(ErrorCode::from_i32(c.as_i32()), c);
        }
        assert_eq!(ErrorCode::NoAvailableHandle.as_i32(), -200);
        assert_eq!(ErrorCode::ObjectNotFound.as_i32(), -704);
        assert_eq!(ErrorCode::ObjectAlreadyExists.as_i32(), -705);
        assert_eq!(ErrorCode::ObjectHasLease.as_i32(), -706);
        assert_eq!(ErrorCode::TransferFail.as_i32(), -800);
        assert_eq!(ErrorCode::RpcFail.as_i32(), -900);
        assert_eq!(ErrorCode::TenantQuotaExceeded.as_i32(), -1700);
        assert_eq!(ErrorCode::TenantNotEmpty.as_i32(), -1702);
        assert_eq!(ErrorCode::from_i32(-123_456), ErrorCode::InternalError);
    }
}
