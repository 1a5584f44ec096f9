//! Parsed values of the master's string keys: the vLLM stream's served model names and the
//! replica placement strategy.

use super::MasterConfigError;

/// Which model name the vLLM stream's topics carry (`kv_events_vllm_served_model_name`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum ServedModelNames {
    /// The key's model component.
    #[default]
    FromKey,
    /// One served name for every key.
    All(String),
    /// `(key model, served name)` pairs; a key model not listed keeps its own name.
    Map(Vec<(String, String)>),
}

/// Why a `kv_events_vllm_served_model_name` value was refused: the fix.
const SERVED_MODEL_FIX: &str = "give the served model name (Qwen/Qwen3-8B), or key_model=served \
     pairs, comma-separated (Qwen3-8B=Qwen/Qwen3-8B,Llama-3.1-8B=meta-llama/Llama-3.1-8B); \
     names cannot contain '@' (it separates a topic's parts)";

impl ServedModelNames {
    /// Parses the setting; the error is the fix.
    pub fn parse(value: &str) -> Result<ServedModelNames, &'static str> {
        let entries: Vec<&str> = value
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .collect();
        if entries.iter().any(|e| e.contains('@')) {
            return Err(SERVED_MODEL_FIX);
        }
        match entries.as_slice() {
            [] => Ok(ServedModelNames::FromKey),
            [one] if !one.contains('=') => Ok(ServedModelNames::All((*one).to_string())),
            many => many
                .iter()
                .map(|e| match e.split_once('=') {
                    Some((k, v)) if !k.trim().is_empty() && !v.trim().is_empty() => {
                        Ok((k.trim().to_string(), v.trim().to_string()))
                    }
                    _ => Err(SERVED_MODEL_FIX),
                })
                .collect::<Result<Vec<_>, _>>()
                .map(ServedModelNames::Map),
        }
    }

    /// The served name of a key's model component.
    pub fn served<'a>(&'a self, key_model: &'a str) -> &'a str {
        match self {
            ServedModelNames::FromKey => key_model,
            ServedModelNames::All(name) => name,
            ServedModelNames::Map(pairs) => pairs
                .iter()
                .find(|(k, _)| k == key_model)
                .map_or(key_model, |(_, v)| v),
        }
    }
}

/// How the master places a new object's replicas (upstream's `--allocation_strategy`). Both
/// consider only segments whose largest free range fits the object, so a segment with much
/// free space in small holes is never picked only to fail (upstream's `free_ratio_first` ranks
/// by free bytes alone). Preferred segments (`preferred_segments`) come first either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AllocationStrategy {
    /// Uniformly at random among the segments with room (upstream's default).
    #[default]
    Random,
    /// The segments with the highest share of free bytes first; ties at random.
    FreeRatioFirst,
}

impl AllocationStrategy {
    /// Parses `--allocation_strategy`, naming the values lunakv implements on refusal.
    pub fn parse(value: &str) -> Result<AllocationStrategy, MasterConfigError> {
        match value {
            "random" => Ok(AllocationStrategy::Random),
            "free_ratio_first" => Ok(AllocationStrategy::FreeRatioFirst),
            other => Err(MasterConfigError::Invalid {
                field: "allocation_strategy",
                value: format!("{other:?}"),
                fix: "use random (the default) or free_ratio_first; upstream's \
                      ssd_free_ratio_first, local_first and cxl are not implemented (for \
                      local_first, name the local segment in ReplicateConfig's \
                      preferred_segment)"
                    .to_string(),
            }),
        }
    }
}
