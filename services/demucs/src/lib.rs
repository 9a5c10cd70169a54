//! HTDemucs v4 on Burn.
pub use burn;
