//! Scoring ranked-classification tasks during training (`train.eval_tasks`), for both
//! `spes train` and the SPES server (which scores each published model).

use crate::config::RunConfig;
use crate::metrics::{TaskScore, Tasks};
use anyhow::{Context, Result};
use spes_eval::{Scoring, Task};
use spes_model::MoeModel;
use tch::Device;

/// Tasks, tokenizer and schedule of the in-training evaluation.
pub struct TaskHook {
    tasks: Vec<Task>,
    scoring: Scoring,
    every: u64,
    docs: usize,
}

impl TaskHook {
    /// `None` when the config asks for no task evaluation.
    pub fn load(cfg: &RunConfig, device: Device) -> Result<Option<Self>> {
        let t = &cfg.train;
        if t.eval_tasks.is_empty() || t.eval_tasks_every == 0 {
            return Ok(None);
        }
        let manifest = spes_data::Manifest::load(cfg.data.primary())?;
        let tokenizer = spes_data::tokenize::load_tokenizer(cfg.data.primary(), &manifest)?;
        let tasks = t
            .eval_tasks
            .iter()
            .map(|dir| {
                spes_eval::load_task(dir)
                    .with_context(|| format!("train.eval_tasks: {}", dir.display()))
            })
            .collect::<Result<_>>()?;
        Ok(Some(TaskHook {
            tasks,
            scoring: Scoring {
                tokenizer,
                eos: manifest.eos_id,
                ctx: t.seq_len,
                batch: t.batch_size,
                device,
            },
            every: t.eval_tasks_every,
            docs: t.eval_task_docs,
        }))
    }

    /// Whether to score at this step.
    pub fn due(&self, step: u64) -> bool {
        step.is_multiple_of(self.every)
    }

    /// Each task's scores for the model as it is now.
    pub fn score(&self, model: &MoeModel) -> Result<Tasks> {
        let mut out = Tasks::new();
        for task in &self.tasks {
            let s = spes_eval::score_task(model, &self.scoring, task, Some(self.docs), false)?;
            out.insert(
                s.task.clone(),
                TaskScore {
                    acc_raw: s.acc_raw,
                    acc_per_char: s.acc_per_char,
                    docs: s.docs,
                },
            );
        }
        Ok(out)
    }
}
