//! The loss statistics the policies read: a window of recent losses (mean
//! and deviation, for policy 1) and a running least-squares fit of the loss
//! against the counter (for policy 2).

use std::collections::VecDeque;

/// The last [`LOSS_WINDOW`](super::LOSS_WINDOW) finite losses.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct LossWindow {
    values: VecDeque<f64>,
}

impl LossWindow {
    pub(crate) fn from_values(values: Vec<f64>) -> Self {
        LossWindow {
            values: values.into(),
        }
    }

    pub(crate) fn values(&self) -> Vec<f64> {
        self.values.iter().copied().collect()
    }

    pub(crate) fn len(&self) -> usize {
        self.values.len()
    }

    /// Mean and population standard deviation, or None when empty.
    pub(crate) fn mean_std(&self) -> Option<(f64, f64)> {
        if self.values.is_empty() {
            return None;
        }
        let n = self.values.len() as f64;
        let mean = self.values.iter().sum::<f64>() / n;
        let var = self
            .values
            .iter()
            .map(|v| (v - mean) * (v - mean))
            .sum::<f64>()
            / n;
        Some((mean, var.sqrt()))
    }

    /// Appends `value`, dropping the oldest beyond `cap`.
    pub(crate) fn push(&mut self, value: f64, cap: usize) {
        self.values.push_back(value);
        while self.values.len() > cap {
            self.values.pop_front();
        }
    }
}

/// Running sums of a least-squares line through `(x, loss)` points, where
/// `x` is the counter minus the start of the measurement window (small, so
/// the sums keep their precision).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TrendSums {
    pub n: u64,
    pub sum_x: f64,
    pub sum_y: f64,
    pub sum_xx: f64,
    pub sum_xy: f64,
}

impl TrendSums {
    pub(crate) fn push(&mut self, x: f64, y: f64) {
        self.n += 1;
        self.sum_x += x;
        self.sum_y += y;
        self.sum_xx += x * x;
        self.sum_xy += x * y;
    }

    /// `(slope, mean loss)` of the fitted line, or None when there are
    /// fewer than `min_points` points or all share one `x`.
    pub(crate) fn fit(&self, min_points: u64) -> Option<(f64, f64)> {
        if self.n < min_points {
            return None;
        }
        let n = self.n as f64;
        let sxx = self.sum_xx - self.sum_x * self.sum_x / n;
        let sxy = self.sum_xy - self.sum_x * self.sum_y / n;
        if sxx <= 0.0 || !sxx.is_finite() || !sxy.is_finite() {
            return None;
        }
        Some((sxy / sxx, self.sum_y / n))
    }

    pub(crate) fn is_finite(&self) -> bool {
        [self.sum_x, self.sum_y, self.sum_xx, self.sum_xy]
            .iter()
            .all(|v| v.is_finite())
    }
}
