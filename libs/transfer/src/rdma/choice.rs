//! The protocol a component asked for and the one it serves.
//!
//! llm-d's ConfigMap, its store DaemonSet and vLLM's default all say `"protocol": "rdma"`.
//! Refusing that stops vLLM at startup on every machine without a device, so `rdma` is accepted
//! everywhere: where this build has the transport and a device opens, it is used; otherwise
//! the component logs ONE warning line saying why and serves tcp (same-host peers still use
//! shared memory). The choice travels with the segment's mount so `lunakv status`, /metrics
//! and `lunakv doctor` show what every store and embedded client really serves.

use std::fmt;

use super::rdma_check;

/// A transfer protocol as configs and the master's segment view name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WireProtocol {
    Tcp,
    Rdma,
}

impl WireProtocol {
    pub fn as_str(self) -> &'static str {
        match self {
            WireProtocol::Tcp => "tcp",
            WireProtocol::Rdma => "rdma",
        }
    }

    /// `"tcp"` / `"rdma"` in any case and with surrounding blanks; anything else is `None`.
    pub fn parse(s: &str) -> Option<WireProtocol> {
        match s.trim().to_ascii_lowercase().as_str() {
            "tcp" => Some(WireProtocol::Tcp),
            "rdma" => Some(WireProtocol::Rdma),
            _ => None,
        }
    }
}

impl fmt::Display for WireProtocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What was requested, what is served, and why they differ.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProtocolChoice {
    pub requested: WireProtocol,
    pub effective: WireProtocol,
    /// Why `effective` is not `requested` (`None` when they are equal).
    pub reason: Option<String>,
}

impl ProtocolChoice {
    /// tcp asked, tcp served.
    pub fn tcp() -> ProtocolChoice {
        ProtocolChoice {
            requested: WireProtocol::Tcp,
            effective: WireProtocol::Tcp,
            reason: None,
        }
    }

    /// rdma asked, tcp served, because of `reason` (one line, no "use tcp" advice: tcp is
    /// what happens).
    pub fn rdma_unavailable(reason: impl Into<String>) -> ProtocolChoice {
        ProtocolChoice {
            requested: WireProtocol::Rdma,
            effective: WireProtocol::Tcp,
            reason: Some(one_line(&reason.into())),
        }
    }

    /// What this build and machine serve for `requested`: rdma where the `rdma` feature is
    /// built and a device opens ([`rdma_check`]); otherwise tcp with the probe's reason. tcp
    /// costs nothing to resolve (no device probe).
    pub fn resolve(requested: WireProtocol) -> ProtocolChoice {
        match requested {
            WireProtocol::Tcp => ProtocolChoice::tcp(),
            WireProtocol::Rdma => match rdma_check() {
                Ok(_) => ProtocolChoice {
                    requested,
                    effective: WireProtocol::Rdma,
                    reason: None,
                },
                Err(e) => ProtocolChoice::rdma_unavailable(reason_of(&e.to_string())),
            },
        }
    }

    /// As carried on the wire (the master's segment view): empty `requested` means an older
    /// owner that only sent its protocol; empty `reason` means none.
    pub fn from_wire(requested: &str, effective: &str, reason: &str) -> ProtocolChoice {
        let effective = WireProtocol::parse(effective).unwrap_or(WireProtocol::Tcp);
        ProtocolChoice {
            requested: WireProtocol::parse(requested).unwrap_or(effective),
            effective,
            reason: (!reason.trim().is_empty()).then(|| one_line(reason)),
        }
    }

    /// True when the component serves something else than it was asked for.
    pub fn fell_back(&self) -> bool {
        self.requested != self.effective
    }

    /// The one WARN line a component logs at start when it fell back, else `None`.
    pub fn warning(&self) -> Option<String> {
        self.fell_back().then(|| {
            format!(
                "protocol \"{}\" requested but unavailable ({}); serving {} instead (same-host peers still use shared memory)",
                self.requested,
                self.reason.as_deref().unwrap_or("no reason given"),
                self.effective
            )
        })
    }

    /// The reason as a string, empty when there is none (for the wire and metric labels).
    pub fn reason_str(&self) -> &str {
        self.reason.as_deref().unwrap_or("")
    }
}

/// `tcp`, `rdma`, or `tcp (rdma unavailable: <reason>)`, as `lunakv status` shows it.
impl fmt::Display for ProtocolChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.fell_back() {
            write!(
                f,
                "{} ({} unavailable: {})",
                self.effective,
                self.requested,
                self.reason.as_deref().unwrap_or("no reason given")
            )
        } else {
            f.write_str(self.effective.as_str())
        }
    }
}

/// The cause inside one of the refusal lines of this module (`protocol "rdma": <cause>; use
/// "protocol": "tcp"`): the prefix and the advice go, since tcp is now served anyway.
pub fn reason_of(refusal: &str) -> String {
    let s = refusal.trim();
    let s = s.strip_prefix("protocol \"rdma\": ").unwrap_or(s);
    let s = match s.rfind("; ") {
        Some(i) if s[i..].contains("\"protocol\": \"tcp\"") => &s[..i],
        _ => s,
    };
    one_line(s)
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rdma::{msg_named_missing, msg_no_kernel_support, msg_not_built};

    #[test]
    fn reasons_drop_the_prefix_and_the_advice() {
        assert_eq!(
            reason_of(&msg_not_built()),
            "this lunakv build has no RDMA transport (rebuild with the cargo feature `rdma`, see docs/RDMA.md)"
        );
        assert_eq!(
            reason_of(&msg_no_kernel_support()),
            "no RDMA device found (ibv_get_device_list: this kernel has no RDMA support, ENOSYS)"
        );
        assert_eq!(
            reason_of(&msg_named_missing("mlx5_9", &["mlx5_0".into()])),
            "RDMA device \"mlx5_9\" (LUNAKV_RDMA_DEVICE) not found, devices here: [mlx5_0]"
        );
    }

    #[test]
    fn fallback_displays_as_status_shows_it_and_warns_once() {
        let c = ProtocolChoice::rdma_unavailable("no RDMA device found");
        assert_eq!(
            c.to_string(),
            "tcp (rdma unavailable: no RDMA device found)"
        );
        let w = c.warning().expect("a fallback warns");
        assert!(!w.contains('\n'));
        assert!(
            w.contains("no RDMA device found") && w.contains("serving tcp"),
            "{w}"
        );
        assert_eq!(ProtocolChoice::tcp().to_string(), "tcp");
        assert_eq!(ProtocolChoice::tcp().warning(), None);
    }

    #[test]
    fn resolve_never_refuses_rdma() {
        let c = ProtocolChoice::resolve(WireProtocol::Rdma);
        assert_eq!(c.requested, WireProtocol::Rdma);
        match rdma_check() {
            Ok(_) => assert_eq!(c.effective, WireProtocol::Rdma),
            Err(e) => {
                assert_eq!(c.effective, WireProtocol::Tcp);
                assert_eq!(
                    c.reason.as_deref(),
                    Some(reason_of(&e.to_string()).as_str())
                );
            }
        }
        assert_eq!(
            ProtocolChoice::resolve(WireProtocol::Tcp),
            ProtocolChoice::tcp()
        );
    }

    #[test]
    fn wire_form_round_trips_and_reads_older_owners() {
        let c = ProtocolChoice::rdma_unavailable("x");
        let back =
            ProtocolChoice::from_wire(c.requested.as_str(), c.effective.as_str(), c.reason_str());
        assert_eq!(back, c);
        // An owner from before this field: only `protocol` was sent.
        assert_eq!(
            ProtocolChoice::from_wire("", "tcp", ""),
            ProtocolChoice::tcp()
        );
    }
}
