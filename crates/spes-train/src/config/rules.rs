//! Rules of the recipe: the keys a config leaves out or sets to `"auto"` are derived from the
//! rest of the run (node count, run length, sync interval) when the config is parsed, so a
//! recipe nobody tuned on gets rates and schedules that follow it. Explicit numbers override.
//! The measurements behind each rule are in docs/results/quality.md (the recipe grid).

use super::{Mode, RunConfig, SecondMoment};
use anyhow::{bail, Result};

/// One value a rule derived: the key, the value and the rule in words, as the resolved config
/// shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct Derived {
    /// `section.key`.
    pub key: &'static str,
    pub value: toml::Value,
    pub rule: &'static str,
}

impl std::fmt::Display for Derived {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} = {} (auto: {})", self.key, self.value, self.rule)
    }
}

/// What a node's AdamW second moment is fed: an estimate of every node's batch together
/// where nodes average their steps (SPES and DiLoCo with more than one node) and a step's rows
/// split in two halves (batch_size × grad_accum ≥ 2); the node's own elsewhere. The estimate
/// brought every recipe of the grid closer to centralized, beyond the seed spread
/// (docs/results/quality.md#the-fix-on-four-recipes--2-seeds-2026-12-06).
pub fn second_moment(mode: Mode, nodes: usize, rows_per_step: usize) -> SecondMoment {
    match mode {
        Mode::Spes | Mode::Diloco if nodes > 1 && rows_per_step >= 2 => SecondMoment::UnionEstimate,
        _ => SecondMoment::Own,
    }
}

/// Nodes' rate for the shared parameters over the centralized rate `train.lr`: averaging n
/// nodes' AdamW steps cancels part of their noise, so the mean moves about 1/√n as far as one
/// step on the n-fold batch; √n gives it back. 1 for a centralized run, and for nodes whose
/// second moment estimates the n-fold batch's (`train.second_moment = "union_estimate"`),
/// whose mean step is already as long.
pub fn node_lr_scale(mode: Mode, nodes: usize, second_moment: SecondMoment) -> f64 {
    match (mode, second_moment) {
        (Mode::Centralized, _) | (_, SecondMoment::UnionEstimate) => 1.0,
        (Mode::Spes | Mode::Diloco, SecondMoment::Own) => (nodes as f64).sqrt(),
    }
}

/// Experts' rate over the nodes' shared rate: in SPES an owned expert's change is its owner's
/// alone, not an average, so it steps at the centralized rate (1 / `node_lr_scale`); DiLoCo
/// averages experts like everything else (1).
pub fn expert_lr_scale(mode: Mode, node_lr_scale: f64) -> f64 {
    match mode {
        Mode::Spes => 1.0 / node_lr_scale,
        Mode::Centralized | Mode::Diloco => 1.0,
    }
}

/// Linear warm-up over the first tenth of the schedule (`t_max`, or `max_steps`).
pub fn warmup_steps(schedule_steps: u64) -> u64 {
    (schedule_steps as f64 / 10.0).round() as u64
}

/// The merge warm-up's α reaches 0 three quarters into the run.
pub fn merge_until(max_steps: u64) -> u64 {
    max_steps * 3 / 4
}

/// Three merges before `merge_until`: every third of it, on a sync step.
pub fn merge_every(merge_until: u64, sync_steps: u64) -> u64 {
    let h = sync_steps.max(1);
    (merge_until / 3 / h * h).max(h)
}

/// A key whose default is a rule: `section.key`, the rule in words, and the rule itself, read
/// from the config with every earlier rule's result filled in.
struct Rule {
    key: &'static str,
    /// The words the key takes besides "auto" (none: it takes numbers).
    words: &'static [&'static str],
    text: &'static str,
    derive: fn(&RunConfig) -> toml::Value,
}

/// The rules, in the order they are derived (later rules may read earlier results).
const RULES: [Rule; 6] = [
    Rule {
        key: "train.second_moment",
        words: &["own", "union_estimate"],
        text: "\"union_estimate\" on SPES and DiLoCo nodes (sync.nodes > 1) of ≥ 2 rows a step, \"own\" otherwise",
        derive: |c| {
            let t = &c.train;
            let m = second_moment(c.sync.mode, c.sync.nodes, t.batch_size * t.grad_accum);
            match m {
                SecondMoment::Own => "own",
                SecondMoment::UnionEstimate => "union_estimate",
            }
            .into()
        },
    },
    Rule {
        key: "train.node_lr_scale",
        words: &[],
        text: "√sync.nodes on SPES and DiLoCo nodes, 1 centralized or with train.second_moment = \"union_estimate\"",
        derive: |c| node_lr_scale(c.sync.mode, c.sync.nodes, c.train.second_moment).into(),
    },
    Rule {
        key: "train.expert_lr_scale",
        words: &[],
        text: "1 / train.node_lr_scale in SPES: experts at the centralized rate",
        derive: |c| expert_lr_scale(c.sync.mode, c.train.node_lr_scale).into(),
    },
    Rule {
        key: "train.warmup_steps",
        words: &[],
        text: "a tenth of train.t_max, or of train.max_steps",
        derive: |c| {
            let t = &c.train;
            let schedule = if t.t_max == 0 { t.max_steps } else { t.t_max };
            (warmup_steps(schedule) as i64).into()
        },
    },
    Rule {
        key: "sync.merge_until",
        words: &[],
        text: "three quarters of train.max_steps",
        derive: |c| (merge_until(c.train.max_steps) as i64).into(),
    },
    Rule {
        key: "sync.merge_every",
        words: &[],
        text: "a third of sync.merge_until, on a sync step",
        derive: |c| (merge_every(c.sync.merge_until, c.sync.sync_steps) as i64).into(),
    },
];

/// Fills every rule key that `doc` leaves out or sets to `"auto"` (`doc` holds the config
/// after overrides, with its model preset resolved) and returns what was derived.
pub(crate) fn resolve(doc: &mut toml::Table) -> Result<Vec<Derived>> {
    let mut auto = Vec::new();
    for rule in &RULES {
        let (section, key) = rule.key.split_once('.').expect("section.key");
        match doc.get(section).and_then(|s| s.get(key)) {
            None => auto.push(rule),
            Some(toml::Value::String(s)) if s == "auto" => auto.push(rule),
            Some(toml::Value::String(s)) if rule.words.contains(&s.as_str()) => {}
            Some(toml::Value::String(s)) if rule.words.is_empty() => {
                bail!("key `{section}.{key}`: expected a number or \"auto\", got \"{s}\"")
            }
            Some(toml::Value::String(s)) => {
                let words: Vec<String> = rule.words.iter().map(|w| format!("\"{w}\"")).collect();
                bail!(
                    "key `{section}.{key}`: expected {} or \"auto\", got \"{s}\"",
                    words.join(", ")
                )
            }
            Some(_) => {}
        }
    }
    // What the rules read, with every other default filled in: the config without the keys
    // still to derive, each rule's result added before the next reads it.
    let mut bare = doc.clone();
    for rule in &auto {
        let (section, key) = rule.key.split_once('.').expect("section.key");
        if let Some(t) = bare.get_mut(section).and_then(|s| s.as_table_mut()) {
            t.remove(key);
        }
    }
    let mut derived = Vec::new();
    for rule in auto {
        let base: RunConfig = serde_path_to_error::deserialize(toml::Value::Table(bare.clone()))
            .map_err(|e| anyhow::anyhow!("key `{}`: {}", e.path(), e.inner()))?;
        let value = (rule.derive)(&base);
        let (section, key) = rule.key.split_once('.').expect("section.key");
        for table in [&mut *doc, &mut bare] {
            let section = table
                .entry(section)
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            let Some(section) = section.as_table_mut() else {
                bail!("`{}` is not a section", rule.key);
            };
            section.insert(key.to_owned(), value.clone());
        }
        derived.push(Derived {
            key: rule.key,
            value,
            rule: rule.text,
        });
    }
    Ok(derived)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn tiny(sets: &[&str]) -> RunConfig {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/spes-tiny.toml");
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        RunConfig::load(&path, &sets).unwrap()
    }

    /// The demo's config states the centralized rate; the rules give back the rates and
    /// schedule it was tuned with (docs/results/quality.md), to the bit: with the union
    /// estimate every rate is the centralized one, with the node's own second moment the
    /// shared parameters step √n as far.
    #[test]
    fn the_demo_config_derives_its_tuned_values() {
        let c = tiny(&[]);
        assert_eq!(c.train.lr, 3e-3);
        assert_eq!(c.train.second_moment, SecondMoment::UnionEstimate);
        assert_eq!(c.train.node_lr(), 3e-3);
        assert_eq!(c.train.node_lr() * c.train.expert_lr_scale, 3e-3);
        let own = tiny(&["train.second_moment=\"own\""]);
        assert_eq!(own.train.node_lr(), 6e-3);
        assert_eq!(own.train.node_lr() * own.train.expert_lr_scale, 3e-3);
        assert_eq!(c.train.warmup_steps, 40);
        assert_eq!((c.sync.merge_every, c.sync.merge_until), (100, 300));
        let keys: Vec<&str> = c.derived.iter().map(|d| d.key).collect();
        assert_eq!(
            keys,
            [
                "train.second_moment",
                "train.node_lr_scale",
                "train.expert_lr_scale",
                "train.warmup_steps",
                "sync.merge_until",
                "sync.merge_every"
            ]
        );
        assert_eq!(
            c.derived[3].to_string(),
            "train.warmup_steps = 40 (auto: a tenth of train.t_max, or of train.max_steps)"
        );
    }

    /// The rules follow the recipe: node count, run length, sync interval and mode.
    #[test]
    fn rules_follow_the_recipe() {
        let own = "train.second_moment=\"own\"";
        let c = tiny(&["sync.nodes=8", "train.max_steps=250", own]);
        assert_eq!(c.train.node_lr_scale, 8f64.sqrt());
        assert_eq!(c.train.expert_lr_scale, 1.0 / 8f64.sqrt());
        assert_eq!(c.train.warmup_steps, 25);
        assert_eq!((c.sync.merge_every, c.sync.merge_until), (60, 187));
        let c = tiny(&[
            "sync.nodes=2",
            "train.max_steps=1000",
            "train.t_max=2000",
            own,
        ]);
        assert_eq!(c.train.node_lr_scale, 2f64.sqrt());
        assert_eq!(c.train.warmup_steps, 200, "a tenth of t_max");
        let c = tiny(&["sync.mode=diloco", own]);
        assert_eq!((c.train.node_lr_scale, c.train.expert_lr_scale), (2.0, 1.0));
        let c = tiny(&["sync.mode=centralized", "train.batch_size=16"]);
        assert_eq!((c.train.node_lr(), c.train.expert_lr_scale), (3e-3, 1.0));
        assert_eq!(c.train.second_moment, SecondMoment::Own);
        // The estimate needs nodes to average over and two halves of a step's rows.
        let estimate =
            |sets: &[&str]| tiny(sets).train.second_moment == SecondMoment::UnionEstimate;
        assert!(estimate(&["sync.mode=diloco"]));
        assert!(!estimate(&["sync.nodes=1"]));
        assert!(!estimate(&["train.batch_size=1"]));
        assert!(estimate(&["train.batch_size=1", "train.grad_accum=2"]));
        let c = tiny(&["sync.nodes=1"]);
        assert_eq!(c.train.node_lr_scale, 1.0);
        assert_eq!(merge_every(10, 5), 5, "at least one sync step");
    }

    /// Explicit numbers override, "auto" asks for the rule, anything else is refused by key;
    /// a resolved config parses back to itself with nothing left to derive.
    #[test]
    fn explicit_values_override_and_resolved_configs_are_fixed_points() {
        let c = tiny(&["train.node_lr_scale=1", "sync.merge_every=50"]);
        assert_eq!(c.train.node_lr(), 3e-3);
        assert_eq!(c.train.expert_lr_scale, 1.0, "1 / the explicit scale");
        assert_eq!(c.sync.merge_every, 50);
        assert!(!c.derived.iter().any(|d| d.key == "sync.merge_every"));
        let c = tiny(&["train.warmup_steps=\"auto\""]);
        assert_eq!(c.train.warmup_steps, 40);
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/spes-tiny.toml");
        let e = RunConfig::load(&path, &["train.warmup_steps=\"soon\"".into()]).unwrap_err();
        assert!(format!("{e:#}").contains("`train.warmup_steps`: expected a number or \"auto\""));
        let e = RunConfig::load(&path, &["train.second_moment=\"mine\"".into()]).unwrap_err();
        assert!(format!("{e:#}").contains(
            "`train.second_moment`: expected \"own\", \"union_estimate\" or \"auto\", got \"mine\""
        ));
        let c = tiny(&["sync.nodes=8"]);
        let again = RunConfig::parse(&c.to_toml().unwrap(), &[]).unwrap();
        assert!(again.derived.is_empty());
        assert_eq!(
            toml::to_string(&again).unwrap(),
            toml::to_string(&c).unwrap()
        );
        assert!(c
            .to_toml()
            .unwrap()
            .starts_with("# derived by rule (docs/guides/configuration.md#rules):\n# train.second_moment = \"union_estimate\""));
    }
}
