//! Paired, interleaved trials: limit, row, limit, row, ... Each pair's two figures are taken
//! back to back, so a burst of neighbour load on a shared machine lands on both sides of one
//! ratio (or skews one pair) instead of biasing the whole run. Verdicts use the median ratio.

use serde::Serialize;

/// One pair: the machine's limit and the row, measured one right after the other.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Pair {
    pub limit: f64,
    pub row: f64,
    /// row / limit (0 when the limit is not positive).
    pub ratio: f64,
}

impl Pair {
    pub fn new(limit: f64, row: f64) -> Pair {
        Pair {
            limit,
            row,
            ratio: if limit > 0.0 { row / limit } else { 0.0 },
        }
    }
}

/// A ratio target judged over paired trials.
#[derive(Debug, Clone, Serialize)]
pub struct PairedRatio {
    pub name: &'static str,
    /// What the ratio compares, for the table.
    pub label: &'static str,
    pub unit: &'static str,
    pub pairs: Vec<Pair>,
    pub median_ratio: f64,
    pub min_ratio: f64,
    pub max_ratio: f64,
    /// The median ratio must reach this.
    pub threshold_ratio: f64,
    pub pass: bool,
}

impl PairedRatio {
    pub fn judge(
        name: &'static str,
        label: &'static str,
        unit: &'static str,
        pairs: Vec<Pair>,
        threshold_ratio: f64,
    ) -> PairedRatio {
        let ratios: Vec<f64> = pairs.iter().map(|p| p.ratio).collect();
        let median_ratio = median(&ratios);
        PairedRatio {
            name,
            label,
            unit,
            median_ratio,
            min_ratio: ratios
                .iter()
                .copied()
                .fold(f64::INFINITY, f64::min)
                .min(median_ratio),
            max_ratio: ratios.iter().copied().fold(0.0, f64::max),
            threshold_ratio,
            // No pairs is no evidence: a MISS, never a vacuous PASS.
            pass: !pairs.is_empty() && median_ratio >= threshold_ratio,
            pairs,
        }
    }

    /// Median of the pairs' `limit` (or `row`) figures, for the text.
    pub fn median_of(&self, f: impl Fn(&Pair) -> f64) -> f64 {
        median(&self.pairs.iter().map(f).collect::<Vec<_>>())
    }
}

/// The true median (mean of the middle two for an even count); 0 for none.
pub fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let m = s.len() / 2;
    if s.len() % 2 == 1 {
        s[m]
    } else {
        (s[m - 1] + s[m]) / 2.0
    }
}

/// Runs `pairs` interleaved trials: `limit()` then `row()` each time.
pub fn interleave(
    pairs: usize,
    mut limit: impl FnMut(usize) -> anyhow::Result<f64>,
    mut row: impl FnMut(usize) -> anyhow::Result<f64>,
) -> anyhow::Result<Vec<Pair>> {
    let mut out = Vec::with_capacity(pairs);
    for i in 0..pairs {
        let l = limit(i)?;
        let r = row(i)?;
        out.push(Pair::new(l, r));
    }
    Ok(out)
}

/// /proc/loadavg's three load averages ("" where there is none, e.g. not Linux).
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_odd_even_and_empty() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&[]), 0.0);
    }

    #[test]
    fn interleave_alternates_limit_and_row() {
        let log = std::cell::RefCell::new(Vec::new());
        let pairs = interleave(
            3,
            |i| {
                log.borrow_mut().push(format!("limit{i}"));
                Ok(2.0)
            },
            |i| {
                log.borrow_mut().push(format!("row{i}"));
                Ok(i as f64 + 1.0)
            },
        )
        .expect("pairs");
        assert_eq!(
            log.into_inner(),
            ["limit0", "row0", "limit1", "row1", "limit2", "row2"]
        );
        assert_eq!(pairs[2], Pair::new(2.0, 3.0));
        assert_eq!(pairs[2].ratio, 1.5);
    }

    #[test]
    fn verdict_uses_the_median_not_an_outlier() {
        // One pair where the neighbour's burst hit only the row side: the median still passes.
        let pairs = vec![
            Pair::new(2.0, 1.8),
            Pair::new(2.0, 0.4),
            Pair::new(1.0, 0.9),
            Pair::new(1.5, 1.5),
            Pair::new(2.0, 1.7),
        ];
        let r = PairedRatio::judge("t", "l", "GB/s", pairs, 0.75);
        assert!(r.pass);
        assert_eq!(r.median_ratio, 0.9);
        assert_eq!((r.min_ratio, r.max_ratio), (0.2, 1.0));
        assert_eq!(r.median_of(|p| p.limit), 2.0);
        // ...and a median below the threshold misses even with one high pair.
        let pairs = vec![
            Pair::new(1.0, 3.0),
            Pair::new(1.0, 0.5),
            Pair::new(1.0, 0.6),
        ];
        assert!(!PairedRatio::judge("t", "l", "GB/s", pairs, 0.75).pass);
    }

    #[test]
    fn no_pairs_or_zero_limit_is_a_miss() {
        assert!(!PairedRatio::judge("t", "l", "GB/s", vec![], 0.0).pass);
        assert_eq!(Pair::new(0.0, 1.0).ratio, 0.0);
    }
}
