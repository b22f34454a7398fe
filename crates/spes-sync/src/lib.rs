//! SPES as plain state machines over named tensors, testable without a network. The server's
//! half is the [`Coordinator`] (when rounds close, who is a member, how uploads become the next
//! global model); the node's half is the [`Replica`] (what a node uploads, what it fetches, how
//! a published round becomes its weights). Around them: the `[sync]` config both read
//! (`config`), named tensors and the model's layout (`named`), who owns which expert
//! (`ownership`), who reads which data part (`parts`), how much each node trains in a round (`budget`), one round's aggregation and expert merging (`round`), the server's optional
//! outer optimizer (`outer`), and the one delta type that travels between them (`delta`).

pub mod budget;
pub mod config;
pub mod coordinator;
pub mod delta;
mod hearing;
pub mod loss_table;
pub mod named;
pub mod outer;
pub mod ownership;
pub mod parts;
pub mod replica;
pub mod round;
pub mod wire_cost;

pub use budget::Work;
pub use config::{
    AggregateRule, AverageBy, Choice, Feedback, MergeSimilarity, Mode, RoundBy, RoundSettings,
    SyncConfig, Wire, FIRST_ROUNDS,
};
pub use coordinator::{
    after_lossless_round, Coordinator, PeerWork, RoundError, RoundReport, Standing, Start,
};
pub use delta::{Delta, Deltas, RoundDelta};
pub use loss_table::{LossRow, LOSS_TABLE};
pub use named::{Layout, Named};
pub use outer::OuterRule;
pub use ownership::{Claims, Ownership, UNOWNED};
pub use parts::{PartBook, PartError};
pub use replica::{
    Applied, FetchPlan, Follow, Prepared, Preparer, Published, Replica, ReplicaError, ReplicaState,
    Sent, Uploader,
};
pub use round::{merge_experts, validate, Aggregator, Combined, MergeEvent, Scope};
