//! Capabilities: what lets a requester touch a range of a segment when its owner requires them.
//!
//! An owner draws a [`MountSecret`] per mount and hands it to the master over the authenticated
//! control channel (MountSegment). The master then returns, with every location it hands out,
//! a [`Capability`]: a keyed BLAKE3 tag under that secret over (segment, generation, offset,
//! length, rights, expiry). The owner recomputes the tag on every READ, WRITE, PIN and COMMIT
//! before it touches memory; nobody without the secret can forge one, so knowing a generation
//! and an offset (GetReplicaList, `/query_key`) no longer lets a stranger read or overwrite it.
//! The master's own requests (FREE, OFFLOAD, PROMOTE) carry an owner tag (`owner_tag`) over the whole
//! request under the same secret, and a second one over the header alone (`owner_header_tag`),
//! which the owner checks before it reads a single body byte: a stranger's FREE claiming a
//! 16 MiB body then costs the owner nothing but the header.
//!
//! A write capability may carry a [`PlacementProof`] after it: the master's tag, under a key only
//! masters hold ([`InventoryKey`]), over (key, generation, size) of the object being placed. The
//! owner cannot check it; it keeps it with the entry and hands it back in its inventory when it
//! mounts again, where the master checks it (docs/SECURITY.md, "Verified inventories"). So an
//! owner can only ever report objects the master placed with it.
//!
//! Keyed BLAKE3, not HMAC-SHA256: the input is ~60 bytes, where BLAKE3 is one compression
//! (~100 ns) against HMAC's four SHA-256 blocks, and the check runs on every request of the
//! data path. Tags are cut to 128 bits: a forger gets one online guess per round trip.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::wire::{FLAG_CAP, FLAG_PROOF, FLAGS_AT, REQ_LEN};

/// Bytes of a capability on the wire and in `Replica.capability`.
pub const CAP_LEN: usize = 56;
/// Bytes of a [`PlacementProof`].
pub const PROOF_LEN: usize = 16;
/// A write capability with its placement proof: the longest `Replica.capability`.
pub const CAP_MAX_LEN: usize = CAP_LEN + PROOF_LEN;
/// Read rights: READ, PIN, LOAD (and ATTACH).
pub const RIGHT_READ: u8 = 1;
/// Write rights: WRITE, COMMIT (and ATTACH).
pub const RIGHT_WRITE: u8 = 2;
/// The master's requests to an owner (FREE, OFFLOAD, PROMOTE): never in a client's capability.
pub const RIGHT_OWNER: u8 = 4;
/// How long a read capability is valid. Generations are unique across master restarts, so a
/// read capability is useless once its object is gone; the expiry only bounds how long a
/// leaked one reads a live object, and a client asks the master again once an hour per key.
pub const READ_TTL: Duration = Duration::from_secs(3600);
/// How long a put's write capability is valid: the bytes go out right after PutStart, and
/// the range may be handed to someone else once the object is removed.
pub const WRITE_TTL: Duration = Duration::from_secs(600);
/// How long the master's FREE/OFFLOAD/PROMOTE tag is valid (bounds a replay).
pub const OWNER_TTL: Duration = Duration::from_secs(60);
/// A client treats a capability this close to its expiry as expired, so clock skew and the
/// transfer itself fit inside it.
pub const EXPIRY_MARGIN: Duration = Duration::from_secs(30);

const DATA_DOMAIN: &[u8] = b"lunakv-cap-v1";
const OWNER_DOMAIN: &[u8] = b"lunakv-owner-v1";
const OWNER_HEADER_DOMAIN: &[u8] = b"lunakv-owner-header-v1";
const PROOF_DOMAIN: &[u8] = b"lunakv-placement-v1";

/// The per-mount secret an owner shares with the master. Its `Debug` never shows the bytes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct MountSecret([u8; 32]);

impl MountSecret {
    /// 32 fresh random bytes (the OS's generator, through `rand`).
    pub fn generate() -> MountSecret {
        MountSecret(rand::random())
    }

    /// From the bytes of `MountSegment.data_secret`; `None` unless exactly 32 bytes.
    pub fn from_slice(b: &[u8]) -> Option<MountSecret> {
        Some(MountSecret(b.try_into().ok()?))
    }

    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl std::fmt::Debug for MountSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MountSecret(..)")
    }
}

/// The masters' key for [`PlacementProof`]s: 32 random bytes the first master of a cluster
/// creates in its meta store (etcd in HA), so every master and every restart shares it. Owners
/// never see it. Its `Debug` never shows the bytes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct InventoryKey([u8; 32]);

impl InventoryKey {
    pub fn generate() -> InventoryKey {
        InventoryKey(rand::random())
    }

    /// From the stored bytes; `None` unless exactly 32.
    pub fn from_slice(b: &[u8]) -> Option<InventoryKey> {
        Some(InventoryKey(b.try_into().ok()?))
    }

    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl std::fmt::Debug for InventoryKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("InventoryKey(..)")
    }
}

/// The master's word that it placed object (key, generation, size): keyed BLAKE3 under the
/// [`InventoryKey`], cut to 128 bits. No segment and no offset: generations are unique across
/// restarts, so a proof names one put, and an owner may move the entry (offload to disk,
/// promote back) without a new one.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PlacementProof([u8; PROOF_LEN]);

impl std::fmt::Debug for PlacementProof {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PlacementProof(..)")
    }
}

impl PlacementProof {
    pub fn issue(k: &InventoryKey, key: &str, generation: u64, size: u64) -> PlacementProof {
        let mut h = blake3::Hasher::new_keyed(&k.0);
        h.update(PROOF_DOMAIN);
        h.update(&generation.to_le_bytes());
        h.update(&size.to_le_bytes());
        h.update(&(key.len() as u64).to_le_bytes());
        h.update(key.as_bytes());
        PlacementProof(cut(h.finalize()))
    }

    /// The master's check of an inventory entry, in constant time.
    pub fn verify(&self, k: &InventoryKey, key: &str, generation: u64, size: u64) -> bool {
        ct_eq(&PlacementProof::issue(k, key, generation, size).0, &self.0)
    }

    /// From the wire, the proto or the disk index; `None` unless exactly [`PROOF_LEN`] bytes.
    pub fn from_slice(b: &[u8]) -> Option<PlacementProof> {
        Some(PlacementProof(b.try_into().ok()?))
    }

    pub fn as_bytes(&self) -> &[u8; PROOF_LEN] {
        &self.0
    }
}

/// What a capability covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant<'a> {
    pub segment: &'a str,
    pub generation: u64,
    pub offset: u64,
    pub len: u64,
}

/// A capability as it travels: rights (1 byte), 7 zero bytes, then little-endian u64s expiry
/// (unix ms), generation, offset and length, then the tag (16 bytes). The range travels along
/// so an ATTACH, which names no range, can still be checked. A write capability may be
/// followed by the placement's [`PlacementProof`] ([`CAP_MAX_LEN`] bytes in all), which the tag
/// does not cover: only the master can check it, at a later mount. An owner tag
/// ([`Capability::owner`]) has no range: its bytes 16..32 hold the header-only tag instead.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Capability {
    b: [u8; CAP_MAX_LEN],
    proven: bool,
}

impl std::fmt::Debug for Capability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Capability(rights={}, expiry_ms={})",
            self.rights(),
            self.expiry_ms()
        )
    }
}

/// Why the owner refused a request's capability; the refusal's message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CapError {
    #[error(
        "this owner requires a capability (the pool token is set); ask the master for the location again"
    )]
    Missing,
    #[error("capability does not grant {0}")]
    Rights(&'static str),
    #[error("capability expired; ask the master for the location again")]
    Expired,
    #[error("capability does not match this request or this segment's secret")]
    BadTag,
}

impl Capability {
    /// Issues a capability under `secret` (the master does this for every location).
    pub fn issue(secret: &MountSecret, g: &Grant<'_>, rights: u8, ttl: Duration) -> Capability {
        let expiry = now_ms().saturating_add(ttl.as_millis() as u64);
        Capability::issue_until(secret, g, rights, expiry)
    }

    /// [`Capability::issue`] with an explicit expiry (unix ms); tests use it for expired ones.
    pub fn issue_until(
        secret: &MountSecret,
        g: &Grant<'_>,
        rights: u8,
        expiry_ms: u64,
    ) -> Capability {
        let mut b = [0u8; CAP_MAX_LEN];
        b[0] = rights;
        b[8..16].copy_from_slice(&expiry_ms.to_le_bytes());
        b[16..24].copy_from_slice(&g.generation.to_le_bytes());
        b[24..32].copy_from_slice(&g.offset.to_le_bytes());
        b[32..40].copy_from_slice(&g.len.to_le_bytes());
        b[40..CAP_LEN].copy_from_slice(&data_tag(secret, g, rights, expiry_ms));
        Capability { b, proven: false }
    }

    /// From the wire or the proto: [`CAP_LEN`] bytes, or [`CAP_MAX_LEN`] with a placement
    /// proof; `None` for any other length.
    pub fn from_slice(b: &[u8]) -> Option<Capability> {
        let mut c = Capability {
            b: [0u8; CAP_MAX_LEN],
            proven: b.len() == CAP_MAX_LEN,
        };
        if b.len() != CAP_LEN && !c.proven {
            return None;
        }
        c.b[..b.len()].copy_from_slice(b);
        Some(c)
    }

    /// The wire and proto form: [`CAP_LEN`] bytes, then the proof if it carries one.
    pub fn as_bytes(&self) -> &[u8] {
        &self.b[..if self.proven { CAP_MAX_LEN } else { CAP_LEN }]
    }

    /// This capability with the placement's proof after it (the master, for write placements).
    pub fn with_proof(mut self, p: PlacementProof) -> Capability {
        self.b[CAP_LEN..].copy_from_slice(&p.0);
        self.proven = true;
        self
    }

    /// The placement proof it carries, if any.
    pub fn proof(&self) -> Option<PlacementProof> {
        self.proven
            .then(|| PlacementProof::from_slice(&self.b[CAP_LEN..]))
            .flatten()
    }

    pub fn rights(&self) -> u8 {
        self.b[0]
    }

    pub fn expiry_ms(&self) -> u64 {
        self.word(8)
    }

    /// The `(generation, offset, len)` it was issued for.
    pub fn range(&self) -> (u64, u64, u64) {
        (self.word(16), self.word(24), self.word(32))
    }

    fn word(&self, at: usize) -> u64 {
        u64::from_le_bytes(self.b[at..at + 8].try_into().unwrap_or_default())
    }

    /// Whether a client should ask the master for a fresh one before using it.
    pub fn expires_soon(&self) -> bool {
        self.expiry_ms() <= now_ms().saturating_add(EXPIRY_MARGIN.as_millis() as u64)
    }

    /// The owner's check: `need` rights for exactly `g`, not expired, tag under `secret`.
    pub fn verify(&self, secret: &MountSecret, g: &Grant<'_>, need: u8) -> Result<(), CapError> {
        if self.rights() & need != need || self.rights() & RIGHT_OWNER != 0 {
            return Err(CapError::Rights(if need & RIGHT_WRITE != 0 {
                "write"
            } else {
                "read"
            }));
        }
        if self.expiry_ms() < now_ms() {
            return Err(CapError::Expired);
        }
        let want = data_tag(secret, g, self.rights(), self.expiry_ms());
        if ct_eq(&want, &self.b[40..CAP_LEN]) {
            Ok(())
        } else {
            Err(CapError::BadTag)
        }
    }

    /// ATTACH: any unexpired capability of `segment`, for the range it names (the requester
    /// maps the whole segment; the socket's 0660 mode is the rest of that boundary).
    pub fn verify_any(&self, secret: &MountSecret, segment: &str) -> Result<(), CapError> {
        let need = self.rights() & (RIGHT_READ | RIGHT_WRITE);
        if need == 0 {
            return Err(CapError::Rights("read"));
        }
        let (generation, offset, len) = self.range();
        let g = Grant {
            segment,
            generation,
            offset,
            len,
        };
        self.verify(secret, &g, need)
    }

    /// The master's tag over one FREE/OFFLOAD/PROMOTE: `header` with the flags byte zeroed
    /// (so it covers op, generation, offset, len, count and timeout) and the whole `body`, in
    /// bytes 40..56; and in bytes 16..32 (unused by an owner tag's range) a second tag over the
    /// header and expiry alone, under its own domain, which the owner checks before it reads
    /// the body ([`Capability::verify_owner_header`]).
    pub fn owner(secret: &MountSecret, header: &[u8; crate::wire::REQ_LEN], body: &[u8]) -> Self {
        let expiry = now_ms().saturating_add(OWNER_TTL.as_millis() as u64);
        let mut b = [0u8; CAP_MAX_LEN];
        b[0] = RIGHT_OWNER;
        b[8..16].copy_from_slice(&expiry.to_le_bytes());
        b[OWNER_HEADER_TAG].copy_from_slice(&owner_header_tag(secret, header, expiry));
        b[40..CAP_LEN].copy_from_slice(&owner_tag(secret, header, body, expiry));
        Capability { b, proven: false }
    }

    /// The owner's first check of [`Capability::owner`], on the header alone: passes only for
    /// a request whose header the master tagged (or a replay of one within [`OWNER_TTL`]), so
    /// nobody else gets the owner to buffer a body. [`Capability::verify_owner`] must still
    /// pass, over the body, before any of it is applied.
    pub fn verify_owner_header(
        &self,
        secret: &MountSecret,
        header: &[u8; crate::wire::REQ_LEN],
    ) -> Result<(), CapError> {
        self.owner_rights_and_expiry()?;
        if ct_eq(
            &owner_header_tag(secret, header, self.expiry_ms()),
            &self.b[OWNER_HEADER_TAG],
        ) {
            Ok(())
        } else {
            Err(CapError::BadTag)
        }
    }

    /// The owner's check of [`Capability::owner`] over the whole request.
    pub fn verify_owner(
        &self,
        secret: &MountSecret,
        header: &[u8; crate::wire::REQ_LEN],
        body: &[u8],
    ) -> Result<(), CapError> {
        self.owner_rights_and_expiry()?;
        if ct_eq(
            &owner_tag(secret, header, body, self.expiry_ms()),
            &self.b[40..CAP_LEN],
        ) {
            Ok(())
        } else {
            Err(CapError::BadTag)
        }
    }

    fn owner_rights_and_expiry(&self) -> Result<(), CapError> {
        if self.rights() != RIGHT_OWNER {
            return Err(CapError::Rights("owner"));
        }
        if self.expiry_ms() < now_ms() {
            return Err(CapError::Expired);
        }
        Ok(())
    }
}

/// Where an owner tag keeps its header-only tag (the range words of a data capability).
const OWNER_HEADER_TAG: std::ops::Range<usize> = 16..32;

fn owner_header_tag(
    secret: &MountSecret,
    header: &[u8; crate::wire::REQ_LEN],
    expiry_ms: u64,
) -> [u8; 16] {
    let mut hdr = *header;
    hdr[crate::wire::FLAGS_AT] = 0;
    let mut h = blake3::Hasher::new_keyed(&secret.0);
    h.update(OWNER_HEADER_DOMAIN);
    h.update(&hdr);
    h.update(&expiry_ms.to_le_bytes());
    cut(h.finalize())
}

fn data_tag(secret: &MountSecret, g: &Grant<'_>, rights: u8, expiry_ms: u64) -> [u8; 16] {
    let name = &g.segment.as_bytes()[..g.segment.len().min(1024)];
    let mut h = blake3::Hasher::new_keyed(&secret.0);
    h.update(DATA_DOMAIN);
    h.update(&[rights]);
    h.update(&g.generation.to_le_bytes());
    h.update(&g.offset.to_le_bytes());
    h.update(&g.len.to_le_bytes());
    h.update(&expiry_ms.to_le_bytes());
    h.update(&(name.len() as u16).to_le_bytes());
    h.update(name);
    cut(h.finalize())
}

fn owner_tag(
    secret: &MountSecret,
    header: &[u8; crate::wire::REQ_LEN],
    body: &[u8],
    expiry_ms: u64,
) -> [u8; 16] {
    let mut hdr = *header;
    hdr[crate::wire::FLAGS_AT] = 0;
    let mut h = blake3::Hasher::new_keyed(&secret.0);
    h.update(OWNER_DOMAIN);
    h.update(&hdr);
    h.update(&expiry_ms.to_le_bytes());
    h.update(body);
    cut(h.finalize())
}

fn cut(h: blake3::Hash) -> [u8; 16] {
    let mut t = [0u8; 16];
    t.copy_from_slice(&h.as_bytes()[..16]);
    t
}

/// Compares without an early exit, so the time taken says nothing about where a guess differs.
fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Sets [`FLAG_CAP`] on `hdr` when `cap` is given (and [`FLAG_PROOF`] when it carries a
/// placement proof); returns the bytes to send after the trace context (empty without one).
pub fn attach_cap<'c>(hdr: &mut [u8; REQ_LEN], cap: Option<&'c Capability>) -> &'c [u8] {
    match cap {
        Some(c) => {
            hdr[FLAGS_AT] |= FLAG_CAP;
            if c.proof().is_some() {
                hdr[FLAGS_AT] |= FLAG_PROOF;
            }
            c.as_bytes()
        }
        None => &[],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: Grant<'static> = Grant {
        segment: "127.0.0.1:50052",
        generation: 7 << 32 | 1,
        offset: 4096,
        len: 65536,
    };

    #[test]
    fn a_capability_grants_exactly_what_it_names() {
        let k = MountSecret::generate();
        let rw = Capability::issue(&k, &G, RIGHT_READ | RIGHT_WRITE, READ_TTL);
        assert_eq!(rw.verify(&k, &G, RIGHT_WRITE), Ok(()));
        assert_eq!(rw.verify(&k, &G, RIGHT_READ), Ok(()));
        let r = Capability::issue(&k, &G, RIGHT_READ, READ_TTL);
        assert_eq!(
            r.verify(&k, &G, RIGHT_WRITE),
            Err(CapError::Rights("write"))
        );
        let other = Grant { offset: 0, ..G };
        assert_eq!(rw.verify(&k, &other, RIGHT_READ), Err(CapError::BadTag));
        assert_eq!(
            rw.verify(&MountSecret::generate(), &G, RIGHT_READ),
            Err(CapError::BadTag)
        );
        // Raising the rights byte breaks the tag.
        let mut forged = r.as_bytes().to_vec();
        forged[0] = RIGHT_READ | RIGHT_WRITE;
        let forged = Capability::from_slice(&forged).unwrap();
        assert_eq!(forged.verify(&k, &G, RIGHT_WRITE), Err(CapError::BadTag));
        let old = Capability::issue_until(&k, &G, RIGHT_READ, now_ms() - 1);
        assert_eq!(old.verify(&k, &G, RIGHT_READ), Err(CapError::Expired));
        assert!(old.expires_soon() && !rw.expires_soon());
        assert_eq!(format!("{k:?}"), "MountSecret(..)");
        assert_eq!(rw.range(), (G.generation, G.offset, G.len));
        assert_eq!(rw.verify_any(&k, G.segment), Ok(()));
        assert_eq!(rw.verify_any(&k, "elsewhere:1"), Err(CapError::BadTag));
    }

    #[test]
    fn a_placement_proof_names_one_put_and_travels_after_the_capability() {
        let k = InventoryKey::generate();
        let p = PlacementProof::issue(&k, "model/0/abc", 7, 4096);
        assert!(p.verify(&k, "model/0/abc", 7, 4096));
        assert!(!p.verify(&k, "model/0/abd", 7, 4096));
        assert!(!p.verify(&k, "model/0/abc", 8, 4096));
        assert!(!p.verify(&k, "model/0/abc", 7, 4097));
        assert!(!p.verify(&InventoryKey::generate(), "model/0/abc", 7, 4096));
        let s = MountSecret::generate();
        let w = Capability::issue(&s, &G, RIGHT_READ | RIGHT_WRITE, WRITE_TTL);
        assert_eq!(w.as_bytes().len(), CAP_LEN);
        assert_eq!(w.proof(), None);
        let wp = w.with_proof(p);
        assert_eq!(wp.as_bytes().len(), CAP_MAX_LEN);
        let back = Capability::from_slice(wp.as_bytes()).unwrap();
        assert_eq!(back.proof(), Some(p));
        // The proof is outside the tag: the capability checks the same with or without it.
        assert_eq!(back.verify(&s, &G, RIGHT_WRITE), Ok(()));
        assert!(Capability::from_slice(&wp.as_bytes()[..CAP_LEN + 3]).is_none());
        assert_eq!(
            format!("{k:?} {p:?}"),
            "InventoryKey(..) PlacementProof(..)"
        );
    }

    #[test]
    fn an_owner_tag_covers_the_header_and_body_and_no_data_cap_passes_for_one() {
        let k = MountSecret::generate();
        let hdr = [3u8; crate::wire::REQ_LEN];
        let t = Capability::owner(&k, &hdr, b"pairs");
        assert_eq!(t.verify_owner(&k, &hdr, b"pairs"), Ok(()));
        assert_eq!(t.verify_owner(&k, &hdr, b"pairz"), Err(CapError::BadTag));
        let rw = Capability::issue(&k, &G, RIGHT_READ | RIGHT_WRITE, READ_TTL);
        assert_eq!(
            rw.verify_owner(&k, &hdr, b"pairs"),
            Err(CapError::Rights("owner"))
        );
        assert!(t.verify(&k, &G, RIGHT_READ).is_err());
    }

    #[test]
    fn an_owner_tags_header_half_is_checked_alone_and_cannot_be_moved_to_another_header() {
        let k = MountSecret::generate();
        let hdr = [3u8; crate::wire::REQ_LEN];
        let t = Capability::owner(&k, &hdr, b"pairs");
        assert_eq!(t.verify_owner_header(&k, &hdr), Ok(()));
        // The flags byte is outside both tags (the sender sets FLAG_CAP after tagging).
        let mut flagged = hdr;
        flagged[crate::wire::FLAGS_AT] = 0xff;
        assert_eq!(t.verify_owner_header(&k, &flagged), Ok(()));
        let mut other = hdr;
        other[32] ^= 1;
        assert_eq!(t.verify_owner_header(&k, &other), Err(CapError::BadTag));
        assert_eq!(
            t.verify_owner_header(&MountSecret::generate(), &hdr),
            Err(CapError::BadTag)
        );
        // The header tag is not the whole tag: a body-less forgery of it fails the full check.
        let mut forged = t.as_bytes().to_vec();
        forged[40..CAP_LEN].copy_from_slice(&t.as_bytes()[16..32]);
        let forged = Capability::from_slice(&forged).unwrap();
        assert_eq!(forged.verify_owner(&k, &hdr, b""), Err(CapError::BadTag));
        // A data capability's range words never pass as a header tag.
        let rw = Capability::issue(&k, &G, RIGHT_READ | RIGHT_WRITE, READ_TTL);
        assert_eq!(
            rw.verify_owner_header(&k, &hdr),
            Err(CapError::Rights("owner"))
        );
        let mut late = t.as_bytes().to_vec();
        late[8..16].copy_from_slice(&(now_ms() - 1).to_le_bytes());
        let late = Capability::from_slice(&late).unwrap();
        assert_eq!(late.verify_owner_header(&k, &hdr), Err(CapError::Expired));
    }
}
