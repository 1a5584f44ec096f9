//! How the sidecar's file and flags write values that are not plain scalars: lists as a YAML
//! sequence or one comma-separated string, durations as Go writes them. [`crate::config::Cli`]
//! names these in its serde attributes.

/// serde for a list given as a YAML sequence or as one comma-separated string
/// (`prefiller,decoder`), as llm-d's YAML and flags write lists.
pub(crate) mod list {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum List {
        Seq(Vec<String>),
        Csv(String),
    }

    pub fn serialize<S: Serializer>(v: &[String], s: S) -> Result<S::Ok, S::Error> {
        v.serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
        Ok(match List::deserialize(d)? {
            List::Seq(v) => v,
            List::Csv(s) => s
                .split(',')
                .map(|x| x.trim().to_string())
                .filter(|x| !x.is_empty())
                .collect(),
        })
    }
}

/// serde for Go durations (`200ms`, `1m30s`) through the one [`lunakv_config::parse_duration`];
/// written back in a form it reads.
pub(crate) mod go_duration {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        let text = if d.subsec_nanos() == 0 {
            format!("{}s", d.as_secs())
        } else if d.subsec_nanos().is_multiple_of(1_000_000) {
            format!("{}ms", d.as_millis())
        } else {
            format!("{}ns", d.as_nanos())
        };
        s.serialize_str(&text)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(d)?;
        lunakv_config::parse_duration(&text).map_err(serde::de::Error::custom)
    }
}
