//! Magnitude selection: exact top-k, threshold and seeded random-k.
//!
//! These are the entry points the frame encoder uses. They must produce exactly what the
//! [`crate::scalar`] specification produces.

pub use crate::scalar::{Cut, Selection};

/// Scratch words [`topk_cut`] needs for a tensor of `n` elements.
pub const fn topk_scratch_len(_n: usize) -> usize {
    crate::scalar::TOPK_HIST
}

/// The cut of exact top-k for `1 <= k <= g.len()` (ties to the lower index). `g` must be
/// finite; `scratch` holds at least [`topk_scratch_len`] words.
pub fn topk_cut(g: &[f32], k: usize, scratch: &mut [u32]) -> Cut {
    crate::scalar::topk_cut(g, k, scratch)
}

/// The selection of top-k with `k` resolved for `g.len()`.
pub fn topk(g: &[f32], k: usize, scratch: &mut [u32]) -> Selection {
    if k == 0 {
        Selection::None
    } else if k >= g.len() {
        Selection::All
    } else {
        Selection::TopK(topk_cut(g, k, scratch))
    }
}

/// Calls `f(i)` for every kept index in ascending order.
pub fn for_each_kept(g: &[f32], sel: Selection, f: impl FnMut(usize)) {
    crate::scalar::for_each_kept(g, sel, f)
}
