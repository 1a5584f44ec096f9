//! One row of the doctor's table: a check's name, its outcome and, for a failure, the fix.

use serde::Serialize;

/// The message of the cross-instance rule (the master's, word for word).
pub const UNSHARED_MESSAGE: &str = lunakv_config::messages::UNSHARED_NAMESPACE;

/// Exit status when at least one check failed.
pub const EXIT_CHECK_FAILED: u8 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    Pass,
    Fail,
    Skip,
    /// Works, but not as configured (e.g. rdma asked, tcp served); does not fail the run.
    Warn,
}

impl Outcome {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            Outcome::Pass => "pass",
            Outcome::Fail => "fail",
            Outcome::Skip => "skip",
            Outcome::Warn => "warn",
        }
    }
}

/// One row of the table.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// Stable id (`master`, `store_clients`, ...), for scripts reading `--json`.
    pub name: &'static str,
    pub status: Outcome,
    /// What was seen (pass), what is wrong (fail), or why the check did not run (skip).
    pub detail: String,
    /// How to fix a failure.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

impl Check {
    pub(super) fn pass(name: &'static str, detail: impl Into<String>) -> Check {
        Check {
            name,
            status: Outcome::Pass,
            detail: detail.into(),
            fix: None,
        }
    }

    pub(super) fn fail(
        name: &'static str,
        detail: impl Into<String>,
        fix: impl Into<String>,
    ) -> Check {
        Check {
            name,
            status: Outcome::Fail,
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }

    pub(super) fn warn(
        name: &'static str,
        detail: impl Into<String>,
        fix: impl Into<String>,
    ) -> Check {
        Check {
            name,
            status: Outcome::Warn,
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }

    pub(super) fn skip(name: &'static str, why: impl Into<String>) -> Check {
        Check {
            name,
            status: Outcome::Skip,
            detail: why.into(),
            fix: None,
        }
    }
}
