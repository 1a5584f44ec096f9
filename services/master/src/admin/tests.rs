//! Tests of [`super::upstream`]'s routes through the whole router, apart from it so the
//! handlers do not import the router that serves them.

use std::collections::HashMap;

use axum::body::Body;
use axum::http::StatusCode;

use super::upstream::{force_param, gib};
use crate::core::MasterCore;
use crate::metrics::Rpc;

#[test]
fn sizes_print_as_upstream_prints_them() {
    assert_eq!(gib(16 << 30), "16 GiB");
    assert_eq!(gib(1 << 29), "0.5 GiB");
    assert_eq!(gib(1 << 20), "0.000976562 GiB");
    assert_eq!(gib(0), "0 GiB");
    assert_eq!(gib(64 << 20), "0.0625 GiB");
}

#[tokio::test]
async fn remove_all_waits_for_the_rebuild_as_the_rpc_does() {
    use std::sync::Arc;
    use tower::ServiceExt;
    let core = Arc::new(MasterCore::new(
        crate::core::CoreConfig::default(),
        1,
        Arc::new(crate::notifier::RecordingNotifier::default()),
    ));
    // A restarted single master still waiting for a recorded segment's inventory: what it
    // removed now, the owner's remount would put back.
    let recovery = Arc::new(crate::ha::recovery::RecoveryGate::default());
    recovery.begin(
        ["seg:1".to_string()].into(),
        std::time::Duration::from_secs(3600),
    );
    let app = super::routes::router_full(
        crate::slot::CoreSlot::new(core.clone()),
        None,
        recovery.clone(),
        None,
    );
    let call = || {
        axum::http::Request::post("/api/v1/remove_all?force=true")
            .body(Body::empty())
            .expect("request")
    };
    let r = app.clone().oneshot(call()).await.expect("answer");
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body = axum::body::to_bytes(r.into_body(), 1 << 16)
        .await
        .expect("body");
    let text = String::from_utf8_lossy(&body);
    assert!(text.contains("rebuilding"), "{text}");
    let calls = |core: &MasterCore| {
        let name = format!("master_{}_requests_total ", Rpc::RemoveAll.name());
        lunakv_telemetry::render(&core.metrics.registry)
            .lines()
            .find_map(|l| l.strip_prefix(name.as_str()).map(str::to_owned))
    };
    assert_eq!(calls(&core).as_deref(), Some("0"));

    recovery.clear();
    let r = app.oneshot(call()).await.expect("answer");
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(calls(&core).as_deref(), Some("1"), "counted as the RPC");
}

#[test]
fn force_is_a_boolean_or_refused_by_name() {
    let q = |v: &str| HashMap::from([("force".to_string(), v.to_string())]);
    assert_eq!(force_param(&HashMap::new()), Ok(false));
    assert_eq!(force_param(&q("1")), Ok(true));
    assert_eq!(force_param(&q("true")), Ok(true));
    assert_eq!(force_param(&q("0")), Ok(false));
    assert!(
        force_param(&q("yes"))
            .unwrap_err()
            .to_string()
            .contains("force=")
    );
}
