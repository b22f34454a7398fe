//! Round settings between the server and its nodes: each published round carries the next
//! round's wire and overlap ([`RoundSettings`]), which every node takes at the round boundary;
//! the server keeps what an adaptive run chose in `<out>/choices.json`, which a rerun can
//! replay (`spes server --replay-choices`) to reproduce the run.

use crate::proto;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use spes_sync::{RoundSettings, SyncConfig, Wire};
pub use spes_train::metrics::Chosen;
use std::path::Path;

/// The protocol this build speaks (`JoinRequest.protocol`): 1 follows settings that change
/// between rounds.
pub const PROTOCOL: u32 = 1;

/// Where the server keeps an adaptive run's choices, under `--out`.
pub const CHOICES_FILE: &str = "choices.json";

/// Settings as a round's header carries them.
pub fn to_proto(s: RoundSettings) -> proto::RoundSettings {
    proto::RoundSettings {
        wire: s.wire.name().to_owned(),
        overlap: s.overlap,
        overlap_steps: s.overlap_steps,
    }
}

/// Settings from a round's header; a wire this build does not know is an error naming it.
pub fn from_proto(p: &proto::RoundSettings) -> Result<RoundSettings> {
    let wire = Wire::named(&p.wire).with_context(|| {
        format!(
            "the server announced wire `{}`, unknown to this spes",
            p.wire
        )
    })?;
    Ok(RoundSettings {
        wire,
        overlap: p.overlap,
        overlap_steps: p.overlap_steps,
    })
}

/// An adaptive run's choices, oldest first: what `choices.json` holds.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Choices {
    pub choices: Vec<Chosen>,
}

impl Choices {
    pub fn is_empty(&self) -> bool {
        self.choices.is_empty()
    }

    /// Reads a choices file, checked: rounds ascending from 1, delta wires only.
    pub fn read(path: &Path) -> Result<Choices> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let c: Choices = serde_json::from_str(&text)
            .with_context(|| format!("{}: not a choices file", path.display()))?;
        let mut after = 0;
        for (i, chosen) in c.choices.iter().enumerate() {
            if chosen.from_round <= after {
                bail!(
                    "{}: choices[{i}].from_round = {} must be above {after} (rounds start at 1, ascending)",
                    path.display(),
                    chosen.from_round
                );
            }
            if !chosen.settings.wire.is_delta() {
                bail!(
                    "{}: choices[{i}] picks wire `{}`; settings change between delta wires only",
                    path.display(),
                    chosen.settings.wire.name()
                );
            }
            after = chosen.from_round;
        }
        Ok(c)
    }

    /// Writes the file atomically under `out`.
    pub fn save(&self, out: &Path) -> Result<()> {
        spes_data::shard::write_atomic(
            &out.join(CHOICES_FILE),
            serde_json::to_string_pretty(self)?.as_bytes(),
        )
    }

    /// The settings of round `round`: the newest choice from it or before, else the config's.
    pub fn at(&self, round: u64, cfg: &SyncConfig) -> RoundSettings {
        self.choices
            .iter()
            .rev()
            .find(|c| c.from_round <= round)
            .map_or_else(|| cfg.settings(), |c| c.settings)
    }

    /// Records that the run takes `settings` from round `from_round` on, dropping choices from
    /// that round on (a restarted server that chose again).
    pub fn push(&mut self, chosen: Chosen) {
        self.choices.retain(|c| c.from_round < chosen.from_round);
        self.choices.push(chosen);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_travel_by_name_and_choices_are_checked() {
        for wire in [
            Wire::Bf16Delta,
            Wire::Int4Delta,
            Wire::LowrankDelta,
            Wire::Fp32,
        ] {
            let s = RoundSettings {
                wire,
                overlap: true,
                overlap_steps: 3,
            };
            assert_eq!(from_proto(&to_proto(s)).unwrap(), s);
        }
        let bad = proto::RoundSettings {
            wire: "int3_delta".into(),
            ..Default::default()
        };
        assert!(format!("{:#}", from_proto(&bad).unwrap_err()).contains("int3_delta"));

        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join(CHOICES_FILE);
        let lowrank = RoundSettings {
            wire: Wire::LowrankDelta,
            overlap: true,
            overlap_steps: 1,
        };
        let bf16 = RoundSettings {
            wire: Wire::Bf16Delta,
            overlap: false,
            overlap_steps: 0,
        };
        let mut c = Choices::default();
        c.push(Chosen {
            from_round: 4,
            settings: bf16,
            reason: "why".into(),
        });
        c.save(dir.path()).unwrap();
        let back = Choices::read(&file).unwrap();
        assert_eq!(back, c);
        let cfg = SyncConfig {
            wire: Wire::LowrankDelta.into(),
            overlap_steps: 1.into(),
            ..SyncConfig::default()
        };
        assert_eq!(back.at(3, &cfg), lowrank);
        assert_eq!(back.at(4, &cfg), bf16);
        assert_eq!(back.at(40, &cfg), bf16);
        // A restarted server that chooses again from round 3 replaces what followed.
        c.push(Chosen {
            from_round: 3,
            settings: lowrank,
            reason: String::new(),
        });
        assert_eq!(c.choices.len(), 1);

        std::fs::write(
            &file,
            r#"{"choices":[{"from_round":2,"settings":{"wire":"fp32","overlap":false,"overlap_steps":0}}]}"#,
        )
        .unwrap();
        let e = format!("{:#}", Choices::read(&file).unwrap_err());
        assert!(e.contains("choices[0]") && e.contains("fp32"), "{e}");
        std::fs::write(
            &file,
            r#"{"choices":[{"from_round":3,"settings":{"wire":"int4_delta","overlap":true,"overlap_steps":1}},{"from_round":3,"settings":{"wire":"bf16_delta","overlap":true,"overlap_steps":1}}]}"#,
        )
        .unwrap();
        let e = format!("{:#}", Choices::read(&file).unwrap_err());
        assert!(e.contains("choices[1].from_round = 3"), "{e}");
    }
}
