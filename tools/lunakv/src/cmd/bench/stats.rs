//! Small statistics helpers: nearest-rank percentiles and median/best of repeated runs.

use serde::Serialize;

/// Nearest-rank percentile of sorted samples (0 for none).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Repeated measurements of a rate (higher is better).
#[derive(Debug, Clone, Serialize)]
pub struct Spread {
    pub median: f64,
    pub best: f64,
    pub samples: Vec<f64>,
}

impl Spread {
    pub fn of(samples: Vec<f64>) -> Spread {
        let mut sorted = samples.clone();
        sorted.sort_by(f64::total_cmp);
        Spread {
            median: percentile(&sorted, 50.0),
            best: sorted.last().copied().unwrap_or(0.0),
            samples,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&v, 100.0), 100.0);
        assert_eq!(percentile(&[3.0], 99.0), 3.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
        let s = Spread::of(vec![3.0, 1.0, 2.0]);
        assert_eq!((s.median, s.best), (2.0, 3.0));
    }
}
