//! Tenants in the core: namespaces, exact usage through every change of the index, quota
//! admission and the tenant's own eviction.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use lunakv_proto::{ErrorCode, scope_key};

use super::index::TenantUsage;
use super::tests::desc;
use super::*;
use crate::notifier::RecordingNotifier;

const BLOCK: u64 = 64;

fn core_with(quotas: &[(&str, u64)], multi: bool) -> Arc<MasterCore> {
    let cfg = CoreConfig {
        cluster_id: "c".into(),
        lease_ttl: Duration::from_secs(60),
        multi_tenants: multi,
        ..CoreConfig::default()
    };
    let core = MasterCore::new(cfg, 7, Arc::new(RecordingNotifier::default()));
    let q: BTreeMap<String, u64> = quotas.iter().map(|(t, b)| (t.to_string(), *b)).collect();
    core.set_tenant_quotas(&q);
    Arc::new(core)
}

fn one() -> PutOptions {
    PutOptions {
        replica_num: 1,
        ..PutOptions::default()
    }
}

async fn put(core: &MasterCore, key: &str, size: u64) -> Result<(), OpError> {
    core.put_start("cl", key, size, &one()).await?;
    core.put_end(key)
}

/// Each tenant's usage counted from scratch, object by object.
fn recount(core: &MasterCore) -> BTreeMap<String, TenantUsage> {
    let mut out: BTreeMap<String, TenantUsage> = core
        .tenant_quotas()
        .keys()
        .map(|t| (t.clone(), TenantUsage::default()))
        .collect();
    for shard in &core.shards {
        for (k, o) in shard.lock().iter() {
            let dram = o.replicas.iter().filter(|r| !r.disk).count() as u64;
            let dram_bytes = crate::alloc::align_up(o.size).unwrap_or(o.size) * dram;
            out.entry(index::tenant_of(k).to_string())
                .or_default()
                .add(TenantUsage {
                    objects: 1,
                    dram_bytes,
                    disk_objects: u64::from(o.replicas.iter().any(|r| r.disk)),
                    protected_bytes: if o.tier.protected() { dram_bytes } else { 0 },
                });
        }
    }
    out
}

fn assert_exact(core: &MasterCore, step: &str) {
    assert_eq!(core.tenant_usage(), recount(core), "after {step}");
}

#[tokio::test]
async fn usage_follows_every_change_of_the_index() {
    let core = core_with(&[], false);
    core.mount("cl", "c", desc("a:1", BLOCK * 64), vec![])
        .expect("mount a");
    core.mount("cl", "c", desc("b:1", BLOCK * 64), vec![])
        .expect("mount b");
    for i in 0..8 {
        for t in ["default", "t1", "t2"] {
            put(&core, &scope_key(t, &format!("k{i}")), BLOCK * (i + 1))
                .await
                .expect("put");
        }
    }
    assert_exact(&core, "puts");
    let u = core.tenant_usage();
    assert_eq!(u["t1"].objects, 8);
    assert_eq!(u["t1"].dram_bytes, BLOCK * 36);
    core.put_start("cl", &scope_key("t1", "open"), BLOCK, &one())
        .await
        .expect("open put");
    assert_eq!(
        core.tenant_usage()["t1"].objects,
        9,
        "a put in flight is charged"
    );
    core.put_revoke("cl", &scope_key("t1", "open"))
        .await
        .expect("revoke");
    assert_exact(&core, "revoke");
    core.remove(&scope_key("t2", "k0"), false)
        .await
        .expect("remove");
    assert_exact(&core, "remove");
    core.evict(BLOCK * 20).await;
    assert_exact(&core, "eviction");
    core.remove_all("t2", true).await;
    assert_exact(&core, "remove_all t2");
    assert!(
        !core.tenant_usage().contains_key("t2"),
        "an empty tenant has no row"
    );
    core.unmount("b:1").expect("unmount");
    assert_exact(&core, "unmount");
    // Which tenants keep objects after the unmount depends on where placement put them, so
    // only the invariant is asserted: every row left counts something.
    let left = core.tenant_usage();
    assert!(
        left.values().all(|u| u.objects > 0),
        "an emptied tenant keeps no row: {left:?}"
    );
}

#[tokio::test]
async fn the_same_key_in_two_tenants_is_two_objects() {
    let core = core_with(&[], false);
    core.mount("cl", "c", desc("a:1", BLOCK * 64), vec![])
        .expect("mount");
    put(&core, "k", BLOCK).await.expect("default");
    put(&core, &scope_key("t1", "k"), BLOCK * 2)
        .await
        .expect("t1");
    put(&core, &scope_key("t2", "k"), BLOCK * 3)
        .await
        .expect("t2");
    assert_eq!(core.get_replica_list("k").expect("default").size, BLOCK);
    assert_eq!(
        core.get_replica_list(&scope_key("t1", "k"))
            .expect("t1")
            .size,
        BLOCK * 2
    );
    assert_eq!(
        core.get_replica_list(&scope_key("t2", "k"))
            .expect("t2")
            .size,
        BLOCK * 3
    );
    assert_eq!(core.remove_all("t1", true).await, 1, "only t1's key goes");
    assert!(core.get_replica_list("k").is_ok());
    assert!(core.get_replica_list(&scope_key("t2", "k")).is_ok());
    let re = regex::Regex::new("^k$").expect("re");
    assert_eq!(core.remove_by_regex("t2", &re, true).await, 1);
    assert!(
        core.get_replica_list("k").is_ok(),
        "the default tenant's k stays"
    );
}

#[tokio::test]
async fn a_tenant_at_its_quota_evicts_its_own_objects_then_is_refused() {
    let core = core_with(&[("full", BLOCK * 4)], false);
    core.mount("cl", "c", desc("a:1", BLOCK * 64), vec![])
        .expect("mount");
    for i in 0..4 {
        put(&core, &scope_key("full", &format!("f{i}")), BLOCK)
            .await
            .expect("within quota");
        put(&core, &scope_key("other", &format!("o{i}")), BLOCK)
            .await
            .expect("other");
    }
    // At quota: the next put makes room from the tenant's own least recently used object.
    put(&core, &scope_key("full", "f4"), BLOCK)
        .await
        .expect("evicts its own");
    assert!(
        core.query_key(&scope_key("full", "f0")).is_none(),
        "its LRU went"
    );
    for i in 0..4 {
        assert!(
            core.query_key(&scope_key("other", &format!("o{i}")))
                .is_some(),
            "another tenant's objects are never evicted for a quota"
        );
    }
    assert_eq!(core.tenant_usage_of("full").dram_bytes, BLOCK * 4);
    // Every one of its objects leased: nothing of its own can go, so the put is refused.
    for i in 1..5 {
        core.get_replica_list(&scope_key("full", &format!("f{i}")))
            .expect("lease");
    }
    let e = core
        .put_start("cl", &scope_key("full", "f5"), BLOCK, &one())
        .await
        .expect_err("over quota");
    assert_eq!(e.code, ErrorCode::TenantQuotaExceeded);
    assert_eq!(e.code.as_i32(), -1700);
    assert!(
        e.message.contains("\"full\"") && e.message.contains("quota"),
        "{e:?}"
    );
    assert_eq!(core.tenant_quota_rejected()["full"], 1);
    // The other tenant, without a quota, is unaffected.
    put(&core, &scope_key("other", "o4"), BLOCK)
        .await
        .expect("other keeps putting");
    let e = core
        .put_start("cl", &scope_key("full", "big"), BLOCK * 5, &one())
        .await
        .expect_err("never fits");
    assert!(e.message.contains("can never fit"), "{e:?}");
}

#[tokio::test]
async fn racing_puts_of_one_tenant_never_pass_its_quota() {
    let core = core_with(&[("t", BLOCK * 4)], false);
    core.mount("cl", "c", desc("a:1", BLOCK * 64), vec![])
        .expect("mount");
    // Puts left open are never evictable, so exactly four fit.
    let tasks: Vec<_> = (0..16)
        .map(|i| {
            let core = core.clone();
            tokio::spawn(async move {
                core.put_start("cl", &scope_key("t", &format!("k{i}")), BLOCK, &one())
                    .await
                    .is_ok()
            })
        })
        .collect();
    let mut ok = 0;
    for t in tasks {
        ok += usize::from(t.await.expect("join"));
    }
    assert_eq!(ok, 4);
    assert_eq!(core.tenant_usage_of("t").dram_bytes, BLOCK * 4);
}

#[tokio::test]
async fn multi_tenant_mode_refuses_a_tenant_without_a_policy() {
    let core = core_with(&[("known", BLOCK * 8)], true);
    core.mount("cl", "c", desc("a:1", BLOCK * 64), vec![])
        .expect("mount");
    put(&core, &scope_key("known", "k"), BLOCK)
        .await
        .expect("registered");
    let e = core
        .put_start("cl", &scope_key("stranger", "k"), BLOCK, &one())
        .await
        .expect_err("unregistered");
    assert_eq!(e.code, ErrorCode::TenantNotRegistered);
    assert!(e.message.contains("stranger") && e.message.contains("/api/v1/tenant_quotas"));
    let e = core
        .put_start("cl", "plain", BLOCK, &one())
        .await
        .expect_err("default is not special");
    assert_eq!(e.code, ErrorCode::TenantNotRegistered);
}
