//! The RDMA descriptor: what a peer needs to reach a segment's memory with one-sided RDMA READ
//! and WRITE, and to connect a reliable-connection (RC) queue pair to ours.
//!
//! One type serves both uses:
//! - **published** (in [`crate::SegmentInfo::rdma`]): device, port, GID, LID, MTU and the
//!   segment's memory region (`addr`, `len`, `rkey`); `qpn`/`psn` are 0.
//! - **connection setup** (the `RDMA_CONNECT` wire op): the same fields plus the queue pair
//!   number and starting packet sequence number of the sender's QP. The requester sends its
//!   descriptor with `addr = len = rkey = 0`; the owner answers with its segment's region.
//!
//! It is always compiled (no `rdma` feature needed) so every build can decode, log and test it.
//!
//! # Binary form, version 1 (little-endian)
//! ```text
//! off size field
//!   0   4  magic "LKRD"
//!   4   1  version (1)
//!   5   1  port number (1-based)
//!   6   1  gid index
//!   7   1  device name length n (1..=64)
//!   8  16  gid (raw bytes, network order as the verbs API returns them)
//!  24   2  lid (0 on RoCE)
//!  26   1  path mtu as the verbs enum (1=256, 2=512, 3=1024, 4=2048, 5=4096)
//!  27   1  reserved (0)
//!  28   4  qpn (24 bits used)
//!  32   4  psn (24 bits used)
//!  36   4  rkey
//!  40   8  addr (remote virtual address of the region's first byte)
//!  48   8  len (region bytes)
//!  56   n  device name (UTF-8, e.g. "mlx5_0", "rxe0")
//! ```
//! Compatibility rule: later versions only append fields after the device name and keep
//! everything above, so a version-1 decoder accepts any version >= 1 and ignores trailing bytes.
//! The text form ([`RdmaDescriptor::to_hex`]) is the binary form in lowercase hex, for carriers
//! that hold strings (JSON, a proto `string`).

use std::fmt;

/// "LKRD" read as a little-endian u32.
pub const RDMA_DESC_MAGIC: u32 = u32::from_le_bytes(*b"LKRD");
/// The version this build writes.
pub const RDMA_DESC_VERSION: u8 = 1;
/// Bytes before the device name.
pub const RDMA_DESC_FIXED_LEN: usize = 56;
/// Longest device name accepted (IB_DEVICE_NAME_MAX is 64).
pub const RDMA_DEVICE_NAME_MAX: usize = 64;
/// Longest encoded descriptor a decoder reads (room for appended fields of later versions).
pub const RDMA_DESC_MAX_LEN: usize = 1024;

/// Everything a peer needs to connect a queue pair to us and address our registered memory.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RdmaDescriptor {
    /// Device name, e.g. `mlx5_0` or `rxe0`.
    pub device: String,
    /// Port number on the device (1-based).
    pub port: u8,
    /// GID table index the sender uses as its source GID.
    pub gid_index: u8,
    /// The sender's GID (RoCE: derived from an IP address of the netdev).
    pub gid: [u8; 16],
    /// Local identifier (InfiniBand); 0 on RoCE.
    pub lid: u16,
    /// Active path MTU as the verbs enum value (1=256 .. 5=4096).
    pub mtu: u8,
    /// Queue pair number (connection setup only; 0 when published).
    pub qpn: u32,
    /// Starting packet sequence number (connection setup only; 0 when published).
    pub psn: u32,
    /// Remote key of the memory region (0 when the sender offers no memory).
    pub rkey: u32,
    /// Virtual address of the region's first byte.
    pub addr: u64,
    /// Region length in bytes.
    pub len: u64,
}

/// Why bytes are not a descriptor.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad rdma descriptor: {0}")]
pub struct RdmaDescriptorError(pub String);

fn bad(msg: impl Into<String>) -> RdmaDescriptorError {
    RdmaDescriptorError(msg.into())
}

impl RdmaDescriptor {
    /// The binary form (see the module docs).
    pub fn encode(&self) -> Vec<u8> {
        let name = self.device.as_bytes();
        let n = name.len().min(RDMA_DEVICE_NAME_MAX);
        let mut b = vec![0u8; RDMA_DESC_FIXED_LEN + n];
        b[0..4].copy_from_slice(&RDMA_DESC_MAGIC.to_le_bytes());
        b[4] = RDMA_DESC_VERSION;
        b[5] = self.port;
        b[6] = self.gid_index;
        b[7] = n as u8;
        b[8..24].copy_from_slice(&self.gid);
        b[24..26].copy_from_slice(&self.lid.to_le_bytes());
        b[26] = self.mtu;
        b[28..32].copy_from_slice(&self.qpn.to_le_bytes());
        b[32..36].copy_from_slice(&self.psn.to_le_bytes());
        b[36..40].copy_from_slice(&self.rkey.to_le_bytes());
        b[40..48].copy_from_slice(&self.addr.to_le_bytes());
        b[48..56].copy_from_slice(&self.len.to_le_bytes());
        b[RDMA_DESC_FIXED_LEN..].copy_from_slice(&name[..n]);
        b
    }

    /// Parses the binary form; accepts any version >= 1 (trailing bytes of later versions are
    /// ignored) and refuses anything malformed with a reason.
    pub fn decode(b: &[u8]) -> Result<RdmaDescriptor, RdmaDescriptorError> {
        if b.len() < RDMA_DESC_FIXED_LEN {
            return Err(bad(format!(
                "{} bytes, need at least {RDMA_DESC_FIXED_LEN}",
                b.len()
            )));
        }
        if b.len() > RDMA_DESC_MAX_LEN {
            return Err(bad(format!(
                "{} bytes, at most {RDMA_DESC_MAX_LEN}",
                b.len()
            )));
        }
        let magic = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        if magic != RDMA_DESC_MAGIC {
            return Err(bad(format!("bad magic {magic:#010x}")));
        }
        if b[4] == 0 {
            return Err(bad("version 0"));
        }
        let n = b[7] as usize;
        if n == 0 || n > RDMA_DEVICE_NAME_MAX {
            return Err(bad(format!("device name length {n}")));
        }
        let name = b
            .get(RDMA_DESC_FIXED_LEN..RDMA_DESC_FIXED_LEN + n)
            .ok_or_else(|| bad("truncated device name"))?;
        let device = std::str::from_utf8(name)
            .map_err(|_| bad("device name is not UTF-8"))?
            .to_string();
        let mtu = b[26];
        if !(1..=5).contains(&mtu) {
            return Err(bad(format!("path mtu enum {mtu} (want 1..=5)")));
        }
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let u64_at = |o: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[o..o + 8]);
            u64::from_le_bytes(a)
        };
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[8..24]);
        let d = RdmaDescriptor {
            device,
            port: b[5],
            gid_index: b[6],
            gid,
            lid: u16::from_le_bytes([b[24], b[25]]),
            mtu,
            qpn: u32_at(28),
            psn: u32_at(32),
            rkey: u32_at(36),
            addr: u64_at(40),
            len: u64_at(48),
        };
        if d.port == 0 {
            return Err(bad("port 0 (ports are 1-based)"));
        }
        if d.addr.checked_add(d.len).is_none() {
            return Err(bad("region wraps the address space"));
        }
        Ok(d)
    }

    /// The binary form in lowercase hex, for string carriers.
    pub fn to_hex(&self) -> String {
        use fmt::Write;
        let mut s = String::with_capacity(2 * (RDMA_DESC_FIXED_LEN + self.device.len()));
        for byte in self.encode() {
            let _ = write!(s, "{byte:02x}");
        }
        s
    }

    /// Parses [`RdmaDescriptor::to_hex`] output.
    pub fn from_hex(s: &str) -> Result<RdmaDescriptor, RdmaDescriptorError> {
        let s = s.trim();
        if !s.len().is_multiple_of(2) || s.len() > 2 * RDMA_DESC_MAX_LEN {
            return Err(bad(format!("hex form of {} characters", s.len())));
        }
        let bytes = (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(s.get(i..i + 2).unwrap_or("zz"), 16))
            .collect::<Result<Vec<u8>, _>>()
            .map_err(|_| bad("hex form has a non-hex character"))?;
        RdmaDescriptor::decode(&bytes)
    }

    /// Path MTU in bytes.
    pub fn mtu_bytes(&self) -> u32 {
        128u32 << self.mtu.min(5)
    }

    /// True if the descriptor offers memory (a segment's region).
    pub fn has_region(&self) -> bool {
        self.len > 0 && self.rkey != 0
    }
}

impl fmt::Display for RdmaDescriptor {
    /// `rxe0:1 gid fe80:0000:...:0001 (index 1) lid 0 mtu 1024 qpn 0x11 region 0x7f..+1073741824 rkey 0x1234`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{} gid ", self.device, self.port)?;
        for (i, pair) in self.gid.chunks(2).enumerate() {
            if i > 0 {
                f.write_str(":")?;
            }
            write!(f, "{:02x}{:02x}", pair[0], pair[1])?;
        }
        write!(
            f,
            " (index {}) lid {} mtu {} qpn {:#x} region {:#x}+{} rkey {:#x}",
            self.gid_index,
            self.lid,
            self.mtu_bytes(),
            self.qpn,
            self.addr,
            self.len,
            self.rkey
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> RdmaDescriptor {
        RdmaDescriptor {
            device: "mlx5_0".into(),
            port: 1,
            gid_index: 3,
            gid: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 5],
            lid: 0,
            mtu: 3,
            qpn: 0x1234,
            psn: 0x00ab_cdef,
            rkey: 0xdead_beef,
            addr: 0x7f00_0000_1000,
            len: 40 << 30,
        }
    }

    #[test]
    fn round_trips_binary_and_hex() {
        let d = sample();
        let b = d.encode();
        assert_eq!(b.len(), RDMA_DESC_FIXED_LEN + 6);
        assert_eq!(&b[0..4], b"LKRD");
        assert_eq!(b[4], RDMA_DESC_VERSION);
        assert_eq!(RdmaDescriptor::decode(&b).unwrap(), d);
        let h = d.to_hex();
        assert!(h.starts_with("4c4b5244")); // "LKRD"
        assert_eq!(RdmaDescriptor::from_hex(&h).unwrap(), d);
        assert_eq!(d.mtu_bytes(), 1024);
        assert!(d.has_region());
    }

    #[test]
    fn layout_is_stable() {
        // Pin the documented offsets: a change here is a wire-format change (bump the version).
        let b = sample().encode();
        assert_eq!(b[5], 1);
        assert_eq!(b[6], 3);
        assert_eq!(b[7], 6);
        assert_eq!(&b[8..24], &sample().gid);
        assert_eq!(b[26], 3);
        assert_eq!(&b[28..32], &0x1234u32.to_le_bytes());
        assert_eq!(&b[32..36], &0x00ab_cdefu32.to_le_bytes());
        assert_eq!(&b[36..40], &0xdead_beefu32.to_le_bytes());
        assert_eq!(&b[40..48], &0x7f00_0000_1000u64.to_le_bytes());
        assert_eq!(&b[48..56], &(40u64 << 30).to_le_bytes());
        assert_eq!(&b[56..], b"mlx5_0");
    }

    #[test]
    fn later_versions_with_appended_fields_decode() {
        let mut b = sample().encode();
        b[4] = 2;
        b.extend_from_slice(&[9, 9, 9, 9]);
        assert_eq!(RdmaDescriptor::decode(&b).unwrap(), sample());
    }

    #[test]
    fn garbage_is_refused_with_a_reason() {
        let good = sample().encode();
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (good[..20].to_vec(), "need at least"),
            (
                {
                    let mut b = good.clone();
                    b[0] = b'X';
                    b
                },
                "magic",
            ),
            (
                {
                    let mut b = good.clone();
                    b[4] = 0;
                    b
                },
                "version 0",
            ),
            (
                {
                    let mut b = good.clone();
                    b[7] = 0;
                    b
                },
                "device name length",
            ),
            (
                {
                    let mut b = good.clone();
                    b[7] = 60;
                    b
                },
                "truncated",
            ),
            (
                {
                    let mut b = good.clone();
                    b[26] = 9;
                    b
                },
                "mtu",
            ),
            (
                {
                    let mut b = good.clone();
                    b[5] = 0;
                    b
                },
                "port 0",
            ),
            (
                {
                    let mut b = good.clone();
                    b[40..48].copy_from_slice(&u64::MAX.to_le_bytes());
                    b
                },
                "wraps",
            ),
            (vec![0u8; RDMA_DESC_MAX_LEN + 1], "at most"),
        ];
        for (bytes, why) in cases {
            let e = RdmaDescriptor::decode(&bytes).unwrap_err();
            assert!(e.to_string().contains(why), "{e} should mention {why}");
        }
        assert!(RdmaDescriptor::from_hex("4c4").is_err());
        assert!(RdmaDescriptor::from_hex("zz").is_err());
    }

    #[test]
    fn long_device_names_are_truncated_to_the_limit() {
        let mut d = sample();
        d.device = "x".repeat(100);
        let back = RdmaDescriptor::decode(&d.encode()).unwrap();
        assert_eq!(back.device.len(), RDMA_DEVICE_NAME_MAX);
    }

    #[test]
    fn display_names_device_gid_and_region() {
        let s = sample().to_string();
        assert!(
            s.starts_with("mlx5_0:1 gid 0000:0000:0000:0000:0000:ffff:0a00:0005"),
            "{s}"
        );
        assert!(s.contains("rkey 0xdeadbeef"), "{s}");
    }
}
