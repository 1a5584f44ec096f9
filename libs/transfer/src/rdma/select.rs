//! Transport selection per peer, as a pure function (no device needed to test it).
//!
//! Rules, in order:
//! 1. **shm** when shm is enabled, the target is on this host (equal `host_id`), it offers a
//!    socket, and attaching it has not failed recently;
//! 2. else **rdma** when BOTH sides have it: this engine was built with RDMA and opened a
//!    device, and the target has not told us it offers none (its descriptor arrives in the
//!    `RDMA_CONNECT` answer, so an unknown peer is tried once and then remembered);
//! 3. else **tcp**.

/// What the engine knows about a peer's RDMA offer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerRdma {
    /// Not asked yet: try the RDMA handshake, which settles it.
    Unknown,
    /// The peer answered `RDMA_CONNECT` with its descriptor.
    Offered,
    /// The peer refused `RDMA_CONNECT` (no device, not enabled, or an older lunakv) recently.
    NotOffered,
}

/// The transport a request to one target takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Shm,
    Rdma,
    Tcp,
}

impl Route {
    pub fn as_str(self) -> &'static str {
        match self {
            Route::Shm => "shm",
            Route::Rdma => "rdma",
            Route::Tcp => "tcp",
        }
    }
}

/// The facts [`select_route`] decides on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouteFacts {
    /// shm allowed by options and environment (`LUNAKV_DISABLE_SHM`).
    pub shm_enabled: bool,
    /// The target's host id equals ours.
    pub same_host: bool,
    /// The target offers an shm socket.
    pub shm_offered: bool,
    /// Attaching the target's shm failed within the retry window.
    pub shm_failed_recently: bool,
    /// This engine has an open RDMA device (feature built, `protocol: "rdma"` asked for it).
    pub local_rdma: bool,
    /// What the target offers.
    pub peer_rdma: PeerRdma,
}

/// shm on the same host (when enabled), else rdma if both sides have it, else tcp.
pub fn select_route(f: &RouteFacts) -> Route {
    if f.shm_enabled && f.same_host && f.shm_offered && !f.shm_failed_recently {
        return Route::Shm;
    }
    if f.local_rdma && f.peer_rdma != PeerRdma::NotOffered {
        return Route::Rdma;
    }
    Route::Tcp
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> RouteFacts {
        RouteFacts {
            shm_enabled: true,
            same_host: false,
            shm_offered: true,
            shm_failed_recently: false,
            local_rdma: true,
            peer_rdma: PeerRdma::Offered,
        }
    }

    #[test]
    fn same_host_prefers_shm_even_with_rdma() {
        let f = RouteFacts {
            same_host: true,
            ..base()
        };
        assert_eq!(select_route(&f), Route::Shm);
    }

    #[test]
    fn shm_needs_every_condition() {
        let same = RouteFacts {
            same_host: true,
            ..base()
        };
        for f in [
            RouteFacts {
                shm_enabled: false,
                ..same
            },
            RouteFacts {
                shm_offered: false,
                ..same
            },
            RouteFacts {
                shm_failed_recently: true,
                ..same
            },
            RouteFacts {
                same_host: false,
                ..same
            },
        ] {
            assert_eq!(select_route(&f), Route::Rdma, "{f:?}");
            let no_rdma = RouteFacts {
                local_rdma: false,
                ..f
            };
            assert_eq!(select_route(&no_rdma), Route::Tcp, "{no_rdma:?}");
        }
    }

    #[test]
    fn rdma_needs_both_sides() {
        assert_eq!(select_route(&base()), Route::Rdma);
        let unknown = RouteFacts {
            peer_rdma: PeerRdma::Unknown,
            ..base()
        };
        assert_eq!(
            select_route(&unknown),
            Route::Rdma,
            "unknown peers are asked"
        );
        let refused = RouteFacts {
            peer_rdma: PeerRdma::NotOffered,
            ..base()
        };
        assert_eq!(select_route(&refused), Route::Tcp);
        let local_none = RouteFacts {
            local_rdma: false,
            ..base()
        };
        assert_eq!(select_route(&local_none), Route::Tcp);
    }

    #[test]
    fn nothing_special_is_tcp() {
        let f = RouteFacts {
            shm_enabled: false,
            same_host: false,
            shm_offered: false,
            shm_failed_recently: false,
            local_rdma: false,
            peer_rdma: PeerRdma::Unknown,
        };
        assert_eq!(select_route(&f), Route::Tcp);
        assert_eq!(Route::Tcp.as_str(), "tcp");
    }
}
