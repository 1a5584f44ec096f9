//! The offline figures a trace replay is judged against, for the same capacity: the maximum
//! (an infinite cache), LRU, and Belady's optimal policy (it knows the future: the limit no
//! online policy reaches). A request hits the leading run of its blocks the cache holds, and
//! then every block of the request is used (the missing ones put), as the replay does.

use std::collections::{BTreeSet, HashMap, HashSet};

/// One request of a Mooncake-format trace.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Request {
    #[serde(default)]
    pub timestamp: u64,
    pub input_length: u64,
    pub hash_ids: Vec<u64>,
}

/// Tokens per block in Mooncake's traces.
pub const BLOCK_TOKENS: u64 = 512;

/// Hit tokens of one request whose leading `run` blocks are present.
pub fn hit_tokens(r: &Request, run: usize) -> u64 {
    (run as u64 * BLOCK_TOKENS).min(r.input_length)
}

/// Input tokens of the whole trace.
pub fn input_tokens(trace: &[Request]) -> u64 {
    trace.iter().map(|r| r.input_length).sum()
}

/// Hit rate with an infinite cache.
pub fn infinite(trace: &[Request]) -> f64 {
    let mut seen = HashSet::new();
    let mut hit = 0;
    for r in trace {
        let run = r.hash_ids.iter().take_while(|h| seen.contains(*h)).count();
        hit += hit_tokens(r, run);
        seen.extend(r.hash_ids.iter().copied());
    }
    hit as f64 / input_tokens(trace).max(1) as f64
}

/// Hit rate of LRU holding `capacity` blocks (recency in the order the request names them).
pub fn lru(trace: &[Request], capacity: usize) -> f64 {
    let mut tick = 0u64;
    let mut at: HashMap<u64, u64> = HashMap::new();
    let mut order: BTreeSet<(u64, u64)> = BTreeSet::new();
    let mut hit = 0;
    for r in trace {
        let run = r
            .hash_ids
            .iter()
            .take_while(|h| at.contains_key(*h))
            .count();
        hit += hit_tokens(r, run);
        for &h in &r.hash_ids {
            tick += 1;
            if let Some(old) = at.insert(h, tick) {
                order.remove(&(old, h));
            }
            order.insert((tick, h));
            while at.len() > capacity {
                let Some((_, victim)) = order.pop_first() else {
                    break;
                };
                at.remove(&victim);
            }
        }
    }
    hit as f64 / input_tokens(trace).max(1) as f64
}

/// Hit rate of Belady's policy holding `capacity` blocks: on overflow it drops the block used
/// again furthest in the future (or never), which may be the one just used.
pub fn belady(trace: &[Request], capacity: usize) -> f64 {
    // next[i][j]: the request after i that uses r[i].hash_ids[j] next (usize::MAX: never).
    let mut last_seen: HashMap<u64, usize> = HashMap::new();
    let mut next: Vec<Vec<usize>> = trace
        .iter()
        .map(|r| vec![usize::MAX; r.hash_ids.len()])
        .collect();
    for (i, r) in trace.iter().enumerate().rev() {
        for (j, &h) in r.hash_ids.iter().enumerate() {
            next[i][j] = last_seen.get(&h).copied().unwrap_or(usize::MAX);
        }
        for &h in &r.hash_ids {
            last_seen.insert(h, i);
        }
    }
    let mut held: HashMap<u64, usize> = HashMap::new();
    let mut by_next: BTreeSet<(usize, u64)> = BTreeSet::new();
    let mut hit = 0;
    for (i, r) in trace.iter().enumerate() {
        let run = r
            .hash_ids
            .iter()
            .take_while(|h| held.contains_key(*h))
            .count();
        hit += hit_tokens(r, run);
        for (j, &h) in r.hash_ids.iter().enumerate() {
            let n = next[i][j];
            if let Some(old) = held.insert(h, n) {
                by_next.remove(&(old, h));
            }
            by_next.insert((n, h));
            while held.len() > capacity {
                let Some((_, victim)) = by_next.pop_last() else {
                    break;
                };
                held.remove(&victim);
            }
        }
    }
    hit as f64 / input_tokens(trace).max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(ids: &[u64]) -> Request {
        Request {
            timestamp: 0,
            input_length: ids.len() as u64 * BLOCK_TOKENS,
            hash_ids: ids.to_vec(),
        }
    }

    #[test]
    fn a_request_hits_only_its_leading_run() {
        let t = [req(&[1, 2, 3]), req(&[1, 9, 3])];
        // The second request's 3 is cached but follows a miss: only block 1 counts.
        assert!((infinite(&t) - 1.0 / 6.0).abs() < 1e-9);
    }

    #[test]
    fn lru_drops_the_least_recent_and_belady_keeps_what_comes_back() {
        // Capacity 2: A B, C (LRU drops A), A again.
        let t = [req(&[1]), req(&[2]), req(&[3]), req(&[1])];
        assert_eq!(lru(&t, 2), 0.0);
        assert!((belady(&t, 2) - 0.25).abs() < 1e-9, "Belady keeps block 1");
        assert!((infinite(&t) - 0.25).abs() < 1e-9);
    }

    #[test]
    fn a_hit_is_capped_at_the_input_length() {
        let t = [
            Request {
                timestamp: 0,
                input_length: 600,
                hash_ids: vec![1, 2],
            },
            Request {
                timestamp: 0,
                input_length: 600,
                hash_ids: vec![1, 2],
            },
        ];
        assert!((infinite(&t) - 0.5).abs() < 1e-9);
    }
}
