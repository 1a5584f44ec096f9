//! The SIGTERM/SIGINT wait every lunakv binary hands its server as the drain signal.

use std::future::Future;

use tokio::signal::unix::{Signal, SignalKind, signal};

/// Installs the SIGTERM and SIGINT handlers now and returns the future that resolves on the
/// first of them.
///
/// The handlers go in at the call, not at the first poll: a server prints its `listening` line
/// before it first polls its shutdown future, and a SIGTERM in that gap (a test, or kubelet
/// stopping a pod that just started) would otherwise hit the default action and kill the process
/// without a drain. Call it inside the Tokio runtime (`Runtime::enter` or an async `main`).
pub fn shutdown_signal(service: &'static str) -> impl Future<Output = ()> + Send + 'static {
    let term = install(SignalKind::terminate(), "SIGTERM", service);
    let int = install(SignalKind::interrupt(), "SIGINT", service);
    async move {
        tokio::select! {
            () = recv(term) => {}
            () = recv(int) => {}
        }
    }
}

fn install(kind: SignalKind, name: &str, service: &str) -> Option<Signal> {
    match signal(kind) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, "{service} cannot listen for {name}; it will not drain on it");
            None
        }
    }
}

async fn recv(s: Option<Signal>) {
    match s {
        Some(mut s) => {
            s.recv().await;
        }
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_signal_sent_before_the_first_poll_is_not_lost() {
        let wait = shutdown_signal("test");
        // SIGTERM to ourselves before anything polls `wait`: with lazy registration the default
        // action would end this test process.
        let pid = std::process::id().to_string();
        let sent = std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("kill");
        assert!(sent.success());
        tokio::time::timeout(std::time::Duration::from_secs(10), wait)
            .await
            .expect("the early SIGTERM resolves the wait");
    }
}
