//! Bytes held by puts that have not ended: per [`Holder`] and in all.
//!
//! A PutStart allocates its ranges at once, and nothing can evict them until the put ends, is
//! revoked or is discarded, so unfinished puts are the one thing a caller can pin without
//! limit. Two bounds keep one caller from blocking everyone's puts (docs/SECURITY.md, "One
//! caller cannot take the pool down"): each holder may hold `put_reservation_limit_ratio` of the pool, its first
//! put included, and all holders together `put_reservation_total_ratio`. A holder is the
//! caller's certificate identity or address, never the self-declared client id alone (a fresh
//! id per put used to reset the per-client limit).

use std::collections::HashMap;

use super::types::Holder;

/// Why a put's reservation is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Refusal {
    /// The holder already holds `held`, and `held + wanted` would pass `limit`.
    Holder { held: u64, limit: u64 },
    /// All unfinished puts hold `total`, and `total + wanted` would pass `limit`.
    Total { total: u64, limit: u64 },
}

#[derive(Default)]
pub(super) struct Reservations {
    by_holder: HashMap<Holder, u64, foldhash::quality::RandomState>,
    total: u64,
}

impl Reservations {
    /// Whether `holder` may reserve `wanted` more bytes under the two limits.
    pub(super) fn check(
        &self,
        holder: &Holder,
        wanted: u64,
        holder_limit: u64,
        total_limit: u64,
    ) -> Result<(), Refusal> {
        let held = self.held(holder);
        if held.saturating_add(wanted) > holder_limit {
            return Err(Refusal::Holder {
                held,
                limit: holder_limit,
            });
        }
        if self.total.saturating_add(wanted) > total_limit {
            return Err(Refusal::Total {
                total: self.total,
                limit: total_limit,
            });
        }
        Ok(())
    }

    pub(super) fn held(&self, holder: &Holder) -> u64 {
        self.by_holder.get(holder).copied().unwrap_or(0)
    }

    #[cfg(test)]
    pub(super) fn total(&self) -> u64 {
        self.total
    }

    pub(super) fn add(&mut self, holder: &Holder, bytes: u64) {
        match self.by_holder.get_mut(holder) {
            Some(held) => *held = held.saturating_add(bytes),
            None => {
                self.by_holder.insert(holder.clone(), bytes);
            }
        }
        self.total = self.total.saturating_add(bytes);
    }

    /// A put ended, was revoked or discarded: its bytes no longer count. A holder left with
    /// nothing loses its row, so the map holds only holders with puts in flight.
    pub(super) fn sub(&mut self, holder: &Holder, bytes: u64) {
        if let Some(held) = self.by_holder.get_mut(holder) {
            let took = bytes.min(*held);
            *held -= took;
            self.total = self.total.saturating_sub(took);
            if *held == 0 {
                self.by_holder.remove(holder);
            }
        }
    }

    /// Replaces every count with a recount (the sweep's, which corrects any exit the
    /// increments missed: a remove, an unmount, a writer's death).
    pub(super) fn recount(&mut self, counts: impl IntoIterator<Item = (Holder, u64)>) {
        self.by_holder.clear();
        self.total = 0;
        for (h, b) in counts {
            self.add(&h, b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> Holder {
        Holder::Address(std::net::IpAddr::from([127, 0, 0, last]))
    }

    #[test]
    fn a_holders_first_put_counts_against_its_limit() {
        let r = Reservations::default();
        assert_eq!(
            r.check(&ip(2), 101, 100, 1000),
            Err(Refusal::Holder {
                held: 0,
                limit: 100
            })
        );
        assert!(r.check(&ip(2), 100, 100, 1000).is_ok());
    }

    #[test]
    fn holders_together_stop_at_the_total_and_others_keep_their_own_room() {
        let mut r = Reservations::default();
        r.add(&ip(2), 60);
        r.add(&ip(3), 30);
        assert_eq!(
            r.check(&ip(4), 20, 100, 100),
            Err(Refusal::Total {
                total: 90,
                limit: 100
            })
        );
        assert!(r.check(&ip(4), 10, 100, 100).is_ok());
        r.sub(&ip(2), 60);
        assert_eq!(r.total(), 30);
        assert_eq!(r.held(&ip(2)), 0);
        assert!(r.check(&ip(4), 20, 100, 100).is_ok());
    }

    #[test]
    fn a_fresh_client_id_from_the_same_address_is_the_same_holder() {
        let caller = crate::core::types::Caller {
            peer: Some([127, 0, 0, 9].into()),
            ..Default::default()
        };
        let a = caller.holder("id-1");
        let b = caller.holder("id-2");
        assert_eq!(a, b);
        let mut r = Reservations::default();
        r.add(&a, 80);
        assert!(r.check(&b, 30, 100, 1000).is_err());
    }

    #[test]
    fn recount_replaces_every_row_and_the_total() {
        let mut r = Reservations::default();
        r.add(&ip(2), 50);
        r.recount([(ip(3), 7), (ip(3), 3)]);
        assert_eq!(r.held(&ip(2)), 0);
        assert_eq!(r.held(&ip(3)), 10);
        assert_eq!(r.total(), 10);
    }
}
