//! The one mapping from the coordinator's typed errors to gRPC statuses. The status details
//! carry a [`Refusal`] (kind and round), which is what nodes decide on.

use crate::proto::{refusal::Kind, Refusal};
use prost::Message;
use spes_sync::RoundError;
use tonic::{Code, Status};

/// A status with a machine-readable refusal in its details.
pub fn status(code: Code, kind: Kind, round: u64, message: impl Into<String>) -> Status {
    let details = Refusal {
        kind: kind as i32,
        round,
    }
    .encode_to_vec();
    Status::with_details(code, message.into(), details.into())
}

/// The status for a coordinator refusal.
pub fn of_round_error(e: &RoundError) -> Status {
    let msg = e.to_string();
    match e {
        RoundError::Closed { fetch, .. } => {
            status(Code::FailedPrecondition, Kind::Closed, *fetch, msg)
        }
        RoundError::NotOpen { open, .. } => {
            status(Code::FailedPrecondition, Kind::NotOpen, *open, msg)
        }
        RoundError::Duplicate { round, .. } => {
            status(Code::AlreadyExists, Kind::Duplicate, *round, msg)
        }
        RoundError::NotMember { .. } => status(Code::FailedPrecondition, Kind::NotMember, 0, msg),
        RoundError::PeerTaken { .. } => status(Code::AlreadyExists, Kind::PeerTaken, 0, msg),
        RoundError::OutOfRange { .. } => status(Code::InvalidArgument, Kind::OutOfRange, 0, msg),
        RoundError::RunFull { .. } => status(Code::ResourceExhausted, Kind::RunFull, 0, msg),
        RoundError::NoRoom { .. } => status(Code::ResourceExhausted, Kind::NoRoom, 0, msg),
        RoundError::Invalid { .. } => status(Code::InvalidArgument, Kind::Invalid, 0, msg),
    }
}

/// The refusal a status carries, if any.
/// The status of a refused claim of data parts.
pub fn of_part_error(e: &spes_sync::PartError) -> Status {
    status(Code::FailedPrecondition, Kind::PartTaken, 0, e.to_string())
}

pub fn of_status(s: &Status) -> Option<Refusal> {
    Refusal::decode(s.details())
        .ok()
        .filter(|_| !s.details().is_empty())
}

/// The refusal kind of a status (`None` for statuses without one, e.g. transport errors).
pub fn kind(s: &Status) -> Option<Kind> {
    of_status(s).and_then(|r| Kind::try_from(r.kind).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closed_names_the_round_to_load() {
        let s = of_round_error(&RoundError::Closed { round: 4, fetch: 4 });
        assert_eq!(s.code(), Code::FailedPrecondition);
        assert_eq!(kind(&s), Some(Kind::Closed));
        assert_eq!(of_status(&s).unwrap().round, 4);
        assert_eq!(kind(&Status::unavailable("x")), None);
        let taken = of_round_error(&RoundError::PeerTaken {
            peer: 2,
            age_s: 1.0,
            wait_s: 2.0,
        });
        assert_eq!(kind(&taken), Some(Kind::PeerTaken));
        assert!(taken.message().contains("peer 2"));
    }
}
