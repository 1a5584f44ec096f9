//! Tenants: each tenant's usage (kept by [`super::index::Index`]) and the quota admission of
//! its puts (upstream's `--enable_multi_tenants`; docs/TENANTS.md).
//!
//! A put of a tenant with a quota reserves its bytes before it is placed; the reservation is
//! dropped once the placed object is in the index (which then charges it), so two puts of one
//! tenant racing for its last bytes cannot both pass. When the bytes do not fit, the tenant's
//! own least recently used objects are evicted first (never another tenant's), then the put is
//! refused with upstream's TENANT_QUOTA_EXCEEDED (-1700).

use std::collections::{BTreeMap, HashMap};

use lunakv_proto::ErrorCode;

use crate::alloc::align_up;

use super::index::{TenantUsage, tenant_of};
use super::state::MasterCore;
use super::types::{OpError, PutOptions};

/// Eviction passes a put makes in its own tenant before it is refused (upstream makes two).
const QUOTA_EVICTION_TRIES: usize = 2;

/// A put's bytes reserved against its tenant's quota until the object is in the index.
pub(super) struct QuotaHold<'a> {
    core: &'a MasterCore,
    tenant: String,
    bytes: u64,
}

impl Drop for QuotaHold<'_> {
    fn drop(&mut self) {
        let mut pending = self.core.quota_pending.lock();
        if let Some(p) = pending.get_mut(&self.tenant) {
            *p = p.saturating_sub(self.bytes);
            if *p == 0 {
                pending.remove(&self.tenant);
            }
        }
    }
}

impl MasterCore {
    /// Every tenant's usage: those holding objects, and those with a quota.
    pub fn tenant_usage(&self) -> BTreeMap<String, TenantUsage> {
        let mut out: BTreeMap<String, TenantUsage> = self
            .cfg
            .quotas
            .read()
            .keys()
            .map(|t| (t.clone(), TenantUsage::default()))
            .collect();
        for shard in &self.shards {
            for (t, u) in shard.lock().usage().iter() {
                out.entry(t.to_string()).or_default().add(*u);
            }
        }
        out
    }

    /// One tenant's usage (a lock per shard).
    pub fn tenant_usage_of(&self, tenant: &str) -> TenantUsage {
        let mut total = TenantUsage::default();
        for shard in &self.shards {
            total.add(shard.lock().usage_of(tenant));
        }
        total
    }

    /// The quota policy in force: tenant -> bytes.
    pub fn tenant_quotas(&self) -> BTreeMap<String, u64> {
        self.cfg
            .quotas
            .read()
            .iter()
            .map(|(t, q)| (t.clone(), *q))
            .collect()
    }

    /// Replaces the quota policy (at start, and after each admin change).
    pub fn set_tenant_quotas(&self, quotas: &BTreeMap<String, u64>) {
        *self.cfg.quotas.write() = quotas.iter().map(|(t, q)| (t.clone(), *q)).collect();
    }

    /// Puts refused for each tenant's quota since the start.
    pub fn tenant_quota_rejected(&self) -> HashMap<String, u64> {
        self.quota_rejected.lock().clone()
    }

    /// Admits a put of `size` bytes x `replica_num` under `key`'s tenant: `None` when the
    /// tenant has no quota (nothing to hold), else the reservation to keep until the object is
    /// placed. Evicts the tenant's own objects to make room.
    pub(super) async fn admit_tenant(
        &self,
        key: &str,
        size: u64,
        opts: &PutOptions,
    ) -> Result<Option<QuotaHold<'_>>, OpError> {
        let tenant = tenant_of(key);
        let quota = self.cfg.quotas.read().get(tenant).copied();
        let Some(quota) = quota else {
            if self.cfg.multi_tenants {
                self.metrics.tenant_not_registered();
                return Err(OpError::new(
                    ErrorCode::TenantNotRegistered,
                    format!(
                        "tenant {tenant:?} has no quota policy and this master runs with \
                         --enable_multi_tenants: add it to the policy file, or PUT \
                         /api/v1/tenant_quotas?tenant_id={tenant} on the master's HTTP port"
                    ),
                ));
            }
            return Ok(None);
        };
        let need = align_up(size)
            .unwrap_or(u64::MAX)
            .saturating_mul(u64::from(opts.replica_num.max(1)));
        let mut evictions = 0;
        loop {
            let (short, used, held) = {
                // Lock order: the pending table, then each shard (nothing takes them the other
                // way round), so no put of this tenant is placed between the sum and the hold.
                let mut pending = self.quota_pending.lock();
                let held = pending.get(tenant).copied().unwrap_or(0);
                let used = self.tenant_usage_of(tenant).dram_bytes;
                let total = used.saturating_add(held).saturating_add(need);
                if total <= quota {
                    *pending.entry(tenant.to_string()).or_default() += need;
                    return Ok(Some(QuotaHold {
                        core: self,
                        tenant: tenant.to_string(),
                        bytes: need,
                    }));
                }
                (total - quota, used, held)
            };
            if need > quota {
                self.metrics.tenant_quota_rejected(tenant);
                return Err(OpError::new(
                    ErrorCode::TenantQuotaExceeded,
                    format!(
                        "a put of {need} bytes can never fit tenant {tenant:?}'s quota of \
                         {quota} bytes: raise the quota or split the object"
                    ),
                ));
            }
            if evictions == QUOTA_EVICTION_TRIES {
                *self
                    .quota_rejected
                    .lock()
                    .entry(tenant.to_string())
                    .or_default() += 1;
                self.metrics.tenant_quota_rejected(tenant);
                return Err(OpError::new(
                    ErrorCode::TenantQuotaExceeded,
                    format!(
                        "tenant {tenant:?} is at its quota of {quota} bytes ({used} held, \
                         {held} being put) and this put needs {need} more; none of its own \
                         objects could be evicted (leased, pinned or being put): raise its \
                         quota, remove some of its objects, or retry once its reads end"
                    ),
                ));
            }
            evictions += 1;
            self.evict_matching(short, |k| tenant_of(k) == tenant).await;
        }
    }
}
