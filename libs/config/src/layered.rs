//! The one layered loader every service's key-value configuration goes through.
//!
//! Layers, lowest first: the type's serde defaults < a YAML/JSON file < the environment
//! (`<PREFIX><KEY>`) < command-line flags. Every layer speaks the same key names, which are the
//! fields of the config struct; a key's type (number, boolean, string) is read off the
//! serialized defaults, so adding a key means adding the field (and its default and flag)
//! and nothing here. Keys upstream has but lunakv does not implement are judged by the
//! service's [`UpstreamFlag`] table: ignored with a warning, or refused with the fix. Any other
//! unknown key is an error naming it and the closest valid keys. The service's own
//! `validate()` then checks ranges.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_norway::{Mapping, Value};

use crate::gflags::UpstreamFlag;

/// What a service tells the loader about itself.
#[derive(Debug, Clone, Copy)]
pub struct Schema {
    /// The service's name in messages (`"master"`: "unknown master config key ...").
    pub service: &'static str,
    /// Prefix of the environment variables that set keys (`LUNAKV_MASTER_`).
    pub env_prefix: &'static str,
    /// Upstream keys lunakv does not define, each ignored or refused.
    pub upstream: &'static [UpstreamFlag],
}

/// Where configuration comes from; each later layer overrides the earlier ones.
#[derive(Debug, Clone, Default)]
pub struct Sources {
    /// The config file (`--config master.yaml`).
    pub file: Option<PathBuf>,
    /// Command-line values by key name (`("rpc_port", "50052")`).
    pub flags: Vec<(String, String)>,
}

/// A loaded configuration and the warnings the caller should log.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadedLayers<T> {
    pub config: T,
    pub warnings: Vec<String>,
}

/// A configuration error of a layered service config. Messages name the key, the value and
/// the fix.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LayeredError {
    #[error("cannot read {service} config {path}: {message}")]
    Read {
        service: &'static str,
        path: String,
        message: String,
    },
    #[error("{service} config {path} is not valid YAML: {message}")]
    Parse {
        service: &'static str,
        path: String,
        message: String,
    },
    #[error("{service} config {path} must be a mapping of key: value, got {got}")]
    NotAMapping {
        service: &'static str,
        path: String,
        got: String,
    },
    #[error("unknown {service} config key {key:?} in {source_name}{}", did_you_mean(.suggestions, .valid))]
    UnknownKey {
        service: &'static str,
        key: String,
        source_name: String,
        suggestions: Vec<String>,
        /// Every valid key, listed when nothing is close.
        valid: Vec<String>,
    },
    #[error("{key} = {value:?} (from {source_name}) is not a valid {expected}: {fix}")]
    BadValue {
        key: String,
        value: String,
        source_name: String,
        expected: String,
        fix: String,
    },
    #[error("{key} (from {source_name}) is an upstream setting lunakv does not support: {fix}")]
    Unsupported {
        key: String,
        source_name: String,
        fix: &'static str,
    },
    #[error("{field} = {value} is invalid: {fix}")]
    Invalid {
        field: &'static str,
        value: String,
        fix: String,
    },
}

fn did_you_mean(s: &[String], valid: &[String]) -> String {
    if s.is_empty() {
        format!("; valid keys: {}", valid.join(", "))
    } else {
        format!("; did you mean {}?", s.join(" or "))
    }
}

/// The type a string from the environment or a flag is parsed as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Str,
    Num,
    Bool,
}

/// The keys of `T` in field order, with their kinds, read off `T::default()` serialized.
fn keys<T: Default + Serialize>() -> Vec<(String, Kind)> {
    let Ok(Value::Mapping(m)) = serde_norway::to_value(T::default()) else {
        return Vec::new();
    };
    m.into_iter()
        .filter_map(|(k, v)| {
            let Value::String(k) = k else { return None };
            let kind = match v {
                Value::Number(_) => Kind::Num,
                Value::Bool(_) => Kind::Bool,
                _ => Kind::Str,
            };
            Some((k, kind))
        })
        .collect()
}

/// Turns serialized flag values (a clap struct with `Option` fields, serialized) into
/// `(key, text)` pairs: unset (`None`) fields are left out, and a list is one comma-separated
/// text (`--enable-tls=prefiller,decoder`).
pub fn flags_of<A: Serialize>(args: &A) -> Vec<(String, String)> {
    let Ok(Value::Mapping(m)) = serde_norway::to_value(args) else {
        return Vec::new();
    };
    m.into_iter()
        .filter_map(|(k, v)| {
            let Value::String(k) = k else { return None };
            let text = match v {
                Value::String(s) => s,
                Value::Bool(b) => b.to_string(),
                Value::Number(n) => n.to_string(),
                Value::Sequence(items) => items
                    .iter()
                    .filter_map(|v| match v {
                        Value::String(s) => Some(s.clone()),
                        Value::Number(n) => Some(n.to_string()),
                        _ => None,
                    })
                    .collect::<Vec<_>>()
                    .join(","),
                _ => return None,
            };
            Some((k, text))
        })
        .collect()
}

/// Loads `T` from its layers. `env` reads one environment variable (production passes
/// [`crate::process_env`]; tests pass a map) and is asked for `<PREFIX><KEY>` of every known
/// and upstream key, so unrelated variables under the prefix are never mistaken for typos.
/// The caller validates the result.
pub fn load<T>(
    schema: &Schema,
    sources: &Sources,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<LoadedLayers<T>, LayeredError>
where
    T: Default + Serialize + DeserializeOwned,
{
    let file = match &sources.file {
        Some(path) => Some(read_file(schema, path)?),
        None => None,
    };
    load_named(
        schema,
        &Names::default(),
        file.as_ref(),
        &sources.flags,
        env,
    )
}

/// How a service names its keys outside the config struct, where those names predate the
/// loader and are contracts: the store's environment variables are upstream's
/// (`MOONCAKE_OFFLOAD_FILE_STORAGE_PATH`) or already deployed (`LUNAKV_BIND_RETRY_SEC`), not
/// one prefix; the sidecar's file keys have llm-d's newer aliases (`model-server-port`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Names<'a> {
    /// `(key, VARIABLE)`: the keys the environment sets, each under its own name. `None`: every
    /// key (and upstream key) is read from `<env_prefix><KEY>`.
    pub env: Option<&'a [(&'a str, &'a str)]>,
    /// `(alias, key)`: another name of a key in every layer. Where a layer gives both, the
    /// alias wins (upstream's newer name over the older one).
    pub aliases: &'a [(&'a str, &'a str)],
}

/// A configuration file's text and the name messages give it (its path, or the flag that
/// carried it inline).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileText {
    pub name: String,
    pub text: String,
}

/// Reads the file at `path` for [`load_named`]; an unreadable file is an error naming it.
pub fn read_file(schema: &Schema, path: &Path) -> Result<FileText, LayeredError> {
    let text = std::fs::read_to_string(path).map_err(|e| LayeredError::Read {
        service: schema.service,
        path: path.display().to_string(),
        message: e.to_string(),
    })?;
    Ok(FileText {
        name: path.display().to_string(),
        text,
    })
}

/// [`load`] for services whose environment variables or aliases are not the plain key names
/// ([`Names`]), or whose file text comes from elsewhere than a path (the sidecar's inline
/// `--configuration`). A value that `T` refuses is reported with the layer it came from.
pub fn load_named<T>(
    schema: &Schema,
    names: &Names<'_>,
    file: Option<&FileText>,
    flags: &[(String, String)],
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<LoadedLayers<T>, LayeredError>
where
    T: Default + Serialize + DeserializeOwned,
{
    let known = keys::<T>();
    let loader = Loader {
        schema,
        known: &known,
        aliases: names.aliases,
    };
    let mut merged = Mapping::new();
    let mut warnings = Vec::new();
    if let Some(file) = file {
        let layer = loader.parse_file(&file.name, &file.text)?;
        loader.merge::<T>(&mut merged, layer, &file.name, &mut warnings)?;
    }
    let mut env_layer = Mapping::new();
    let vars: Vec<(&str, String)> = match names.env {
        Some(table) => table.iter().map(|(k, v)| (*k, v.to_string())).collect(),
        None => known
            .iter()
            .map(|(k, _)| k.as_str())
            .chain(schema.upstream.iter().map(|u| u.name))
            .map(|k| {
                (
                    k,
                    format!("{}{}", schema.env_prefix, k.to_ascii_uppercase()),
                )
            })
            .collect(),
    };
    for (key, var) in vars {
        if let Some(value) = env(&var).filter(|v| !v.is_empty()) {
            let source = format!("environment variable {var}");
            let value = loader.typed(key, &value, &source)?;
            loader.check_alone::<T>(key, &value, &source)?;
            env_layer.insert(Value::String(key.to_string()), value);
        }
    }
    loader.merge::<T>(&mut merged, env_layer, "the environment", &mut warnings)?;
    let mut flag_layer = Mapping::new();
    for (key, value) in flags {
        let source = format!("flag --{key}");
        let value = loader.typed(key, value, &source)?;
        loader.check_alone::<T>(key, &value, &source)?;
        flag_layer.insert(Value::String(key.clone()), value);
    }
    loader.merge::<T>(&mut merged, flag_layer, "the command line", &mut warnings)?;

    let config: T = serde_norway::from_value(Value::Mapping(merged.clone()))
        // Every value was checked alone, so this is a combination serde refuses; find the key.
        .map_err(|e| bad_value_from_serde::<T>(&merged, &e.to_string()))?;
    Ok(LoadedLayers { config, warnings })
}

struct Loader<'a> {
    schema: &'a Schema,
    known: &'a [(String, Kind)],
    aliases: &'a [(&'a str, &'a str)],
}

impl Loader<'_> {
    fn parse_file(&self, name: &str, text: &str) -> Result<Mapping, LayeredError> {
        if text.trim().is_empty() {
            // An empty file is an empty configuration.
            return Ok(Mapping::new());
        }
        let value: Value = serde_norway::from_str(text).map_err(|e| LayeredError::Parse {
            service: self.schema.service,
            path: name.to_string(),
            message: e.to_string(),
        })?;
        match value {
            Value::Mapping(m) => Ok(m),
            // An empty file is an empty configuration.
            Value::Null => Ok(Mapping::new()),
            other => Err(LayeredError::NotAMapping {
                service: self.schema.service,
                path: name.to_string(),
                got: describe(&other).to_string(),
            }),
        }
    }

    fn unknown(&self, key: String, source_name: &str, suggestions: Vec<String>) -> LayeredError {
        LayeredError::UnknownKey {
            service: self.schema.service,
            key,
            source_name: source_name.to_string(),
            suggestions,
            valid: self.known.iter().map(|(k, _)| k.clone()).collect(),
        }
    }

    /// Merges `layer` over `into`, dropping ignored keys (with a warning), refusing unknown
    /// ones and values `T` refuses (naming `source_name`), and resolving aliases (an alias
    /// beats its key within one layer).
    fn merge<T>(
        &self,
        into: &mut Mapping,
        layer: Mapping,
        source_name: &str,
        warnings: &mut Vec<String>,
    ) -> Result<(), LayeredError>
    where
        T: Default + Serialize + DeserializeOwned,
    {
        let mut aliased = Vec::new();
        for (k, v) in layer {
            let key = match &k {
                Value::String(s) => s.clone(),
                other => return Err(self.unknown(format!("{other:?}"), source_name, Vec::new())),
            };
            if let Some(u) = self.schema.upstream.iter().find(|u| u.name == key) {
                let text = match &v {
                    Value::String(t) => t.clone(),
                    Value::Bool(b) => b.to_string(),
                    Value::Number(n) => n.to_string(),
                    _ => String::new(),
                };
                match u.treatment.judge(&text) {
                    Ok(Some(why)) => warnings.push(format!(
                        "{key} (from {source_name}) is an upstream Mooncake setting lunakv does not \
                         implement; ignored: {why}"
                    )),
                    Ok(None) => {}
                    Err(fix) => {
                        return Err(LayeredError::Unsupported {
                            key,
                            source_name: source_name.to_string(),
                            fix,
                        });
                    }
                }
                continue;
            }
            if let Some((_, target)) = self.aliases.iter().find(|(a, _)| *a == key) {
                aliased.push((target.to_string(), v));
                continue;
            }
            if !self.known.iter().any(|(name, _)| *name == key) {
                let suggestions = suggest(self.known, &key);
                return Err(self.unknown(key, source_name, suggestions));
            }
            check_alone::<T>(&key, &v, source_name)?;
            into.insert(k, v);
        }
        for (key, v) in aliased {
            check_alone::<T>(&key, &v, source_name)?;
            into.insert(Value::String(key), v);
        }
        Ok(())
    }

    /// Refuses a value from the environment or a flag that `T` refuses, naming its variable
    /// or flag (the layer-wide check in [`Self::merge`] could only name the layer).
    fn check_alone<T>(&self, key: &str, value: &Value, source: &str) -> Result<(), LayeredError>
    where
        T: Default + Serialize + DeserializeOwned,
    {
        let target = self
            .aliases
            .iter()
            .find(|(a, _)| *a == key)
            .map_or(key, |(_, k)| *k);
        if self.known.iter().any(|(k, _)| k == target) {
            check_alone::<T>(target, value, source)?;
        }
        Ok(())
    }

    /// Turns a string from env or a flag into the YAML value its key expects.
    fn typed(&self, key: &str, raw: &str, source: &str) -> Result<Value, LayeredError> {
        let target = self
            .aliases
            .iter()
            .find(|(a, _)| *a == key)
            .map_or(key, |(_, k)| *k);
        let kind = self
            .known
            .iter()
            .find(|(k, _)| k == target)
            .map(|(_, kind)| *kind);
        let bad = |expected: &str, fix: &str| LayeredError::BadValue {
            key: key.to_string(),
            value: raw.to_string(),
            source_name: source.to_string(),
            expected: expected.to_string(),
            fix: fix.to_string(),
        };
        match kind {
            // Unknown and ignored keys are sorted out by merge(); keep the text.
            None | Some(Kind::Str) => Ok(Value::String(raw.to_string())),
            Some(Kind::Bool) => match raw.trim().to_ascii_lowercase().as_str() {
                "true" | "1" => Ok(Value::Bool(true)),
                "false" | "0" => Ok(Value::Bool(false)),
                _ => Err(bad("boolean", "write true or false")),
            },
            Some(Kind::Num) => {
                let t = raw.trim();
                if let Ok(n) = t.parse::<u64>() {
                    Ok(Value::Number(n.into()))
                } else if let Ok(f) = t.parse::<f64>() {
                    Ok(Value::Number(f.into()))
                } else {
                    Err(bad("number", "write a plain number such as 5000 or 0.95"))
                }
            }
        }
    }
}

fn describe(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Sequence(_) => "a list",
        Value::Mapping(_) => "a mapping",
        Value::Tagged(_) => "a tagged value",
    }
}

fn show(v: &Value) -> String {
    serde_norway::to_string(v)
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// The default of `key` as the messages show it.
fn default_of<T: Default + Serialize>(key: &str) -> String {
    serde_norway::to_value(T::default())
        .ok()
        .and_then(|d| d.get(key).map(show))
        .unwrap_or_default()
}

/// Refuses `value` for `key` when `T` does, naming where it came from.
fn check_alone<T>(key: &str, value: &Value, source_name: &str) -> Result<(), LayeredError>
where
    T: Default + Serialize + DeserializeOwned,
{
    let mut one = Mapping::new();
    one.insert(Value::String(key.to_string()), value.clone());
    match serde_norway::from_value::<T>(Value::Mapping(one)) {
        Ok(_) => Ok(()),
        Err(e) => {
            let message = e.to_string();
            let detail = message.split(" at line").next().unwrap_or(&message);
            Err(LayeredError::BadValue {
                key: key.to_string(),
                value: match value {
                    // The text as given, not YAML-quoted: `"eighty"`, not `'"eighty"'`.
                    Value::String(s) => s.clone(),
                    other => show(other),
                },
                source_name: source_name.to_string(),
                expected: format!("value ({detail})"),
                fix: format!("use a value like the default, {}", default_of::<T>(key)),
            })
        }
    }
}

fn bad_value_from_serde<T>(merged: &Mapping, message: &str) -> LayeredError
where
    T: Default + Serialize + DeserializeOwned,
{
    // serde_norway does not always name the field; find it by deserializing one key at a time.
    let culprit = merged.iter().find(|(k, v)| {
        let mut one = Mapping::new();
        one.insert((*k).clone(), (*v).clone());
        serde_norway::from_value::<T>(Value::Mapping(one)).is_err()
    });
    let show = |v: &Value| {
        serde_norway::to_string(v)
            .unwrap_or_default()
            .trim()
            .to_string()
    };
    let Some((Value::String(key), value)) = culprit else {
        return LayeredError::BadValue {
            key: "(unknown)".to_string(),
            value: String::new(),
            source_name: "the merged configuration".to_string(),
            expected: "configuration".to_string(),
            fix: message.to_string(),
        };
    };
    let default = serde_norway::to_value(T::default())
        .ok()
        .and_then(|d| d.get(key.as_str()).map(show))
        .unwrap_or_default();
    let detail = message.split(" at line").next().unwrap_or(message);
    LayeredError::BadValue {
        key: key.clone(),
        value: show(value),
        source_name: "the merged configuration".to_string(),
        expected: format!("value ({detail})"),
        fix: format!("use a value like the default, {default}"),
    }
}

/// Valid keys closest to `key` by edit distance (at most 3 edits, or sharing a word), best first.
fn suggest(known: &[(String, Kind)], key: &str) -> Vec<String> {
    let mut scored: BTreeMap<usize, Vec<&str>> = BTreeMap::new();
    for (name, _) in known {
        let d = edit_distance(key, name);
        let shares_word = key
            .split('_')
            .filter(|w| w.len() >= 4)
            .any(|w| name.split('_').any(|n| n == w));
        if d <= 3 || shares_word {
            scored.entry(d).or_default().push(name);
        }
    }
    scored
        .into_values()
        .flatten()
        .take(3)
        .map(str::to_string)
        .collect()
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let cost = usize::from(ca != *cb);
            cur[j + 1] = (prev[j] + cost).min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Default, PartialEq, Serialize, serde::Deserialize)]
    #[serde(default, deny_unknown_fields)]
    struct Demo {
        port: u16,
        name: String,
        on: bool,
    }

    const DEMO: Schema = Schema {
        service: "demo",
        env_prefix: "DEMO_",
        upstream: &[],
    };

    #[test]
    fn kinds_come_from_the_defaults() {
        let k = keys::<Demo>();
        assert_eq!(
            k,
            vec![
                ("port".to_string(), Kind::Num),
                ("name".to_string(), Kind::Str),
                ("on".to_string(), Kind::Bool)
            ]
        );
    }

    #[test]
    fn flags_leave_out_unset_options() {
        #[derive(Serialize)]
        struct Args {
            port: Option<u16>,
            name: Option<String>,
            on: Option<bool>,
            #[serde(skip)]
            _config: Option<PathBuf>,
        }
        let f = flags_of(&Args {
            port: Some(7),
            name: None,
            on: Some(true),
            _config: None,
        });
        assert_eq!(
            f,
            vec![
                ("port".to_string(), "7".to_string()),
                ("on".to_string(), "true".to_string())
            ]
        );
        let env = |v: &str| (v == "DEMO_NAME").then(|| "x".to_string());
        let got = load::<Demo>(
            &DEMO,
            &Sources {
                file: None,
                flags: f,
            },
            &env,
        )
        .expect("load");
        assert_eq!(
            got.config,
            Demo {
                port: 7,
                name: "x".into(),
                on: true
            }
        );
    }

    #[test]
    fn unknown_keys_name_the_service() {
        let e = load::<Demo>(
            &DEMO,
            &Sources {
                file: None,
                flags: vec![("qqqqqqqq".into(), "1".into())],
            },
            &|_| None,
        )
        .expect_err("unknown");
        assert_eq!(
            e.to_string(),
            "unknown demo config key \"qqqqqqqq\" in the command line; valid keys: port, name, on"
        );
    }

    #[test]
    fn suggestions_are_close_keys() {
        let known = keys::<crate::master::MasterConfig>();
        assert_eq!(
            suggest(&known, "client_tll"),
            vec!["client_ttl".to_string()]
        );
        assert!(suggest(&known, "lease_ttl").contains(&"default_kv_lease_ttl".to_string()));
        assert!(suggest(&known, "qqqq").is_empty());
    }
}
