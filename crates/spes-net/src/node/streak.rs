//! Refusals that repeat. A node whose uploads the server refuses the same way again and again
//! is making no progress, whatever the cause; instead of spinning it waits, longer each time,
//! says so at most once a minute, and asks to join again. Time is passed in.

use crate::proto::refusal::Kind as Refused;
use std::time::Duration;

/// Refusals of one kind in a row that are part of normal life (a round that closed while the
/// node was away is refused once, then the node trains the next).
const TOLERATED: u32 = 2;
/// The longest wait between tries.
const MAX_WAIT: Duration = Duration::from_secs(30);
/// The least time between two log lines about the same streak.
const LOG_EVERY_S: f64 = 60.0;

/// What to do about a refusal that repeats.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Backoff {
    /// How long to wait before joining again.
    pub wait: Duration,
    /// Refusals of this kind in a row, this one included.
    pub count: u32,
    /// Whether to log it (at most once a minute).
    pub log: bool,
}

/// The current run of refusals of one kind.
#[derive(Debug, Default)]
pub(super) struct Streak {
    kind: Option<Refused>,
    count: u32,
    logged_at: Option<f64>,
}

impl Streak {
    /// An upload was refused with `kind` at `now` (seconds): `Some` once the same kind has
    /// come more than [`TOLERATED`] times in a row.
    pub fn refused(&mut self, kind: Refused, now: f64) -> Option<Backoff> {
        if self.kind != Some(kind) {
            *self = Streak {
                kind: Some(kind),
                ..Streak::default()
            };
        }
        self.count += 1;
        let over = self.count.checked_sub(TOLERATED + 1)?;
        let wait = Duration::from_secs(1)
            .saturating_mul(1u32 << over.min(5))
            .min(MAX_WAIT);
        let log = self.logged_at.is_none_or(|t| now - t >= LOG_EVERY_S);
        if log {
            self.logged_at = Some(now);
        }
        Some(Backoff {
            wait,
            count: self.count,
            log,
        })
    }

    /// An upload went through: the streak is over.
    pub fn accepted(&mut self) {
        *self = Streak::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_refusal_backs_off_longer_and_logs_at_most_once_a_minute() {
        let mut s = Streak::default();
        let (mut now, mut logs, mut waits) = (0.0, Vec::new(), Vec::new());
        // Ten minutes of the same refusal, as fast as the node can be refused.
        while now < 600.0 {
            if let Some(b) = s.refused(Refused::Closed, now) {
                if b.log {
                    logs.push(now);
                }
                waits.push(b.wait);
                now += b.wait.as_secs_f64();
            }
            now += 0.35;
        }
        assert!(
            logs.windows(2).all(|w| w[1] - w[0] >= 60.0),
            "logged at {logs:?}"
        );
        assert!(logs.len() <= 11, "{} log lines in 10 minutes", logs.len());
        assert_eq!(waits[..3], [1, 2, 4].map(Duration::from_secs));
        assert!(waits.iter().all(|&w| w <= MAX_WAIT));
        assert_eq!(*waits.last().unwrap(), MAX_WAIT);
    }

    #[test]
    fn a_refusal_now_and_then_is_tolerated_and_an_upload_ends_the_streak() {
        let mut s = Streak::default();
        assert_eq!(s.refused(Refused::Closed, 0.0), None);
        assert_eq!(s.refused(Refused::Closed, 1.0), None);
        s.accepted();
        assert_eq!(s.refused(Refused::Closed, 2.0), None);
        // Another kind starts a streak of its own.
        assert_eq!(s.refused(Refused::NotMember, 3.0), None);
        assert_eq!(s.refused(Refused::NotMember, 4.0), None);
        let b = s.refused(Refused::NotMember, 5.0).unwrap();
        assert_eq!((b.count, b.wait, b.log), (3, Duration::from_secs(1), true));
    }
}
