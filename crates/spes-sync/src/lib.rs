//! SPES as plain functions and a small state machine over named tensors, testable without a
//! network: who owns which expert (`ownership`), how a round's uploads become the next global
//! model, expert merging included (`round`), the server's optional outer optimizer (`outer`),
//! when rounds close and who is a member (`coordinator`), and the exact bf16 deltas that travel
//! instead of whole tensors (`delta`).

pub mod coordinator;
pub mod delta;
pub mod outer;
pub mod ownership;
pub mod round;

pub use coordinator::{Coordinator, RoundError, RoundReport, RoundRules, Standing};
pub use delta::{RoundDelta, Sparse, WireForm};
pub use outer::{OuterRule, OuterRules};
pub use ownership::Ownership;
pub use round::{
    merge_experts, validate, validate_compressed, validate_delta, Aggregator, Combine, Combined,
    Layout, MergeEvent, MergeSchedule, Named, Scope,
};
