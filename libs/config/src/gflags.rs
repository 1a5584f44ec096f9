//! gflags command lines, as upstream's `mooncake_master` and `mooncake_client` take them, turned
//! into what the services' clap parsers read.
//!
//! Scripts and manifests written for upstream pass flags the gflags way: `-rpc_port=50051`
//! (one dash), `-rpc_port 50051` (separate value), `--enable_ha` / `--noenable_ha` (booleans),
//! and upstream flags lunakv has no use for (`--rpc_thread_num=8`). clap alone reads the first as
//! `-r -p -c ...` and refuses the last. [`normalize`] rewrites the command line before clap sees
//! it, using the parser's own definitions, so every lunakv flag keeps one definition:
//! - one or two dashes before a long name (`-h` and `-V` stay clap's short flags);
//! - `--flag value` becomes `--flag=value`, so a value may start with `-`;
//! - booleans: bare `--flag` is true, `--noflag` is false, `--flag=false` as before;
//! - upstream flags in the caller's table are either dropped with a warning naming why
//!   ([`Upstream::Ignored`]) or refused with the fix ([`Upstream::Refused`]);
//! - anything else goes to clap unchanged in its `--name` form, which names it and suggests
//!   the closest flag.
//!
//! Hand-written because no maintained crate reads gflags syntax into clap: clap has no
//! single-dash long flags and no `--no` prefix.

use std::ffi::OsString;

/// What lunakv does with an upstream flag it does not define.
#[derive(Debug, Clone, Copy)]
pub enum Upstream {
    /// Accepted and dropped, with one warning line: why it has no effect here.
    Ignored(&'static str),
    /// Refused at startup: the reason and what to use instead.
    Refused(&'static str),
    /// Accepted, silently, only with the value that is lunakv's behaviour (upstream's default);
    /// any other value is refused with the fix.
    OnlyValue {
        value: &'static str,
        fix: &'static str,
    },
}

impl Upstream {
    /// What `value` gets: `Ok(Some(why))` ignored with a warning, `Ok(None)` accepted as what
    /// lunakv does anyway, `Err(fix)` refused.
    pub fn judge(self, value: &str) -> Result<Option<&'static str>, &'static str> {
        match self {
            Upstream::Ignored(why) => Ok(Some(why)),
            Upstream::Refused(fix) => Err(fix),
            Upstream::OnlyValue { value: v, .. } if v == value => Ok(None),
            Upstream::OnlyValue { fix, .. } => Err(fix),
        }
    }
}

/// An upstream flag lunakv does not define, with how upstream spells its value.
#[derive(Debug, Clone, Copy)]
pub struct UpstreamFlag {
    pub name: &'static str,
    /// gflags booleans never take a separate value (`-flag true` is a flag and a positional).
    pub boolean: bool,
    pub treatment: Upstream,
}

/// The command line clap should parse, and the ignored upstream flags for the warning lines.
#[derive(Debug, Clone, PartialEq)]
pub struct Normalized {
    pub args: Vec<OsString>,
    /// `(flag, value, why)` of every [`Upstream::Ignored`] flag given.
    pub ignored: Vec<(String, String, &'static str)>,
}

impl Normalized {
    /// One warning line per ignored flag, for the service's log.
    pub fn warnings(&self) -> Vec<String> {
        self.ignored
            .iter()
            .map(|(flag, value, why)| {
                format!("--{flag}={value}: upstream Mooncake flag, ignored by lunakv: {why}")
            })
            .collect()
    }
}

/// An upstream flag lunakv refuses, named with the fix.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("--{flag}{}: upstream Mooncake flag that lunakv does not support: {fix}", value.as_ref().map(|v| format!("={v}")).unwrap_or_default())]
pub struct RefusedFlag {
    pub flag: String,
    pub value: Option<String>,
    pub fix: &'static str,
}

/// Rewrites `args` (with the program name first) for `cmd`, as described in the module docs.
pub fn normalize(
    cmd: &clap::Command,
    upstream: &[UpstreamFlag],
    args: impl IntoIterator<Item = OsString>,
) -> Result<Normalized, RefusedFlag> {
    let mut it = args.into_iter();
    let mut out: Vec<OsString> = it.next().into_iter().collect();
    let mut ignored = Vec::new();
    while let Some(arg) = it.next() {
        let Some(text) = arg.to_str() else {
            out.push(arg);
            continue;
        };
        if text == "--" {
            out.push(arg);
            out.extend(it);
            break;
        }
        let Some(body) = long_body(text) else {
            out.push(arg);
            continue;
        };
        let (name, value) = match body.split_once('=') {
            Some((n, v)) => (n, Some(v)),
            None => (body, None),
        };
        if let Some(def) = find_long(cmd, name) {
            let long = def.get_long().unwrap_or(name);
            if !def.get_action().takes_values() {
                // SetTrue-style flags take no value at all: true is the flag, false is nothing.
                match value {
                    None | Some("true" | "1" | "yes") => out.push(format!("--{long}").into()),
                    Some("false" | "0" | "no") => {}
                    Some(v) => out.push(format!("--{long}={v}").into()),
                }
            } else if is_boolean(def) {
                out.push(format!("--{long}={}", value.unwrap_or("true")).into());
            } else {
                match value.map(str::to_string).or_else(|| next_text(&mut it)) {
                    Some(v) => out.push(format!("--{long}={v}").into()),
                    // clap reports the missing value.
                    None => out.push(format!("--{long}").into()),
                }
            }
            continue;
        }
        if value.is_none()
            && let Some(positive) = name.strip_prefix("no")
            && let Some(def) = find_long(cmd, positive)
            && is_boolean(def)
        {
            let long = def.get_long().unwrap_or(positive);
            if def.get_action().takes_values() {
                out.push(format!("--{long}=false").into());
            }
            continue;
        }
        let up = upstream
            .iter()
            .find(|u| u.name == name)
            .map(|u| (u, true))
            .or_else(|| {
                let positive = name.strip_prefix("no")?;
                let u = upstream.iter().find(|u| u.name == positive && u.boolean)?;
                Some((u, false))
            });
        if let Some((u, positive)) = up {
            let value = match value {
                Some(v) => Some(v.to_string()),
                None if u.boolean => Some(positive.to_string()),
                None => next_text(&mut it),
            };
            match u.treatment.judge(value.as_deref().unwrap_or_default()) {
                Ok(Some(why)) => {
                    ignored.push((u.name.to_string(), value.unwrap_or_default(), why));
                }
                Ok(None) => {}
                Err(fix) => {
                    return Err(RefusedFlag {
                        flag: u.name.to_string(),
                        value,
                        fix,
                    });
                }
            }
            continue;
        }
        // Unknown: clap names it (in its `--` form) and suggests the closest flag.
        out.push(format!("--{body}").into());
    }
    Ok(Normalized { args: out, ignored })
}

/// The long name (and `=value`) of `--name...` or gflags' `-name...`; `None` for short flags
/// (`-h`), negative numbers and positionals.
fn long_body(text: &str) -> Option<&str> {
    if let Some(b) = text.strip_prefix("--") {
        return (!b.is_empty()).then_some(b);
    }
    let b = text.strip_prefix('-')?;
    let name_len = b.find('=').unwrap_or(b.len());
    let starts_alpha = b.chars().next().is_some_and(|c| c.is_ascii_alphabetic());
    (starts_alpha && name_len >= 2).then_some(b)
}

fn next_text(it: &mut impl Iterator<Item = OsString>) -> Option<String> {
    it.next().map(|v| v.to_string_lossy().into_owned())
}

/// The argument whose long name or alias is `name` (dashes and underscores alike, as upstream
/// and llm-d write either).
fn find_long<'c>(cmd: &'c clap::Command, name: &str) -> Option<&'c clap::Arg> {
    let same = |a: &str| a == name || a.replace('-', "_") == name.replace('-', "_");
    cmd.get_arguments().find(|a| {
        a.get_long().is_some_and(same) || a.get_all_aliases().into_iter().flatten().any(same)
    })
}

/// A flag that takes no value or an optional `=value` that defaults to true.
fn is_boolean(a: &clap::Arg) -> bool {
    !a.get_action().takes_values() || a.get_num_args().is_some_and(|n| n.min_values() == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cmd() -> clap::Command {
        clap::Command::new("m")
            .arg(clap::Arg::new("rpc_port").long("rpc_port").alias("port"))
            .arg(clap::Arg::new("eviction_ratio").long("eviction_ratio"))
            .arg(
                clap::Arg::new("enable_ha")
                    .long("enable_ha")
                    .num_args(0..=1)
                    .require_equals(true)
                    .default_missing_value("true"),
            )
            .arg(
                clap::Arg::new("verbose")
                    .long("verbose")
                    .action(clap::ArgAction::SetTrue),
            )
    }

    const UP: &[UpstreamFlag] = &[
        UpstreamFlag {
            name: "rpc_thread_num",
            boolean: false,
            treatment: Upstream::Ignored("tokio sizes its own pool"),
        },
        UpstreamFlag {
            name: "enable_cxl",
            boolean: true,
            treatment: Upstream::Refused("lunakv has no CXL memory support"),
        },
        UpstreamFlag {
            name: "allocation_strategy",
            boolean: false,
            treatment: Upstream::OnlyValue {
                value: "random",
                fix: "only random placement",
            },
        },
        UpstreamFlag {
            name: "rpc_enable_tcp_no_delay",
            boolean: true,
            treatment: Upstream::Ignored("always on"),
        },
    ];

    fn norm(args: &[&str]) -> Result<Normalized, RefusedFlag> {
        normalize(
            &cmd(),
            UP,
            std::iter::once("m")
                .chain(args.iter().copied())
                .map(OsString::from),
        )
    }

    fn args(a: &[&str]) -> Vec<String> {
        norm(a)
            .unwrap()
            .args
            .into_iter()
            .skip(1)
            .map(|s| s.into_string().unwrap())
            .collect()
    }

    #[test]
    fn single_dash_and_separate_values_become_clap_long_flags() {
        assert_eq!(
            args(&["-rpc_port=50051", "-eviction_ratio", "0.1"]),
            ["--rpc_port=50051", "--eviction_ratio=0.1"]
        );
        assert_eq!(args(&["--rpc_port", "-1"]), ["--rpc_port=-1"]);
        assert_eq!(args(&["-port=1"]), ["--rpc_port=1"], "aliases resolve");
        assert_eq!(args(&["-h", "-V"]), ["-h", "-V"], "short flags stay");
        assert_eq!(args(&["--", "-rpc_port"]), ["--", "-rpc_port"]);
    }

    #[test]
    fn booleans_take_gflags_forms() {
        assert_eq!(args(&["-enable_ha"]), ["--enable_ha=true"]);
        assert_eq!(args(&["--noenable_ha"]), ["--enable_ha=false"]);
        assert_eq!(args(&["-enable_ha=false"]), ["--enable_ha=false"]);
        assert_eq!(args(&["-verbose"]), ["--verbose"]);
        assert!(args(&["--noverbose", "-verbose=false"]).is_empty());
        let parsed = cmd()
            .try_get_matches_from(norm(&["-verbose", "--noenable_ha"]).unwrap().args)
            .unwrap();
        assert!(parsed.get_flag("verbose"));
        assert_eq!(
            parsed.get_one::<String>("enable_ha").map(String::as_str),
            Some("false")
        );
    }

    #[test]
    fn upstream_flags_are_ignored_with_a_reason_or_refused_with_the_fix() {
        let n = norm(&[
            "-rpc_thread_num",
            "8",
            "--norpc_enable_tcp_no_delay",
            "-rpc_port=1",
        ])
        .unwrap();
        assert_eq!(n.args.len(), 2, "{:?}", n.args);
        assert_eq!(
            n.ignored,
            [
                (
                    "rpc_thread_num".into(),
                    "8".into(),
                    "tokio sizes its own pool"
                ),
                (
                    "rpc_enable_tcp_no_delay".into(),
                    "false".into(),
                    "always on"
                ),
            ]
        );
        assert!(n.warnings()[0].contains("--rpc_thread_num=8"));
        let n = norm(&["-allocation_strategy", "random"]).unwrap();
        assert!(n.ignored.is_empty() && n.args.len() == 1, "{n:?}");
        let e = norm(&["-allocation_strategy=free_ratio_first"])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("free_ratio_first") && e.contains("only random"),
            "{e}"
        );
        let e = norm(&["-enable_cxl"]).unwrap_err().to_string();
        assert!(
            e.contains("--enable_cxl=true") && e.contains("no CXL"),
            "{e}"
        );
    }

    #[test]
    fn unknown_flags_reach_clap_in_long_form() {
        assert_eq!(args(&["-rpc_prot=1"]), ["--rpc_prot=1"]);
        let e = cmd()
            .try_get_matches_from(norm(&["-rpc_prot=1"]).unwrap().args)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--rpc_prot") && e.contains("--rpc_port"), "{e}");
    }
}
