//! SPES as plain functions and a small state machine over named tensors, testable without a
//! network: who owns which expert (`ownership`), how a round's uploads become the next global
//! model, expert merging included (`round`), and when rounds close (`coordinator`).

pub mod coordinator;
pub mod ownership;
pub mod round;

pub use coordinator::{Coordinator, RoundReport, RoundRules};
pub use ownership::Ownership;
pub use round::{merge_experts, Aggregator, Layout, MergeEvent, MergeSchedule, Named, Scope};
